"""The only code that patches transformers' `generate`: one hook per model family, found through `patching.family_of`.

Importing this package imports every hook module, and each registers its family.
"""

from __future__ import annotations

from hf_prefix_cache.hooks import decoder_only, seq2seq, whisper  # noqa: F401  (each registers its family)
from hf_prefix_cache.hooks.patching import Family, Hook, attach, family_of

__all__ = ["Family", "Hook", "attach", "family_of"]
