"""Tiers, the disk and remote stores, host buffers and budgets (hf_prefix_cache/storage)."""
