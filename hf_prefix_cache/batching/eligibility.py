"""Which rows may join the running batch, and why the others run alone through `generate` (`batch_alone:<why>`).

A model joins rows when its profile lays rows restored one by one side by side and copies one out
(`ModelProfile.expands` or `joins_rows`, as the store's own padded batches need), its layers keep
attention keys (the mask is what hides a row's padding), it takes explicit positions, and nothing keeps
positions or watches ties per call. A request joins when every setting it asks is one the engine
applies per row exactly as `generate` does: `max_new_tokens`, end ids, stop sequences and stop strings
(`rows.py`, `stops.py`), greedy or seeded sampling with temperature, top_k and top_p, a one-token logit
bias, a repetition penalty and `min_new_tokens` (`sampling.py`). Anything else (beams, n > 1,
`no_repeat_ngram_size`, `min_p`, a bias over several tokens, ...) is kept by name in
`Request.generate_kwargs` or `Sampling.unsupported` (`settings.py` sorts transformers serve's kwargs so),
and the row runs alone, counted under `reasons.BATCH_ALONE` with its detail (`model`, `media`,
`setting_<name>`, `cold`).

Example:
    >>> from hf_prefix_cache.batching.rows import Request
    >>> request_alone_reason(Request((1, 2), max_new_tokens=2, generate_kwargs={"num_beams": 2}))
    'batch_alone:setting_num_beams'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_prefix_cache import reasons

if TYPE_CHECKING:
    from hf_prefix_cache.batching.rows import Request
    from hf_prefix_cache.model.profile import ModelProfile

#: The detail of a row whose prefill through the store ran cold (its state is not a working cache to join).
COLD = reasons.with_detail(reasons.BATCH_ALONE, "cold")


def model_alone_reason(profile: ModelProfile) -> str | None:
    """Why no row of this model can join a batch (``batch_alone:model`` or ``batch_alone:media``), or None."""
    if profile.media is not None or profile.item_layers:
        return reasons.with_detail(reasons.BATCH_ALONE, "media")
    joins = profile.expands or profile.joins_rows
    plain = (
        profile.unsupported is None
        and profile.encoder_family is None
        and profile.has_kv
        and profile.accepts_position_ids
        and profile.own_cache is None
        and not profile.single_token_steps
        and not profile.keeps_positions
        and not profile.watch_indexers
        and profile.exact_prompt_len is None
    )
    return None if joins and plain else reasons.with_detail(reasons.BATCH_ALONE, "model")


def request_alone_reason(request: Request) -> str | None:
    """Why this request cannot join a batch (``batch_alone:setting_<name>``: the first setting, in
    `Sampling.unsupported` or `Request.generate_kwargs`, that the engine does not implement), or None."""
    names = [*request.sampling.unsupported, *request.generate_kwargs]
    if names:
        return reasons.with_detail(reasons.BATCH_ALONE, f"setting_{names[0]}")
    return None
