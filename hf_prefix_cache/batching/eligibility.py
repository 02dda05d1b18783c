"""Which rows may join the running batch, and why the others run alone through `generate` (`batch_alone:<why>`).

A model joins rows when its profile lays rows restored one by one side by side and copies one out
(`ModelProfile.expands` or `joins_rows`, as the store's own padded batches need), its layers keep
attention keys (the mask is what hides a row's padding), it takes explicit positions, and nothing keeps
positions or watches ties per call. A model with media joins rows (with their own images, or text
only) only where its media family is in `JOINING_MEDIA_TYPES`: each was shown to decode batched exactly as its
own `generate` (`tests/batching/test_media_rows.py`); the other media models keep every row alone, M-RoPE
ones under ``mrope`` (positions numbered by each medium's grid, and a rope delta some keep per call), the
rest under ``media``. A request joins when every setting it asks is one the engine applies per row
exactly as `generate` does: `max_new_tokens`, end ids, stop sequences and stop strings (`rows.py`,
`stops.py`), greedy or seeded sampling with temperature, top_k and top_p, a one-token logit bias, a
repetition penalty and `min_new_tokens` (`sampling.py`). Anything else (beams, n > 1,
`no_repeat_ngram_size`, `min_p`, a bias over several tokens, ...) is kept by name in
`Request.generate_kwargs` or `Sampling.unsupported` (`settings.py` sorts transformers serve's kwargs so),
and the row runs alone, counted under `reasons.BATCH_ALONE` with its detail (`model`, `media`, `mrope`,
`setting_<name>`, `cold`).

Example:
    >>> from hf_prefix_cache.batching.rows import Request
    >>> request_alone_reason(Request((1, 2), max_new_tokens=2, generate_kwargs={"num_beams": 2}))
    'batch_alone:setting_num_beams'
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from hf_prefix_cache import reasons
from hf_prefix_cache.multimodal.registry import family_key

if TYPE_CHECKING:
    from hf_prefix_cache.batching.rows import Request
    from hf_prefix_cache.model.profile import ModelProfile

#: The detail of a row whose prefill through the store ran cold (its state is not a working cache to join).
COLD = reasons.with_detail(reasons.BATCH_ALONE, "cold")
#: Media families (`multimodal.registry` keys: a model type, or a model type and its tower) whose rows join the
#: batch: their prefill runs through the store with the row's media, and their decode steps feed text at each
#: row's next position (M-RoPE: shifted per axis, `media.py`). Each is proven exact against its own `generate`
#: by `tests/batching/test_media_rows.py`; another tower of one of them (``llava/pixtral``) is another family.
JOINING_MEDIA_TYPES = frozenset(
    {
        # positions count tokens
        "llava", "llava_next", "llava_next_video", "gemma3", "shieldgemma2", "idefics2", "idefics3", "smolvlm",
        "qwen2_audio",
        # M-RoPE: each row's positions shifted off its cache length per axis
        "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "glm4v", "glm4v_moe", "glm46v", "glm_ocr", "glmga", "paddleocr_vl",
    }
)  # fmt: skip


def model_alone_reason(profile: ModelProfile) -> str | None:
    """Why no row of this model can join a batch (``batch_alone:model``, ``:media`` or ``:mrope``), or None."""
    media = profile.media
    if profile.item_layers or (media is not None and family_key(media.config) not in JOINING_MEDIA_TYPES):
        detail = "mrope" if media is not None and media.has_positions else "media"
        return reasons.with_detail(reasons.BATCH_ALONE, detail)
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
