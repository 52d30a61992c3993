"""PyTorch adapter: run a script's own iterations, over its own state, inside salusd.

    import salus.adapters.torch as salus

    with salus.connect(name="mnist", iterations=epochs * len(loader)) as job:
        remote = job.attach(model=model, opt=opt, sched=sched)   # shipped once, as they are now

        @remote.iteration                  # one scheduled iteration per call, run in the daemon
        def train(s, data, target):        # s.model, s.opt, s.sched: the daemon-side objects
            s.model.train()
            s.opt.zero_grad()
            loss = F.nll_loss(s.model(data), target)
            loss.backward()
            s.opt.step()
            return loss                    # any pytree; tensors come back on the CPU

        for epoch in range(epochs):
            for data, target in loader:
                loss = train(data, target)
            remote.call(lambda s: s.sched.step())
        remote.pull()                      # daemon state -> model, opt, sched (load_state_dict)
                                           # and the modules' train/eval modes

Sugar over the same contract: `job.train_step(model, optimizer, loss_fn)` returns
`step(*inputs, target) -> float` (and `step.submit(*inputs, target) -> Loss`, a loss to read
later), and `job.inference(model)` returns `infer(*inputs) -> output`.

- **The job's copies**: after `attach` the job holds its own copies of the objects; change
  them in the job, not here. `attach` refuses a module with modules or parameters in a plain
  list or dict (use `nn.ModuleList`); an attached scheduler stepped here or an optimizer
  given another learning rate here makes the next call or pull raise with what to do, and a
  module changed here (run in train mode) the next pull; `close()` warns when calls changed
  the state since the last pull (`close(pull=True)` pulls first, `close(pull=False)`
  discards).
- **Errors** of the job's own code fail that call only: the client gets the exception (its
  type and message, with the job's traceback lines as a note) and the job keeps its state.
- **Random numbers**: the job continues the client's torch generator and hands it back, so
  what the daemon-side code draws and what the client draws form one stream, in the order of a
  direct run. With `submit()` the client may draw while a call runs; seed a separate generator
  for such draws (a `DataLoader(generator=g)`) if the run must be reproducible.
- **Pickling**: classes and functions of the script, of `__mp_main__` and of modules that are
  not installed packages (the script's folder) travel by value; an object that cannot be
  pickled is named in the error.
- **Pipelining**: `train.submit(...)` returns a `Future` at once, so the client can prepare the
  next batch while the daemon computes; replies come back in the order calls were made. At
  most 32 calls are in flight on a job (`transport.MAX_IN_FLIGHT`): a further `submit` first
  waits for the oldest reply. Steps submitted this way cost much less CPU each where many jobs
  share few cores (the executor runs them back to back and the client wakes once for
  several results), so a loop that does not need each loss at once should submit its steps.

**Data-parallel jobs**: `salus.connect(name, iterations, devices=N)` opens a gang of N
replicas, one per device, admitted all or nothing. Every call runs on all replicas, as one
scheduled iteration on all their lanes; each tensor argument is split along dim 0 into N
nearly equal parts and replica r gets part r (`salus.per_replica(b0, b1, ...)` passes one value
per replica, `salus.whole(x)` one value to all). Inside, `s.comm` is the gang's communication
service (`s.comm.all_reduce_gradients(s.model)`, `s.comm.sharded_step(s.opt)`, ...). The
objects are attached once and every replica starts from them; the call returns replica 0's
result, and `s.comm.gather_batch(out)` gathers a whole batch's outputs there. Every replica
starts each call from the client's random state, so they draw the same numbers (as DDP ranks
seeded alike do), and the client goes on from replica 0's. A call that raises on every replica
fails that call; one that raises on some replicas only fails the job (their states may differ
now, or the others wait for it in a collective). Calls go through salusd (no direct channel).
`train_step` averages the gradients over the gang and returns the whole batch's mean loss;
`inference` returns the whole batch's outputs.

**Unchanged scripts** run under `salusd run python train.py`: there `step()` marks an iteration
boundary beside the optimizer steps and `resume_dir()` is the job's directory that survives
restarts (`script.py`); in a direct run `step()` does nothing.

The daemon is found at `address=` (`unix:///path`), else `$SALUS_ADDRESS`, else the default
socket. Imports only torch, cloudpickle and the wire package of salusd.

The package: `job` (`connect`, `Job`), `remote` (`Remote`, `RemoteFunction`, gang arguments),
`sugar` (`train_step`, `inference`), `transport` (requests, replies in order, reconnecting),
`replies` (results and errors), `pickling` (what travels by value), `contract` (the checks
that refuse what `pull` could not bring back, and changes made on the client).
"""

from salus.adapters.torch.job import Job, connect
from salus.adapters.torch.remote import Remote, RemoteFunction, per_replica, whole
from salus.adapters.torch.script import resume_dir, step
from salus.adapters.torch.sugar import Loss, TrainStep
from salus.adapters.torch.transport import RECONNECT_TRIES, Future
from salus.daemon.wire.channel import FrameError
from salus.daemon.wire.errors import (
    CallFailed,
    DaemonUnavailable,
    JobCancelled,
    JobFailed,
    SalusError,
)
from salus.daemon.wire.replicas import MAX_REPLICAS, PerReplica, Whole

__all__ = ["MAX_REPLICAS", "RECONNECT_TRIES", "CallFailed", "DaemonUnavailable", "FrameError",
           "Future", "Job", "JobCancelled", "JobFailed", "Loss", "PerReplica", "Remote",
           "RemoteFunction", "SalusError", "TrainStep", "Whole", "connect", "per_replica",
           "resume_dir", "step", "whole"]
