"""A row the batch cannot take, run alone through `model.generate` with the store, counted under its reason.

The row's model inputs beside its ids (`Request.inputs`: its media) go to `generate` as they are. Its
settings become `generate`'s (greedy or sampling with its temperature, top_k, top_p and seed; its logit
bias as `sequence_bias`; its repetition penalty; its end ids, `min_new_tokens` and whatever else it
asked in `Request.generate_kwargs`), its tokens stream through a streamer as `generate` chooses them,
and a stopping criterion ends it at a stop sequence or stop string, on cancellation or past its
deadline. The store counts the reason (``batch_alone:<why>``) beside its own numbers
(`stats().fallbacks`).

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefix_cache import PrefixCache
    >>> from hf_prefix_cache.batching.rows import Request, Row
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    >>> store = PrefixCache(model)
    >>> row = Row(Request(list(range(4, 20)), max_new_tokens=3, generate_kwargs={"no_repeat_ngram_size": 2}))
    >>> run_alone(store, row, "batch_alone:setting_no_repeat_ngram_size")
    >>> len(row.tokens), store.stats().fallbacks["batch_alone:setting_no_repeat_ngram_size"]
    (3, 1)
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.generation.streamers import BaseStreamer

from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching.rows import EndReason, Row
from hf_prefix_cache.store.contract import ReducedReuse

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache


def run_alone(prefix_cache: PrefixCache, row: Row, reason: str) -> None:
    """Run `row` alone through `generate` with the store (its prefix reused, its sequence stored), counting `reason`."""
    store = store_of(prefix_cache)
    row.alone_reason = reason
    store.record(ReducedReuse(reason))
    request = row.request
    ids = torch.tensor([list(request.ids)], device=store.model.device)
    if row.scope is None:
        row.scope = prefix_cache.request(request.salt)
    try:
        with row.scope, torch.no_grad():
            output = store.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                cache=prefix_cache,
                streamer=_RowStreamer(row),
                stopping_criteria=StoppingCriteriaList([_RowStops(row)]),
                return_dict_in_generate=True,
                output_logits=request.keep_logits,
                **_inputs(request.inputs, ids.device),
                **_generate_settings(row),
            )
    except Exception as exc:
        row.finish(EndReason.ERROR, exc)
        return
    if request.keep_logits:
        row.logits = [step[0].detach().float().cpu() for step in output.logits]
    ended = row.ended_by()
    if ended is None:
        ended = EndReason.CANCELLED if row.cancelled else EndReason.TIMEOUT
    row.finish(ended)


def _inputs(inputs: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    """The row's model inputs beside its ids (its media), on the model's device."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


def _generate_settings(row: Row) -> dict[str, Any]:
    """The row's settings as `generate` takes them."""
    request, sampling = row.request, row.request.sampling
    settings: dict[str, Any] = {"max_new_tokens": request.max_new_tokens}
    if sampling.is_greedy:
        settings["do_sample"] = False
    else:
        settings.update(do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or 0)
        settings["top_p"] = sampling.top_p if sampling.top_p is not None else 1.0
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # generate samples from torch's global generator
    if sampling.logit_bias:
        settings["sequence_bias"] = {(token,): bias for token, bias in sampling.logit_bias.items()}
    if sampling.repetition_penalty != 1.0:
        settings["repetition_penalty"] = sampling.repetition_penalty
    if request.end_ids:
        settings["eos_token_id"] = sorted(request.end_ids)
    if sampling.min_new_tokens:
        settings["min_new_tokens"] = sampling.min_new_tokens
    settings.update(request.generate_kwargs)
    return settings


class _RowStreamer(BaseStreamer):
    """Hands each token `generate` chooses to the row (the first `put` is the prompt)."""

    def __init__(self, row: Row) -> None:
        self._row = row
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        for token in value.reshape(-1).tolist():
            self._row.emit(int(token))

    def end(self) -> None:
        pass


class _RowStops(StoppingCriteria):
    """Stops at one of the row's stop sequences or stop strings, on cancellation, or past its deadline.

    It reads the answer from `input_ids`, not from the row: `generate` streams a step's token only after
    its stopping criteria ran (`StopCheck`), so the row's tokens lack the newest one here.
    """

    def __init__(self, row: Row) -> None:
        self._row = row
        self._start: int | None = None  # where the answer begins in `input_ids` (one before the first call's end)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        row = self._row
        if self._start is None:
            self._start = input_ids.shape[1] - 1
        answer = input_ids[0, self._start :].tolist()
        stop = row.cancelled or row.expired(time.monotonic()) or row.ended_by(answer) is EndReason.STOP
        return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]
