"""What the daemon keeps across restarts: the job registry and API tokens (`store.py`)."""
