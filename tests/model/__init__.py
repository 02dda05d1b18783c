"""Layer adapters, recurrent snapshots and sliding windows (hf_prefix_cache/model)."""
