"""Namespaces and the weights probe (hf_prefix_cache/keys)."""
