"""Data-parallel batch jobs for the gang tests: one entrypoint per way of averaging gradients.

Every replica runs the same entrypoint; the daemon gives each one its half of every batch and
``s.comm`` over the gang. The model has 34,817 parameters, below the 2**16 elements under which
``sparse_all_reduce`` sends dense; inside one node it is exact at any size anyway (Hi-TopK
prunes only between nodes), so the sparse gang must match the dense reference here.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

BATCH, SAMPLES, IN, HIDDEN = 16, 96, 32, 1024


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def _data(seed: int = 1, samples: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, IN, generator=g)
    y = (x[:, :4].sum(1, keepdim=True)).tanh() + 0.1 * torch.randn(samples, 1, generator=g)
    return TensorDataset(x, y)


def held_out_loss(model: nn.Module) -> float:
    x, y = _data(seed=2, samples=256).tensors
    with torch.no_grad():
        return float(nn.functional.mse_loss(model(x), y))


def _job(reduce):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)

    def iteration(s, batch):
        x, y = batch
        s.opt.zero_grad()
        loss = nn.functional.mse_loss(s.model(x), y)
        loss.backward()
        reduce(s)
        return loss

    def evaluate(s):  # optimizer bytes this replica holds
        if reduce is _sharded:
            return float(s.comm.optimizer_state_bytes())
        return float(sum(t.numel() * t.element_size() for st in s.opt.state.values()
                         for t in st.values() if isinstance(t, torch.Tensor)))

    data = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    return {"state": {"model": model, "opt": opt}, "iteration": iteration, "data": data,
            "evaluate": evaluate, "every": 1}


def _ring(s):
    s.comm.all_reduce_gradients(s.model, algorithm="ring")
    s.opt.step()


def _tree(s):
    s.comm.all_reduce_gradients(s.model, algorithm="tree")
    s.opt.step()


def _sparse(s):
    s.comm.all_reduce_gradients(s.model, density=0.01)
    s.opt.step()


def _sharded(s):
    s.comm.all_reduce_gradients(s.model, algorithm="ring")
    s.comm.sharded_step(s.opt)


def make_ring():
    return _job(_ring)


def make_tree():
    return _job(_tree)


def make_sparse():
    return _job(_sparse)


def make_sharded():
    return _job(_sharded)


def run_directly(iterations: int) -> nn.Module:
    """One process, whole batches, plain ``opt.step()``: the reference for every gang."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.002, momentum=0.9)
    loader = DataLoader(_data(), batch_size=BATCH, shuffle=True)
    done, it = 0, None
    while done < iterations:
        if it is None:
            it = iter(loader)
        try:
            x, y = next(it)
        except StopIteration:
            it = None
            continue
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        done += 1
    return model


def make_failing():
    """Replica 1 raises in its third iteration (replica 0 waits in the collective meanwhile)."""
    job = _job(_ring)
    calls = [0]

    def iteration(s, batch):
        calls[0] += 1
        if s.comm.rank == 1 and calls[0] == 3:
            raise RuntimeError("replica 1 broke on purpose")
        return job["iteration"](s, batch)

    return {**job, "iteration": iteration}
