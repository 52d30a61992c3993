"""Units of `salusd.io/gpu-mem`: one GiB of a GPU's budget each, named `<GPU uuid>::<index>`.

The kubelet counts devices, so a GPU with a budget of 70.3 GiB is advertised as 70 devices,
`GPU-…::0` to `GPU-…::69`; a unit's ID says which GPU it is on. GiB and not MiB: the kubelet
limits a ListAndWatch reply to 4 MiB, and 8 GPUs of 141 GiB in MiB units would not fit.

Pure functions: no I/O, no gRPC (`plugin.py` serves them).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

RESOURCE = "salusd.io/gpu-mem"
UNIT_BYTES = 2**30
SEPARATOR = "::"
MAX_ID_CHARS = 63  # the kubelet refuses longer device IDs


@dataclass(frozen=True)
class GpuShare:
    """A GPU the plugin advertises: its UUID ("GPU-…"), its budget (bytes) and its device
    node's minor number (/dev/nvidia<minor>; None: unknown, no node is granted)."""

    uuid: str
    budget_bytes: int
    minor: int | None = None

    @property
    def units(self) -> int:
        """Whole GiB of the budget."""
        return self.budget_bytes // UNIT_BYTES


def unit_id(uuid: str, index: int) -> str:
    return f"{uuid}{SEPARATOR}{index}"


def parse_unit(device_id: str) -> tuple[str, int]:
    """(GPU uuid, unit index) of a unit ID; ValueError if it is not one."""
    uuid, sep, index = device_id.rpartition(SEPARATOR)
    if not sep or not uuid or not index.isdigit():
        raise ValueError(f"{device_id!r} is not a {RESOURCE} unit (<GPU uuid>::<index>)")
    return uuid, int(index)


def unit_ids(gpu: GpuShare) -> list[str]:
    """Every unit of `gpu`, in index order."""
    ids = [unit_id(gpu.uuid, i) for i in range(gpu.units)]
    if ids and len(ids[-1]) > MAX_ID_CHARS:
        raise ValueError(f"unit IDs of {gpu.uuid} are longer than the kubelet's "
                         f"{MAX_ID_CHARS} characters")
    return ids


def by_gpu(device_ids: Iterable[str]) -> dict[str, list[str]]:
    """Unit IDs grouped by GPU uuid, each group in unit index order (the groups in the order
    their GPUs first appear)."""
    groups: dict[str, list[tuple[int, str]]] = {}
    for device_id in device_ids:
        uuid, index = parse_unit(device_id)
        groups.setdefault(uuid, []).append((index, device_id))
    return {uuid: [d for _, d in sorted(units)] for uuid, units in groups.items()}


def preferred(available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
    """`size` units from `available` for one container, all on one GPU where possible.

    With nothing that must be included, the GPU with the most available units among those
    that have `size` of them (spreading containers over the GPUs; ties: the GPU listed first),
    its lowest-index units. Units that must be included are always in the answer; the rest
    comes from their GPU first. When no single GPU can hold the request, the answer spans GPUs
    (fullest first) and `Allocate` refuses it, saying why."""
    if size <= 0:
        return []
    chosen = list(dict.fromkeys(must_include))
    if len(chosen) >= size:
        return chosen[:size]
    taken = set(chosen)
    groups = {uuid: [d for d in ids if d not in taken]
              for uuid, ids in by_gpu([*chosen, *available]).items()}
    need = size - len(chosen)
    anchors = list(by_gpu(chosen))
    if anchors:
        order = _fullest_first(groups, among=anchors) + _fullest_first(groups, skip=anchors)
    else:
        ranked = _fullest_first(groups)
        fits = [u for u in ranked if len(groups[u]) >= need]
        order = fits[:1] or ranked
    for uuid in order:
        take = groups[uuid][:need]
        chosen += take
        need -= len(take)
        if need == 0:
            break
    return chosen


def _fullest_first(groups: dict[str, list[str]], *, among: Sequence[str] | None = None,
                   skip: Sequence[str] = ()) -> list[str]:
    ranked = [u for u in (groups if among is None else among) if u not in skip]
    return sorted(ranked, key=lambda u: -len(groups[u]))  # stable: ties keep listing order
