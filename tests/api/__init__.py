"""PrefixCache's public surface, the supported releases, real models and real shapes (hf_prefix_cache/api)."""
