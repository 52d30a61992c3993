"""`salus.demo`, what `make demo` runs (`python -m salus.demo [policy]`): three training jobs and
one inference job through a daemon on the CPU against the same jobs run directly; `jobs` holds
the workloads and the client processes that run them."""
