"""The per-device budget allocator (BFC-style bins over byte offsets)."""
