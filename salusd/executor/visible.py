"""Which GPU an executor sees: only the one it is placed on, named by UUID.

The zygote and its executors start with `CUDA_VISIBLE_DEVICES` listing the daemon's GPUs by UUID
(`salusd/supervisor/supervisor.py`). CUDA reads that variable once, when it starts in a process
(pytorch/pytorch#23544; `torch.cuda.device_count` caches nothing before then for this reason),
so an executor placed before its CUDA started can narrow it to its own GPU, which it then
addresses as `cuda:0`: its caps, its allocator and every stray `.cuda()` in job code stay on that
GPU. Once CUDA has started the executor's GPUs are fixed: a job placed on another GPU needs a
new executor (`docs/runtime.md`, known limits).
"""

from __future__ import annotations

from collections.abc import MutableMapping

# Set in executors on a GPU host (`supervisor/processes.py`): the device kind their
# jobs will run on, which a first call's estimate fakes its tensors on (`measure.py`).
DEVICE_KIND_ENV = "SALUS_DEVICE_KIND"


class BoundToAnotherGpu(RuntimeError):
    """CUDA has started in this executor on GPUs that do not include the one it is placed on."""


def device_for(device: str, uuid: str | None, *, cuda_started: bool,
               environ: MutableMapping[str, str]) -> str:
    """The torch device an executor placed on the daemon's `device` ("cuda:2") with GPU `uuid`
    uses, after narrowing `environ` (the process's environment) to that GPU if CUDA has not
    started (`cuda_started`: `torch.cuda.is_initialized()`). A CPU device, or a place without a
    UUID, is used as named."""
    if uuid is None or not device.startswith("cuda"):
        return device
    if not cuda_started:
        environ["CUDA_VISIBLE_DEVICES"] = uuid
        return "cuda:0"
    seen = [v.strip() for v in environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if uuid in seen:
        return f"cuda:{seen.index(uuid)}"
    raise BoundToAnotherGpu(f"this executor's CUDA started on {', '.join(seen) or 'every GPU'}; "
                            f"a job placed on {uuid} needs a new executor")
