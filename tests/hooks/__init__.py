"""The hooks through generate: cached equals cold for every family and front door (hf_prefix_cache/hooks)."""
