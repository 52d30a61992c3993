"""The node's devices and the facts about them that salusd needs: `discovery` (which devices,
their memory budgets, GPU UUIDs and CUDA_VISIBLE_DEVICES), `context_cost` (what a CUDA context
and cuBLAS workspace take on a GPU) and `mps` (NVIDIA MPS control daemons)."""
