"""What the executor protocol's codec costs per message, next to the JSON the wire pays anyway.

For each message the daemon and an executor exchange on every iteration (`Run`, `CallDone`,
`Ready`, `Ran`, `Lease`, `Ack`) and for the largest ones (`Place` on a GPU, `StepDone` with
counters), times `encode` and `decode_*` (`salusd/wire/executor_ops/codec.py`: the generic,
type-checked codec) and, as the baseline measured in the same run, `json.dumps` + `json.loads`
of the same wire dict (what the link costs for that message whatever the codec). Prints one
JSON object: microseconds per message, and `codec_over_json`, the codec's time over the
JSON's (the messages' median).

    .venv/bin/python bench/executor_codec.py [--repeat 20000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from salus.daemon.wire.executor_ops import (
    REQUESTS,
    Ack,
    CallDone,
    Estimated,
    Lease,
    Message,
    Place,
    Ran,
    Ready,
    Run,
    StepDone,
    decode_reply,
    decode_request,
    encode,
)

MiB = 2**20
MESSAGES: dict[str, Message] = {
    "run": Run(True, True),
    "call_done": CallDone(True, 0.0042, 12 * MiB, True, 10.0, 10.0042, forward=True),
    "ready": Ready(True, Estimated(48 * MiB, "fake-tensor", reserved_bytes=64 * MiB)),
    "ran": Ran(12, 12, 0, 0.05, 30 * MiB, 10.0, 10.05),
    "lease": Lease(True),
    "ack": Ack(),
    "place": Place("cuda:0", 3 << 30, 1.0, "GPU-5e7a", 3, 1 << 30, True, workspace_bytes=8 * MiB,
                   total_bytes=141 << 30),
    "step_done": StepDone(True, 0.02, 80 * MiB, True, 10.0, 10.02, 400, 0.31, None, None,
                          None, {"hits": 12, "misses": 1, "bytes": 4 * MiB},
                          {"bytes_sent": 1 << 20, "calls": 4, "last_algorithm": "ring"}),
}


def per_call_us(fn: Callable[[], Any], repeat: int) -> float:
    """The best of five timings of `repeat` calls, in microseconds per call."""
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeat):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / repeat * 1e6


def measure(msg: Message, repeat: int) -> dict[str, float]:
    wire = encode(msg)
    decode = decode_request if type(msg) in REQUESTS else decode_reply
    assert decode(json.loads(json.dumps(wire))) == msg
    codec = (per_call_us(lambda: encode(msg), repeat)
             + per_call_us(lambda: decode(wire), repeat))
    text = json.dumps(wire)
    baseline = (per_call_us(lambda: json.dumps(wire), repeat)
                + per_call_us(lambda: json.loads(text), repeat))
    return {"codec_us": round(codec, 2), "json_us": round(baseline, 2),
            "codec_over_json": round(codec / baseline, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=20000)
    args = parser.parse_args()
    results = {name: measure(msg, args.repeat) for name, msg in MESSAGES.items()}
    print(json.dumps({
        "messages": results,
        "codec_over_json": statistics.median(r["codec_over_json"] for r in results.values()),
        "codec_us_median": statistics.median(r["codec_us"] for r in results.values()),
    }))


if __name__ == "__main__":
    main()
