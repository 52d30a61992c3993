"""Multi-level data cache: local disk (fsspec) and a sharded in-memory key-value level."""
