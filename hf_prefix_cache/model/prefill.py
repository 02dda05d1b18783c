"""Prefill of recurrent models: the uncached prompt fed in chunks that end where snapshots are wanted.

A recurrent state restores only at lengths where one was snapshotted, so the hook feeds
`[cached_len, n - 1)` itself, in chunks that end at the divergence from the stored prefix, at
every `snapshot_interval` tokens and at `n - 1`, snapshotting at each end; `generate` then
feeds the last token. Models whose own multi-token scan ignores a cached state continue it
through `scan.ScanContinuation`; only when that cannot be installed are tokens fed one per
forward once a state exists (`one_token_steps`).

Prompts with media are fed input embeddings rather than ids: those the model's forward would
compute for the uncached suffix (its media adapter's `suffix_embeds`), sliced per chunk, so a
chunk may end anywhere, inside an image too. No interval snapshot is taken inside a media span,
where no restore may cut.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.model.states import Snapshot
from hf_prefix_cache.model.working_cache import WorkingCache


@dataclass(frozen=True, slots=True)
class Prefill:
    """How a recurrent model's prompts are prefilled: the model, its profile, the snapshot interval, and whether
    tokens go one per forward once a state exists (`one_token_steps`: a scan that cannot be continued)."""

    model: Any
    profile: ModelProfile
    snapshot_interval: int | None
    one_token_steps: bool

    def bounds(
        self, start: int, target: int, matched_len: int, spans: Sequence[tuple[int, int]] = (), keep_end: bool = True
    ) -> list[int]:
        """Where a prefill of positions `[start, target)` stops to snapshot, in order: the divergence from the stored
        prefix (`matched_len`), every `snapshot_interval` tokens (recurrent states only), and `target` itself with
        `keep_end` (always when tokens go one per forward); never inside a media span of `spans`.

        Example (a recurrent model's would add 256 and 512):
            >>> from hf_prefix_cache.api.prefix_cache import store_of
            >>> Prefill(model, store_of(store).profile, 256, False).bounds(100, 700, 300)  # attention only
            [300, 700]
        """
        keep_end = keep_end or self.one_token_steps
        bounds = {target}
        if start < matched_len < target:
            bounds.add(matched_len)
        interval = self.snapshot_interval
        if interval is not None and self.profile.has_recurrence:  # a window snapshot is not worth its bytes
            bounds.update(range((start // interval + 1) * interval, target, interval))
        # A restore never cuts inside a media span: a snapshot there would never be used.
        ordered = sorted(b for b in bounds if b == target or not any(a < b < e for a, e in spans))
        if not keep_end:
            ordered.remove(target)
        if self.one_token_steps and start == 0:
            # From an empty state a multi-token scan is exact; skip interval snapshots it would pass.
            first = min(b for b in ordered if b in (target, matched_len))
            ordered = [b for b in ordered if b >= first]
        return ordered

    def states(
        self,
        cache: WorkingCache,
        input_ids: torch.Tensor,
        cached_len: int,
        matched_len: int,
        embeds: torch.Tensor | None = None,
        spans: Sequence[tuple[int, int]] = (),
        prompt_end: bool = True,
        positions: torch.Tensor | None = None,
    ) -> tuple[int, list[Snapshot]]:
        """Feed prompt tokens `[cached_len, n - 1)` in chunks (`cache` holds `cached_len`, the store `matched_len`);
        return how far it fed and the snapshots taken.

        `embeds` (``[1, n - cached_len, d]``), when given, are the input embeddings of positions
        `[cached_len, n)`, fed instead of the ids; `spans` are the prompt's media spans. Without
        `prompt_end`, no chunk ends at `n - 1` for a snapshot there: feeding stops at the last other
        bound and `generate` feeds the rest in its own forward (unless embeddings are fed, or the
        model must take one token per forward: then `n - 1` is still a bound). `positions`
        (``[..., n]``), when given, are the whole prompt's `position_ids` (M-RoPE), sliced per chunk.
        """
        start, target = cached_len, input_ids.shape[1] - 1
        if target <= start:
            return start, []
        if embeds is not None and embeds.shape[1] != input_ids.shape[1] - start:
            raise InconsistentStateError(f"suffix embeddings of {embeds.shape[1]} positions from {start}")
        ordered = self.bounds(start, target, matched_len, spans, prompt_end or embeds is not None)
        snapshots = []
        pos = start
        with torch.no_grad():
            for bound in ordered:
                if self.one_token_steps and pos > 0:
                    for t in range(pos, bound):
                        feed(self.model, self.profile, cache, input_ids, t, t + 1, embeds, start, positions)
                else:
                    feed(self.model, self.profile, cache, input_ids, pos, bound, embeds, start, positions)
                snapshots.append(cache.snapshot(bound))
                pos = bound
        return pos, snapshots


def feed(
    model: Any,
    profile: ModelProfile,
    cache: WorkingCache,
    input_ids: torch.Tensor,
    start: int,
    end: int,
    embeds: torch.Tensor | None = None,
    embeds_from: int = 0,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Feed prompt positions `[start, end)` of `input_ids` (``[1, n]``) into `cache`; their last ``[vocab]`` logits.

    `embeds` (from position `embeds_from`) are fed instead of ids where given, `positions` (``[..., n]``) sliced
    where given, else positions count tokens. Also the batching engine's chunked prefill (`batching/prefill.py`).
    """
    kwargs: dict[str, Any] = {profile.cache_kwarg: cache, "use_cache": True}
    if positions is not None:
        kwargs["position_ids"] = positions[..., start:end]
    elif profile.accepts_position_ids:
        kwargs["position_ids"] = torch.arange(start, end, device=input_ids.device)[None]
    if profile.accepts_logits_to_keep:
        kwargs["logits_to_keep"] = 1
    if embeds is not None:
        output = model(inputs_embeds=embeds[:, start - embeds_from : end - embeds_from], **kwargs)
    else:
        output = model(input_ids=input_ids[:, start:end], **kwargs)
    logits: torch.Tensor = output.logits[0, -1]
    return logits
