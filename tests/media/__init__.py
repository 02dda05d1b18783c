"""Media models through the store: every family, its keys and fallbacks (hf_prefix_cache/multimodal)."""
