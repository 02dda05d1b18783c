"""The TreeStore: memory, eviction policy, its contract with the hooks, what it reports (hf_prefix_cache/store)."""
