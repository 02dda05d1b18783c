"""Tiny random-weight media models with real processors, for trying media in the front ends.

They are built in `hf_prefix_cache.testing.chat_models`, with the other model builders the tests,
benchmarks and front ends share; this module names them where the front ends (and the README)
look for them.

>>> from hf_prefix_cache.frontends.tiny_vlm import load_tiny_vlm
>>> model, processor = load_tiny_vlm()                                  # doctest: +SKIP
"""

from __future__ import annotations

from hf_prefix_cache.testing.chat_models import chat_template, load_tiny_audio_lm, load_tiny_vlm

__all__ = ["chat_template", "load_tiny_audio_lm", "load_tiny_vlm"]
