"""EncoderKeyedHook: what the encoder-decoder hooks share (`whisper.py`, `seq2seq.py`).

An encoder-decoder model's decoder attends to the encoder output at every position, so its
self-attention states are only valid for the same encoder input. The hooks therefore:

1. hash the encoder input (`media.hash_media`) and extend the model namespace by that hash
   (`encoder_namespace`): another input never shares decoder states, only the same one does;
2. reuse the encoder output stored for that hash (`encoder_decoder.EncoderOutputs`), passing
   it to `generate` as `encoder_outputs` so the encoder does not run;
3. where the decoder ids are known (inside `generate`), restore the matched decoder prefix
   into an `EncoderDecoderCache(working cache, empty cache)`: transformers reuses a filled
   cross-attention part whatever the encoder output (`is_updated`), so it always starts empty
   and the first step projects this request's encoder output into it.

A `DecoderRequest` carries what the outer call knows down to that inner call, through
`past_key_values`. Knows nothing about the tree, nor about how a family builds its decoder ids.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from hf_prefix_cache.integration.generate_hook import GenerateHook
from hf_prefix_cache.keys.namespace import fingerprint
from hf_prefix_cache.store.sessions import Session

if TYPE_CHECKING:
    from hf_prefix_cache.model.working_cache import WorkingCache
    from hf_prefix_cache.store.tree_store import Plan, PrefixCache

logger = logging.getLogger("hf_prefix_cache")


@dataclass(slots=True)
class DecoderRequest:
    """What an outer `generate` call hands the inner step that sees the decoder ids.

    `namespace` is already extended by the encoder-input hash. The inner step sets `served`,
    and `plan` / `working` when it restored a cache (the outer call releases and stores them), or
    `counted` when it served and stored the request itself (the outer call counts it).
    """

    store: PrefixCache
    namespace: str
    session: Session | None
    served: bool = field(default=False)
    plan: Plan | None = field(default=None)
    working: WorkingCache | None = field(default=None)
    counted: tuple[int, int] | None = field(default=None)  # (prompt_len, restore_len) to count when the call ends


def encoder_namespace(namespace: str, digest: int) -> str:
    """The tree namespace of decoder states computed over the encoder input hashed to `digest`."""
    return fingerprint([namespace, "encoder_input", f"{digest:032x}"])


class EncoderKeyedHook(GenerateHook):
    """A `GenerateHook` for encoder-decoder models: encoder outputs by input hash, decoder prefixes restored."""

    def _wrap_inner(self, name: str, serve: Callable[..., Any]) -> Callable[..., Any]:
        """Route the model's method `name` (the step where the decoder ids are known) through `serve`.

        Returns the original method; `detach` puts it back.
        """
        original: Callable[..., Any] = getattr(self._model, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            return serve(*args, **kwargs)

        setattr(self._model, name, wrapper)
        self._inner = (name, wrapper)
        return original

    def detach(self) -> None:
        super().detach()
        name, wrapper = self._inner
        if self._model.__dict__.get(name) is wrapper:
            delattr(self._model, name)

    def _keep_encoder_output(self, namespace: str, digest: int, hidden: torch.Tensor) -> None:
        """Store the encoder output of input `digest` (logged, not kept, when it alone exceeds the budget)."""
        if not self._store.encoder_outputs.put(namespace, digest, hidden):
            logger.debug("encoder output of %d bytes exceeds max_encoder_bytes; not stored", hidden.nbytes)

    def _restore_decoder(
        self, namespace: str, decoder_ids: torch.Tensor
    ) -> tuple[Plan, WorkingCache, EncoderDecoderCache] | None:
        """Acquire and restore the stored prefix of the one-row `decoder_ids`; None when out of memory.

        Returns the plan (release it when `generate` ends), the working self-attention cache
        (what to store afterwards) and the `EncoderDecoderCache` to hand `generate`.
        """
        rows = decoder_ids.tolist()
        restored = self._restore(namespace, rows, rows[0], ())
        if restored is None:
            return None
        plan, working = restored
        # An empty cross-attention cache: the first step projects this request's encoder output into it.
        return plan, working, EncoderDecoderCache(working, DynamicCache())
