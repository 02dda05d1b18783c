"""The radix tree and its eviction order, with plain-Python values (hf_prefix_cache/tree)."""
