"""The radix tree of stored symbol sequences and the eviction policies: pure Python, no torch."""
