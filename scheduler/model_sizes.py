"""Per-model memory of a training job on one 16 GB V100, for traces that name models only.

Persistent bytes = 3 x fp32 parameters: weights, gradients and the SGD momentum buffer (the
optimizer of the TF CNN benchmarks the Tiresias trace was run with). Parameter counts are the
published ones (torchvision model docs; Inception-v4 from Szegedy et al. 2017). Ephemeral bytes
are the peak of one iteration's activations and workspace at the listed per-GPU batch size: rough
estimates chosen so each model fills a third to two thirds of a 16 GB device, as these CNNs do at
their usual batch sizes. They are estimates, not measurements; a measured trace should use the
native format, which carries sizes per job.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20


@dataclass(frozen=True)
class ModelSize:
    """Memory of one training job: parameters (millions), batch size, ephemeral peak (MiB)."""

    params_m: float
    batch: int
    ephemeral_mib: int

    @property
    def persistent_bytes(self) -> int:
        """Weights + gradients + momentum, fp32 (bytes)."""
        return int(3 * 4 * self.params_m * 1e6)

    @property
    def ephemeral_bytes(self) -> int:
        return self.ephemeral_mib * MIB


MODEL_SIZES: dict[str, ModelSize] = {
    "alexnet": ModelSize(61.1, 128, 1500),
    "googlenet": ModelSize(6.6, 128, 3800),
    "inception3": ModelSize(27.2, 64, 6000),
    "inception4": ModelSize(42.7, 32, 5800),
    "resnet50": ModelSize(25.6, 64, 5600),
    "resnet101": ModelSize(44.5, 64, 8400),
    "resnet152": ModelSize(60.2, 32, 6000),
    "vgg11": ModelSize(132.9, 32, 3000),
    "vgg16": ModelSize(138.4, 32, 4200),
    "vgg19": ModelSize(143.7, 32, 4600),
}

DEFAULT_SIZE = ModelSize(50.0, 32, 4096)
"""Unknown models: a mid-sized CNN (600 MB persistent, 4 GiB ephemeral)."""


def model_size(name: str) -> ModelSize:
    """The table entry for `name` (case-insensitive), else `DEFAULT_SIZE`."""
    return MODEL_SIZES.get(name.strip().lower(), DEFAULT_SIZE)
