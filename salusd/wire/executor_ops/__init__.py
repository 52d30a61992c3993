"""The daemon↔executor protocol: one frozen type per message, and the JSON dict each one is.

The daemon and a job's executor (`salusd/executor/main.py`) share one socket pair. Every message
is a JSON meta frame, the dict `encode` gives; a request whose op carries the client's own frame
(`attach`, `define`, `pull`, `channel`, a first call's `estimate`, a `run` through the daemon) is
followed by it, in the same `sendmsg` (`client_frame_follows`). The daemon never looks inside that
frame: the executor unpickles it.

Daemon → executor, in the order a job meets them:

- `Become` (from the supervisor, first): who the executor becomes. As root it drops to the
  owner's uid, gid and groups before it receives any job bytes, then changes into `cwd`, sets
  the job's intra-op thread count, and sends what the job prints to the file `log` (when given)
  and its client's direct channel (`salusd/executor/output.py`).
- `Attach` (unpickle the named objects, report their exact bytes), `Define` (a function),
  `Estimate` (fake-tensor peak of the first call), `DirectChannel` (the client's end of its
  direct channel), `Load` (a batch job's entrypoint) or `Restore` (a job's checkpoint after a
  restart).
- `Place` (device and budget, after each admission), `Lease` (granted or taken back), `Run` (one
  call), `Step` (a batch job's iteration), `Pull`, `Checkpoint`, `SwapOut`, `Refuse` (fail the
  direct calls waiting in the executor), `Exit` (from the supervisor: answer nothing more),
  `Signal` (from the supervisor, to the executor `salusd run --here` runs itself, which salusd
  cannot `kill`: raise a signal in its script).

Every request but `Become`, `Exit` and `Signal` gets exactly one reply, in order (the daemon
matches it with the oldest unanswered request): `Ack` or `Failed` for most, `CallDone` for `Run`,
`StepDone` for `Step`, `Estimated` or `EstimateFailed`, `Attached`, `Loaded` (for `Load` and
`Restore`), `Checkpointed`, `Placed` or `Swapped` for some `Place`s, `HandedOver`. A reply with
`forward` true is followed by the frame the daemon hands to the client as its answer
(`frames_after`). The executor also speaks unasked (`UNSOLICITED`), between replies:

- `Ready`: a call came on the job's direct channel while it holds no lease; the daemon queues it
  for the job and answers `Run` (without a frame) when the policy picks the job in its lane. The
  first `Ready` carries the call's estimate where the daemon estimates first calls.
- `Ran`: calls that ran at once under the job's lease, reported in batches (at most every 20 ms,
  and before the executor reads any message from the daemon, so every decision sees them):
  calls, iterations, seconds, the largest peak. The daemon takes the lease back (`Lease` false,
  answered once any running call has returned) as soon as the job must share its lane or stop.
- `Exited` (a script job's command ended, with its exit status) and `Progress` (what a
  script's framework callback reports: its step, planned steps and loss), `Poisoned` (a call hit
  a sticky CUDA error: the executor ends right after it); `Swapped` answers a
  script job's `swap_out` (and the `place` after it) with what the move reached and left.

A script job (`Script`, `salusd/executor/script.py`) speaks the same `Ready` / `Run` /
`Lease` / `Ran` protocol, with its iteration boundaries (optimizer steps, `salus.step()`) in
place of direct calls.

Whether a call is one of the job's iterations is decided by the executor (`is_iteration` in
`salusd/executor/runtime.py`), which says so in each `CallDone`, `StepDone`, `Ready` and `Ran`;
`Run.counted` is the daemon's own reading, used only until the reply comes.

Every message, reply or request, is its `op` and its fields (`codec.py`: one codec read off
the types, a field holding its default left out); `decode_request` and `decode_reply` check
every field's type (bools are not ints, ints are taken for floats), refuse unknown fields and
fields sent holding their default, and raise ValueError naming the message and the field, so
`encode(decode_…(d)) == d` for every dict that decodes. Sizes are bytes, durations seconds,
`began`/`ended` the executor's `time.monotonic()`.
"""

from salus.daemon.wire.executor_ops import codec, envelope, messages, replies, requests
from salus.daemon.wire.executor_ops.codec import *  # noqa: F403
from salus.daemon.wire.executor_ops.envelope import *  # noqa: F403
from salus.daemon.wire.executor_ops.messages import *  # noqa: F403
from salus.daemon.wire.executor_ops.replies import *  # noqa: F403
from salus.daemon.wire.executor_ops.requests import *  # noqa: F403

# A new message is a type in `requests.py` or `replies.py` (and its `__all__`): nothing here.
__all__: list[str] = []
__all__ += codec.__all__
__all__ += envelope.__all__
__all__ += messages.__all__
__all__ += replies.__all__
__all__ += requests.__all__
