"""`salus.demo`, what `make demo` runs (`python -m salus.demo`): an unchanged training script
(`train.py`) under `salusd run` against plain processes, per policy, with memory, an inference
job's latency and a plot of the lanes; `workloads` holds the models, `jobs` the client
processes the benchmarks start."""
