"""Tiny models of model types new in transformers 5.25, where the support matrix's generic shrink is not enough.

Built as `tiny_build` describes (float32, eager attention, generation that never stops early).
Each builder raises `ImportError` on a release without the model type (5.23, 5.24); tests skip then.
LLaVA-OneVision-1.5's tiny model, whose media the generic table serves, is with its family in
`testing/media/grid.py`; Ovis2.5's media cases are in `testing/media/ovis2_5.py`.

* `tiny_kolibri1_1`: Kolibri 1.1's three kinds of layer: sliding, indexed attention (an indexer and a
  reindexer rescoring its pool) and a "reuse" layer attending to an earlier layer's keys
  (`kv_source_layers`), whose cache layer transformers makes a `DummyLayer`. The indexers keep every
  key while a query sees at most `budget` keys, and select (top-k of a pooled candidate set, plus sink
  and local tokens) past it.
* `tiny_ovis2_5`: Ovis2.5, a Qwen3 text model and a windowed tower on flattened 2x2 patch rows with
  2x2 merge; image and video framing ids (start / end) embedded from its visual table.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

from hf_prefix_cache.testing.tiny_build import _ATTN, _EXPERTS, _ROUTED_EXPERTS, _make, seeded
from hf_prefix_cache.testing.tiny_vlm_parts import _FRAMED_IDS, _TOWER

#: Kolibri 1.1's indexers: top-k, local and sink tokens (a query seeing at most their sum keeps every key).
KOLIBRI_TOP_K, KOLIBRI_LOCAL, KOLIBRI_SINK = 12, 4, 2
#: Layer kinds of the tiny Kolibri: layer 2 reuses layer 1's keys and rescores its pool.
KOLIBRI_LAYERS = (
    "sliding_attention",
    "indexed_attention",
    "indexed_attention",
    "sliding_attention",
    "indexed_attention",
)
#: Ovis2.5's placeholder and framing ids in the tiny vocabulary.
OVIS_IMAGE, OVIS_VIDEO, OVIS_IMAGE_START, OVIS_IMAGE_END, OVIS_VIDEO_START, OVIS_VIDEO_END = _FRAMED_IDS.values()


def _class(name: str) -> Any:
    cls = getattr(transformers, name, None)
    if cls is None:
        raise ImportError(f"transformers {transformers.__version__} has no {name} (new in 5.25)")
    return cls


def tiny_kolibri1_1(budget: int = KOLIBRI_TOP_K + KOLIBRI_LOCAL + KOLIBRI_SINK) -> Any:
    """Kolibri 1.1 of five layers: sliding, indexer (its keys shared), reuse + reindexer, sliding, indexer.

    `budget` is the longest key range a query keeps whole (top-k + local + sink tokens).
    """
    config_cls = _class("Kolibri1_1Config")
    return _make(
        config_cls,
        "Kolibri1_1ForCausalLM",
        **_ATTN,
        head_dim=16,
        num_hidden_layers=len(KOLIBRI_LAYERS),
        layer_types=list(KOLIBRI_LAYERS),
        index_layers=[1, 4],
        kv_source_layers=[0, 1, 1, 3, 4],
        index_num_heads=2,
        index_topk=budget - KOLIBRI_LOCAL - KOLIBRI_SINK,
        index_num_local_tokens=KOLIBRI_LOCAL,
        index_num_sink_tokens=KOLIBRI_SINK,
        index_pool_size=16,
        index_compression=4,
        mlp_only_layers=[0],
        mlp_only_intermediate_size=64,
        **_EXPERTS,
        shared_expert_intermediate_size=32,
        sliding_window=8,
    )


def tiny_ovis2_5() -> Any:
    """Ovis2.5: Qwen3 text, a 2-layer tower on 2x2 patch rows (2x2 merge), a 64-entry visual table."""
    config = _class("Ovis2_5Config")(
        text_config={
            **_ATTN,
            "model_type": "qwen3",
            "vocab_size": 128,
            "head_dim": 16,
            "num_hidden_layers": 2,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": None,
        },
        vision_config={
            **_TOWER,
            "patch_size": 2,
            "image_size": 16,
            "window_size": 8,
            "spatial_merge_size": 2,
            "vocab_size": 64,
        },
        **_FRAMED_IDS,
    )
    config._attn_implementation = "eager"
    return seeded(_class("Ovis2_5ForConditionalGeneration"), config)


def ovis_image(seed: int, grid: tuple[int, int, int] = (1, 4, 4)) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """An Ovis2.5 image's ids (start, placeholders, end) and its `pixel_values` / `image_grid_thw`."""
    t, h, w = grid
    rows = torch.rand(t * h * w, 3 * 2 * 2, generator=torch.Generator().manual_seed(seed))
    ids = torch.tensor([[OVIS_IMAGE_START, *[OVIS_IMAGE] * (t * h * w // 4), OVIS_IMAGE_END]])
    return ids, {"pixel_values": rows, "image_grid_thw": torch.tensor([list(grid)])}


def tiny_ergo() -> Any:
    """Ergo: four layers, sliding but for full attention every second one (its own rotary base per kind); experts."""
    return _make(
        _class("ErgoConfig"),
        "ErgoForCausalLM",
        **{k: v for k, v in _ATTN.items() if k != "intermediate_size"},
        num_hidden_layers=4,
        global_attention_every_n_layers=2,
        sliding_window=8,
        first_dense_intermediate_size=128,
        num_dense_blocks=1,
        **_EXPERTS,
        shared_intermediate_size=64,
    )


def tiny_minicpm5_moe() -> Any:
    """MiniCPM5-MoE: two layers of full attention, one dense and one with experts."""
    return _make(
        _class("MiniCPM5MoeConfig"),
        "MiniCPM5MoeForCausalLM",
        **_ATTN,
        num_hidden_layers=2,
        head_dim=16,
        mlp_layer_types=["dense", "sparse"],
        **_ROUTED_EXPERTS,
    )


def tiny_param2moe() -> Any:
    """Param2MoE (a configuration of its own, GLM-4-MoE's model): two layers, the first dense."""
    return _make(
        _class("Param2MoeConfig"),
        "Glm4MoeForCausalLM",
        **_ATTN,
        num_hidden_layers=2,
        head_dim=16,
        **_ROUTED_EXPERTS,
        n_shared_experts=1,
    )
