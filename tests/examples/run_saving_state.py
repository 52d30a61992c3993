"""Run an example script unchanged and keep its state: `python run_saving_state.py OUT SCRIPT
ARGS...` runs SCRIPT as `__main__` with ARGS, then saves to OUT the `state_dict()` of every
module and optimizer the script left in its globals, for scripts that save none themselves."""

import os
import runpy
import sys

import torch

out, script = sys.argv[1], sys.argv[2]
sys.argv = sys.argv[2:]
sys.path[0] = os.path.dirname(os.path.abspath(script))  # as `python SCRIPT` would
found = runpy.run_path(script, run_name="__main__")
torch.save({name: value.state_dict() for name, value in found.items()
            if isinstance(value, torch.nn.Module | torch.optim.Optimizer)}, out)
