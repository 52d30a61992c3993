"""The daemon's engine: the job registry, placement ledger, event stream and the engine that
turns the iteration scheduler's decisions into work for executors. Never imports torch."""
