"""Tiny media model families as the tests and the support sweep build them.

One builder module per family (or per table of families of one layout); each registers its
family's test builders in `registry`, keyed as `hf_prefix_cache.multimodal.registry` keys the family.
"""
