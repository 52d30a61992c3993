"""The daemon's side of the executor processes: `supervisor` (the engine's `ExecutorPort`: which
process hosts which job, placement into an owner's lane process, replies and deaths) and
`zygotes` (the processes that fork executors, one per interpreter)."""
