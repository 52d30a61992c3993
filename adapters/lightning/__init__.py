"""PyTorch Lightning under `salusd run`: one line in the script's `Trainer`.

    import salus.lightning
    trainer = Trainer(max_steps=5000, callbacks=[salus.lightning.SalusCallback()])

Each training batch it reports the trainer's own step count (`global_step`), its planned steps
(`max_steps`, else the estimated stepping batches: the job's planned iterations, which SRTF
reads) and the last logged training loss, which `salusd status` and the job's metrics show;
with `SALUS_BOUNDARY=explicit` the end of each training batch is the job's iteration boundary.
Outside salusd it does nothing. Lightning is imported here, not by salusd (the `lightning`
extra: `pip install 'salusd[lightning]'`).
"""

from __future__ import annotations

import math
import os
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import Callback

from salus.adapters.torch.script import BOUNDARY_ENV, report, step

__all__ = ["SalusCallback"]


class SalusCallback(Callback):
    """Tells salusd the trainer's step, planned steps and training loss after each batch."""

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if os.environ.get(BOUNDARY_ENV) == "explicit":
            step()
        report(int(trainer.global_step), _planned(trainer), _loss(outputs, trainer))


def _planned(trainer: Trainer) -> int | None:
    if trainer.max_steps is not None and trainer.max_steps > 0:
        return int(trainer.max_steps)
    estimated = trainer.estimated_stepping_batches
    return int(estimated) if math.isfinite(estimated) else None


def _loss(outputs: Any, trainer: Trainer) -> float | None:
    """The batch's loss as `training_step` returned it, else the last one logged as `loss` or
    `train_loss`."""
    value = outputs.get("loss") if isinstance(outputs, dict) else outputs
    if value is None:
        metrics = trainer.callback_metrics
        value = metrics.get("loss", metrics.get("train_loss"))
    try:
        return float(value) if value is not None else None
    except (TypeError, ValueError):
        return None
