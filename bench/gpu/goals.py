"""What each figure of the GPU kit is held to: `judge` turns a step's figures into
{"value", "unit", "goal", "met"} and `verdict` counts them.

A figure is a number, a bool, or a list of numbers in a step's result (names, units, anchors
and messages are not figures). One with a goal below is judged (`met` true or false); any other
is recorded with goal "recorded: no goal" and `met` null. A goal that only a GPU can meet (the
device's memory, the GPU's switch latency) is recorded on a CPU run with `met` null and why.
A goal's figure that came back null (not measured) is missed, saying so. Units follow from the
figure's name (`unit_of`).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from typing import Any

Check = Callable[[Any], bool]
# (step, figure path pattern, goal, check, on a GPU only)
GOALS: list[tuple[str, str, str, Check, bool]] = [
    ("cuda_tests", "tests_failed", "0: every cuda test passes", lambda v: v == 0, False),
    ("cuda_tests", "tests_passed", "> 0 on a GPU (all skip without one)", lambda v: v > 0, True),
    ("switch_latency", "warm_switch_p99_ms", "<= 1.0 ms (PipeSwitch 3.6-6.6 ms)",
     lambda v: v <= 1.0, True),
    ("switch_latency", "large.warm_switch_p99_ms",
     "<= 1.0 ms with GB-scale working sets (the cache is kept)", lambda v: v <= 1.0, True),
    ("priority_latency", "*.p99_increase_pct", "<= +7 % (Tally +7.2 %)", lambda v: v <= 7.0,
     True),
    ("inference_memory", "processes_over_daemon_device",
     ">= 6x less device memory than 16 processes", lambda v: v >= 6.0, True),
    ("inference_memory", "processes_over_daemon_pss", ">= 6x less host memory (PSS)",
     lambda v: v >= 6.0, False),
    ("faults", "*.a_kept_training", "true: the other job keeps training", lambda v: v is True,
     False),
    ("faults", "*.over_lane_*.b_failed", "true: the cap holds, the call over its lane fails "
     "alone (a GPU enforces lanes; the CPU accounts them)", lambda v: v is True, True),
    ("faults", "*.b_failed", "true: the faulting call fails, alone", lambda v: v is True, False),
    ("gang", "*.equal_within_1e-5", "true: the gang equals one process",
     lambda v: v is True, False),
    ("script_job", "ran", "true: the script ran to its end under salusd run",
     lambda v: v is True, False),
    ("script_job", "one_gpu_visible", "true: the script sees only its placed GPU",
     lambda v: v is True, True),
    ("script_job", "capped", "true: the script's process is capped", lambda v: v is True, True),
    ("script_job", "peak_reported", "true: its iterations' device peak reached the daemon",
     lambda v: v is True, False),
    ("script_job", "daemon_measured_peak_bytes", "> 0: the daemon measured the job's peak",
     lambda v: v > 0, False),
    ("script_job", "here.ran", "true: the script ran to its end under salusd run --here",
     lambda v: v is True, False),
    ("script_job", "here.one_gpu_visible", "true: run --here, the script sees only its placed "
     "GPU", lambda v: v is True, True),
    ("script_job", "here.capped", "true: run --here, the script's process is capped",
     lambda v: v is True, True),
    ("script_job", "here.peak_reported", "true: run --here, its device peak reached the daemon",
     lambda v: v is True, False),
    ("switch_latency", "two_owners.both_trained", "true: both owners' jobs trained in the lane",
     lambda v: v is True, False),
    ("switch_latency", "two_owners.executor_uids_differ",
     "true: each owner's job ran in an executor with its owner's uid", lambda v: v is True,
     False),
    ("switch_latency", "two_owners.warm_switch_p99_ms",
     "<= 1.0 ms between two owners' executors (PipeSwitch 3.6-6.6 ms)", lambda v: v <= 1.0,
     True),
    ("gang", "nccl_join_one_replica.joined",
     "true: a placed replica joins its process group", lambda v: v is True, False),
    ("gang", "nccl_join_one_replica.all_reduce_ok", "true: an all_reduce over the group is "
     "exact", lambda v: v is True, False),
    ("mps_facts", "pinned_limit.client_cannot_raise_limit", "true: a client cannot raise the "
     "MPS pinned limit the control daemon set from its own environment (server-side "
     "enforcement holds)", lambda v: v is True, True),
    ("mstopk", "recall", ">= 0.99 of torch.topk's values", lambda v: v >= 0.99, False),
    ("mstopk", "index_agreement", ">= 0.99 of torch.topk's indices", lambda v: v >= 0.99,
     False),
    ("mstopk", "kernel_is_gpu", "true: the GPU kernel ran (cupy)", lambda v: v is True, True),
]


def _is_figure(value: Any) -> bool:
    if isinstance(value, bool | int | float):
        return True
    return (isinstance(value, list) and bool(value)
            and all(isinstance(v, int | float) and not isinstance(v, bool) for v in value))


# A figure's unit from its name's ending (the last key of its path), first match wins.
UNITS: list[tuple[str, str]] = [
    ("*_ms*", "ms"), ("*_bytes*", "bytes"), ("*_pct", "%"), ("*_per_s*", "1/s"),
    ("*_s", "s"), ("seconds", "s"), ("*_over_*", "ratio"), ("recall", "fraction"),
    ("*agreement", "fraction"), ("*fraction", "fraction"), ("*_diff", "absolute difference"),
]


def unit_of(path: str, value: Any) -> str:
    """The unit of the figure at `path` (dotted keys) holding `value`."""
    key = path.rsplit(".", 1)[-1]
    if isinstance(value, bool):
        return "bool"
    for pattern, unit in UNITS:
        if fnmatch.fnmatchcase(key, pattern):
            return unit
    return "count" if isinstance(value, int) or (
        isinstance(value, list) and all(isinstance(v, int) for v in value)) else "number"


def _goal(step: str, path: str) -> tuple[str, Check, bool] | None:
    for name, pattern, goal, check, gpu in GOALS:
        if name == step and fnmatch.fnmatchcase(path, pattern):
            return goal, check, gpu
    return None


def judge(step: str, result: dict[str, Any], cuda: bool) -> dict[str, Any]:
    """`result` with each figure as {"value", "unit", "goal", "met"} (`cuda`: a GPU run)."""

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, dict):
            return {k: walk(v, f"{path}.{k}" if path else k) for k, v in obj.items()}
        found = _goal(step, path)
        if obj is None and found is not None:  # a goal's figure that was not measured
            missed = not found[2] or cuda
            return {"value": None, "unit": unit_of(path, obj), "goal": found[0],
                    "met": False if missed else None, "why": "not measured"}
        if not _is_figure(obj):
            return obj
        unit = unit_of(path, obj)
        if found is None:
            return {"value": obj, "unit": unit, "goal": "recorded: no goal", "met": None}
        goal, check, gpu_only = found
        if gpu_only and not cuda:
            return {"value": obj, "unit": unit, "goal": goal, "met": None,
                    "why": "a CPU run: judged on a GPU"}
        try:
            met = bool(check(obj))
        except TypeError:  # a figure that could not be measured (None)
            met = False
        return {"value": obj, "unit": unit, "goal": goal, "met": met}

    return walk(result, "") if isinstance(result, dict) else result


def verdict(steps: dict[str, Any]) -> dict[str, Any]:
    """Per step: ok, error or skipped; how many figures met, missed or were not judged; and
    how many of its cases failed (`case_errors`: an "error" inside a step that ran) or were
    skipped (`cases_skipped`), with their paths."""
    out: dict[str, Any] = {}
    for name, result in steps.items():
        counts: dict[str, Any] = {"met": 0, "missed": 0, "not_judged": 0, "case_errors": [],
                                  "cases_skipped": []}

        def count(obj: Any, path: str, counts: dict[str, Any] = counts) -> None:
            if isinstance(obj, dict) and {"value", "goal", "met"} <= obj.keys():
                key = {True: "met", False: "missed", None: "not_judged"}[obj["met"]]
                counts[key] += 1
            elif isinstance(obj, dict):
                for k, v in obj.items():
                    if path and k in ("error", "skipped") and isinstance(v, str):
                        counts["case_errors" if k == "error" else "cases_skipped"].append(path)
                    count(v, f"{path}.{k}" if path else k)

        count(result, "")
        status = next((k for k in ("error", "skipped") if k in result), "ok")
        out[name] = {"status": status, **counts}
    return out
