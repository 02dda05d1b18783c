"""Generate docs/support.md: which transformers model types the store serves exactly.

Every model type of four transformers auto mappings (causal LM, image-text-to-text,
multimodal LM, speech seq2seq) is built as a tiny random-weight model from its config class,
shrunk generically (layers, hidden sizes, heads, vocabulary, experts, in every sub-config),
and put through a fixed scenario, each step compared with a cold run (tokens identical,
logits within 1e-4 in float32):

1. cold: the first prompt through an empty store;
2. hit: a second turn (prompt + answer + new tokens), which should reuse the first;
3. repeat: the second turn again, exactly.

A row says ``served`` (with the hit tokens of steps 2 and 3), ``cold`` with the reasons the
store counted in ``stats().fallbacks``, ``WRONG`` (cached differs from cold: a bug),
``not buildable`` (why) or ``timeout``. Each model type runs in a worker process with a
time limit, so one hanging family does not stop the sweep.

The prompt is random text ids. Types that cannot generate from text ids alone get what their
forward needs besides, from `support_inputs.py` (the same on every call): an encoder-decoder
whose encoder reads audio features, a waveform, pixels or patches gets them as its encoder input
and the prompt as `decoder_input_ids`; a model whose forward needs an image (BLIP-2, Kosmos-2,
Idefics, ...) gets one, with its placeholder ids leading every prompt. A model type whose media
an adapter serves also gets a media cell from `support_media.py`: cold, hit, changed medium and
repeat with the test suite's tiny media model of the family (hit tokens of the last three
steps, or why not served).

Usage::

    OMP_NUM_THREADS=1 python scripts/support_matrix.py            # full sweep, writes docs/support.md
    python scripts/support_matrix.py --only llama,mistral --check # compare those rows with docs/support.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import select
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import support_inputs
import support_media

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "support.md"
MARK = "@@ROW "
LOGIT_TOL = 1e-4
#: Rows one worker runs before it exits and a fresh one starts.
ROWS_PER_WORKER = 10
#: Address-space limit of a worker process, bytes.
MEMORY_LIMIT = 4 * 2**30

#: The auto mappings swept, in the order a type's row picks its model class.
MAPPINGS = (
    ("causal LM", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "AutoModelForCausalLM"),
    ("image-text-to-text", "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", "AutoModelForImageTextToText"),
    ("multimodal LM", "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES", "AutoModelForMultimodalLM"),
    ("speech seq2seq", "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "AutoModelForSpeechSeq2Seq"),
)

VOCAB = 128

# Integer config attributes set wherever a config (or sub-config) has them.
_SIZES: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "d_model": 64,
    "n_embd": 64,
    "dim": 64,
    "embed_dim": 64,
    "intermediate_size": 128,
    "ffn_dim": 128,
    "n_inner": 128,
    "d_ff": 128,
    "decoder_ffn_dim": 128,
    "encoder_ffn_dim": 128,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_attention_heads": 4,
    "num_key_value_heads": 2,
    "n_kv_heads": 2,
    "head_dim": 16,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "n_layers": 2,
    "num_layers": 2,
    "decoder_layers": 2,
    "encoder_layers": 2,
    "num_decoder_layers": 2,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_expand": 2,
    "state_size": 16,
    "ssm_state_size": 16,
    "time_step_rank": 8,
    "mamba_chunk_size": 16,
    "chunk_size": 16,
    "num_mel_bins": 16,
    "image_size": 32,
    "patch_size": 8,
    "projection_dim": 64,
    "vision_output_dim": 64,
    "lru_width": 64,
    "num_experts_per_token": 2,
    "linear_num_heads": 4,
    "linear_head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "index_topk": 256,  # every key kept at sweep lengths; past the top-k a store runs cold (`indexer_top_k`)
    "index_n_heads": 8,
    "index_head_dim": 16,
}
# Token ids moved inside the tiny vocabulary (ids 0-3 are never in the scenario's prompts).
_IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": None, "decoder_start_token_id": 1}
# Per-family overrides, only where the generic shrink fails.
# Dict values merge into the shrunk sub-config instead of replacing it.
_MROPE = {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}}
# Qwen4-Exp's indexer sizes, left unset (None) by its default config.
# 8 indexer heads: with 2, ReLU zeroes every head of many blocks, and their exact ties send turns cold (`indexer_tie`).
_QWEN4_INDEXER = {"indexer_n_heads": 8, "indexer_kv_heads": 1, "indexer_head_dim": 16}
_QWEN4_INDEXER.update(indexer_budget=8, indexer_compress_ratio=4)
_COMPASS_ROPE = {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 10000.0}}}
_QUERY_MODELS: dict[str, Any] = {
    "text_config": {"word_embed_proj_dim": 64},
    "qformer_config": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 128},
}
_OVERRIDES: dict[str, dict[str, Any]] = {
    # One attention layer after two recurrent ones (the generic 2 layers would be recurrent only).
    "bamba": {"attn_layer_indices": [1]},
    "recurrent_gemma": {"num_hidden_layers": 3, "block_types": ["recurrent", "recurrent", "attention"]},
    # Hybrids whose first layers are all recurrent: one recurrent layer, then one with attention.
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1},
    "zamba": {"num_hidden_layers": 3, "layers_block_type": ["linear_attention", "hybrid", "hybrid"]},
    "zamba2": {"layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1], "mamba_headdim": 16},
    "granitemoehybrid": {"layer_types": ["linear_attention", "attention"]},
    "falcon_h1": {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16},
    # M-RoPE sections must add up to half the rotary dimension of the tiny heads (16, or 8 at a 0.5 factor).
    "qwen2_vl": {"text_config": _MROPE},
    "qwen2_5_vl": {"text_config": _MROPE},
    "glm4v": {"text_config": _MROPE},
    "glm46v": {"text_config": _MROPE},
    "glmga": {"text_config": _MROPE},
    "glm_ocr": {"text_config": _MROPE},
    "paddleocr_vl": {"text_config": _MROPE},
    "glm4v_moe": {
        "text_config": {
            "rope_parameters": {**_MROPE["rope_parameters"], "partial_rotary_factor": 0.5, "mrope_section": [1, 1, 2]}
        }
    },  # fmt: skip
    "reformer": {"axial_pos_shape": [8, 8], "axial_pos_embds_dim": [32, 32], "attn_layers": ["local", "local"]},
    # Sizes the config leaves unset (None) or derives from others.
    "nemotron": {"num_key_value_heads": 2},
    "deepseek_v2": {"num_experts_per_tok": 2},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "gptj": {"rotary_dim": 8},
    "codegen": {"rotary_dim": 8},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    # KV sharing: the last layer of each kind reuses an earlier one's cache.
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "num_kv_shared_layers": 2,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "activation_sparsity_pattern": [0.0, 0.0, 0.0, 0.0],
        "intermediate_size": 128,
    },
    "ministral": {"head_dim": 16},
    "zaya": {"num_experts_per_tok": 1},
    # Its own cache sizes the state as if keys and values had one head size (transformers 5.23).
    "xlstm": {"embedding_dim": 64, "num_blocks": 2, "qk_dim_factor": 1.0},
    "hunyuan_v1_dense": {"head_dim": 16},
    "hunyuan_v1_moe": {"head_dim": 16},
    # Byte-level: hashed n-gram tables and the global model's width, outside the generic names.
    "blt": {
        "encoder_hash_byte_group_vocab": 64,
        "encoder_config": {"hidden_size_global": 64},
        "decoder_config": {"hidden_size_global": 64},
    },
    # Expert counts left unset (None) by the default config.
    "dots1": {"n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1},
    # The default attention sub-config lacks the rotary base its attention reads (transformers 5.23).
    # and it clamps queries, keys and values by `clip_qkv`, which must then be set.
    "dbrx": {"attn_config": {"rope_theta": 10000.0, "clip_qkv": 8.0}},
    "qwen4_exp_text": _QWEN4_INDEXER,
    "qwen4_exp": {"text_config": _QWEN4_INDEXER},
    # Rotary settings per layer kind, empty in the default config.
    "cohere_compass_text": _COMPASS_ROPE,
    "cohere_compass": {"text_config": _COMPASS_ROPE},
    # Query-token models: 8 queries (not 32), each with a placeholder id (None by default: no image merged).
    # The default OPT text model projects its embeddings to a width of its own; the Q-Former is a BERT of its own.
    "blip-2": {"num_query_tokens": 8, "image_token_index": 120, **_QUERY_MODELS},
    "instructblip": {"num_query_tokens": 8, "image_token_index": 120, **_QUERY_MODELS},
    "instructblipvideo": {"num_query_tokens": 8, "video_token_index": 120, **_QUERY_MODELS},
    # T5-style attention: heads of d_kv each.
    "pix2struct": {"vision_config": {"d_kv": 16}, "text_config": {"d_kv": 16}},
    # The width its vision encoder projects to for the decoder, and windows to fit a 4 x 4 patch grid.
    "pp_formulanet": {"vision_config": {"decoder_hidden_size": 64, "window_size": 2, "global_attn_indexes": [1]}},
    "kosmos-2": {"latent_query_num": 8},
    # The thinkers' rotary index reads these ids, which their config classes leave unset (None).
    "qwen2_5_omni_thinker": {"vision_start_token_id": 121, "vision_end_token_id": 122, "text_config": _MROPE},
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 121, "vision_end_token_id": 122, "text_config": _MROPE},
    "udop": {"image_size": 32, "patch_size": 8},
    # Head sizes its config derives (nope + rope) where the MLA rule above sets the rotary part only.
    "mistral4": {"head_dim": 16},
    # Sliding-window heads read the window even where every layer is full attention.
    "step3p7": {"text_config": {"sliding_window": 8}},
    # Multi-head attention (its eager attention does not repeat grouped key / value heads).
    "unlimited_ocr": {"text_config": {"num_key_value_heads": 4}},
    # The embedding is as large as the unpadded vocabulary.
    # Cross-attention sizes of its decoder, outside the generic names.
    "dia": {
        "decoder_config": {
            "cross_num_attention_heads": 4,
            "cross_head_dim": 16,
            "cross_num_key_value_heads": 2,
            "cross_hidden_size": 64,
        }
    },  # fmt: skip
    "inkling2_text": {"unpadded_vocab_size": VOCAB},
    "inkling2_loop_text": {"unpadded_vocab_size": VOCAB},
    # Kolibri 1.1: an indexer layer, a layer reusing its keys (a `DummyLayer`) and rescoring its pool, between two
    # sliding layers; its indexer scores with at most the query heads of one key head.
    "kolibri1_1": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "indexed_attention", "indexed_attention", "sliding_attention"],
        "index_layers": [1],
        "kv_source_layers": [0, 1, 1, 3],
        "index_num_heads": 2,
        "mlp_only_layers": [0],
    },
    # Its vision tower projects to the text model's width.
    "llava_onevision1_5": {"vision_config": {"out_hidden_size": 64}},
}
# Types whose per_layer_config names layers past the tiny layer count (see `_shrunk_kwargs`).
_TRIM_PER_LAYER = frozenset({"gemma4", "gemma4_unified"})
_SUB_CONFIGS = (
    "text_config", "vision_config", "audio_config", "decoder", "encoder", "speech_config",
    "encoder_config", "decoder_config", "global_config", "patcher_config",
)  # fmt: skip


@dataclass
class Row:
    """One model type's result."""

    model_type: str
    mappings: list[str]
    status: str  # served, cold, WRONG, not buildable, timeout, not run
    detail: str = ""
    hit_tokens: str = ""
    model_class: str = ""
    media: str = ""  # `support_media.media_cell`: hit / changed / repeat, or why not served; "" without a case

    def line(self) -> str:
        cells = (f"`{self.model_type}`", ", ".join(self.mappings), self.model_class, self.status)
        return "| " + " | ".join((*cells, self.hit_tokens, self.media, self.detail)) + " |"

    def is_wrong(self) -> bool:
        return self.status == "WRONG" or support_media.media_status(self.media) == "WRONG"


def model_types() -> dict[str, list[str]]:
    """Every model type of the swept mappings, with the mappings it is in (in `MAPPINGS` order)."""
    from transformers.models.auto import modeling_auto

    types: dict[str, list[str]] = {}
    for label, names, _ in MAPPINGS:
        for model_type in getattr(modeling_auto, names):
            types.setdefault(model_type, []).append(label)
    return dict(sorted(types.items()))


def _shrunk_kwargs(config: Any, depth: int = 0, trim_per_layer: bool = False) -> dict[str, Any]:
    """Constructor kwargs of `config`'s class giving a tiny model: sizes, ids and sub-configs.

    `trim_per_layer` drops `per_layer_config` entries of layers past the tiny count (Gemma 4,
    whose config refuses them; other families' per-layer entries set sizes that must stay).
    """
    present = config.to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in _SIZES.items() if isinstance(present.get(k), int)}
    kwargs.update({k: v for k, v in _IDS.items() if k in present})
    layers = kwargs.get("num_hidden_layers")
    layer_types = present.get("layer_types")
    if layers is not None and isinstance(layer_types, list) and len(layer_types) > layers:
        # Keep one layer of each kind, first occurrences first, so the tiny model has every kind.
        kinds = list(dict.fromkeys(layer_types))
        kwargs["num_hidden_layers"] = max(layers, len(kinds))
        kwargs["layer_types"] = (kinds + layer_types)[: kwargs["num_hidden_layers"]]
    if isinstance(present.get("qk_rope_head_dim"), int):
        if "head_dim" in kwargs:
            kwargs["head_dim"] = kwargs["qk_rope_head_dim"]  # MLA: rotary part of each head
        if "num_key_value_heads" in kwargs and "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]  # MLA has no grouped heads
    old_layers = present.get("num_hidden_layers")
    new_layers = kwargs.get("num_hidden_layers")
    if isinstance(old_layers, int) and isinstance(new_layers, int) and old_layers > new_layers:
        # Per-layer lists (sizes, block kinds) follow the new layer count.
        for name, value in present.items():
            if isinstance(value, list) and len(value) == old_layers and name != "layer_types":
                kwargs[name] = value[:new_layers]
    per_layer = present.get("per_layer_config")
    if trim_per_layer and isinstance(per_layer, dict) and isinstance(new_layers, int):
        # Per-layer settings keyed by layer index: keep those of the layers that remain.
        kwargs["per_layer_config"] = {k: v for k, v in per_layer.items() if int(k) < new_layers}
    for name in ("sliding_window", "sliding_window_size"):
        if isinstance(present.get(name), int):
            kwargs[name] = 8
    if isinstance(present.get("attention_chunk_size"), int):
        kwargs["attention_chunk_size"] = 8
    if depth < 2:
        for name in _SUB_CONFIGS:
            sub = getattr(config, name, None)
            if sub is not None and hasattr(sub, "to_dict") and hasattr(sub, "model_type"):
                kwargs[name] = {**sub.to_dict(), **_shrunk_kwargs(sub, depth + 1, trim_per_layer)}
    return kwargs


def build(model_type: str, auto_class: str) -> Any:
    """A tiny random-weight float32 eval model of `model_type` through `auto_class`."""
    import torch
    import transformers

    from hf_prefix_cache.model.profile import BIDIRECTIONAL_UNLESS_DECODER

    config_cls = transformers.CONFIG_MAPPING[model_type]
    trim = model_type in _TRIM_PER_LAYER
    kwargs = _merged(_shrunk_kwargs(config_cls(), trim_per_layer=trim), _OVERRIDES.get(model_type, {}))
    if model_type in BIDIRECTIONAL_UNLESS_DECODER and auto_class == "AutoModelForCausalLM":
        kwargs["is_decoder"] = True  # as transformers asks for a standalone causal LM of a BERT-style family
    config = config_cls(**kwargs)
    torch.manual_seed(0)
    auto = getattr(transformers, auto_class)
    try:
        model = auto.from_config(config, attn_implementation="eager", dtype=torch.float32)
    except (ValueError, ImportError):
        model = auto.from_config(config, dtype=torch.float32)
    model = model.float().eval()
    if model_type in support_inputs.PREPARE:
        support_inputs.PREPARE[model_type](model)
    gen = model.generation_config
    gen.eos_token_id, gen.pad_token_id, gen.bos_token_id = None, 0, 1
    gen.do_sample, gen.max_length, gen.min_new_tokens = False, None, None
    gen.temperature = gen.top_p = gen.top_k = None
    return model


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, dicts merged key by key (a sub-config keeps its shrunk sizes)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def special_ids(config: Any) -> list[int]:
    """Every token id the config (or a sub-config) names: placeholders, separators, pads."""
    found: set[int] = set()

    def walk(value: Any, name: str = "") -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(item, str(key))
            return
        if name.startswith("forced_") or not name.endswith(("token_id", "token_ids", "token_index")):
            return  # forced ids too: generate refuses to suppress a token it must force
        if isinstance(value, list):
            found.update(v for v in value if isinstance(v, int))
        elif isinstance(value, int) and not isinstance(value, bool):
            found.add(value)

    walk(config.to_dict())
    return sorted(found)


def _prompt_ids(model: Any, count: int, gen: Any) -> Any:
    """`count` random ids in [4, 100) that no config names: text only, never a media placeholder."""
    import torch

    allowed = torch.tensor([i for i in range(4, 100) if i not in set(special_ids(model.config))])
    return allowed[torch.randint(0, len(allowed), (1, count), generator=gen)]


def _generate(model: Any, feed: support_inputs.Feed, ids: Any, store: Any = None) -> Any:
    kwargs: dict[str, Any] = {} if store is None else {"past_key_values": store}
    # Answers never produce a special id either, so later prompts stay text only.
    gen = model.generation_config
    forced: set[Any] = set()  # generate refuses to suppress a token it must force
    for value in (gen.forced_eos_token_id, gen.forced_bos_token_id):
        forced.update(value if isinstance(value, list) else [value])
    kwargs["suppress_tokens"] = [i for i in special_ids(model.config) if 0 <= i < VOCAB and i not in forced] or None
    return model.generate(
        **feed.call(ids),
        max_new_tokens=4,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def scenario(model: Any) -> tuple[str, str, str]:
    """(status, detail, hit tokens) of cold / hit / repeat through a store, each against a cold run."""
    import torch

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.integration import family_of

    family = family_of(model)
    if family.encoder_keyed:
        return "not run", f"encoder-decoder ({family.name}): needs the encoder-input scenario", ""
    store = PrefixCache(model)
    feed = support_inputs.feed(model)
    gen = torch.Generator().manual_seed(0)
    first = _prompt_ids(model, 24, gen)
    if feed.head is not None:
        first = torch.cat([feed.head, first], dim=1)
    hits: list[int] = []
    worst = 0.0
    prompts = [first]
    for step in range(3):
        ids = prompts[-1]
        before = store.stats().hit_tokens
        try:
            cold = _generate(model, feed, ids)
        except Exception as exc:  # noqa: BLE001 - the family cannot generate here at all
            return "error", _short(f"cold generate: {type(exc).__name__}: {exc}"), ""
        try:
            warm = _generate(model, feed, ids, store)
        except Exception as exc:  # noqa: BLE001 - cold works, the store's run does not: a bug
            return "WRONG", _short(f"cached generate raised at step {step}: {type(exc).__name__}: {exc}"), ""
        hits.append(store.stats().hit_tokens - before)
        if not torch.equal(cold.sequences, warm.sequences):
            return "WRONG", f"tokens differ at step {step}", ""
        diff = max((a - b).abs().max().item() for a, b in zip(cold.logits, warm.logits, strict=True))
        worst = max(worst, diff)
        if diff >= LOGIT_TOL:
            return "WRONG", f"logits differ by {diff:.2e} at step {step}", ""
        if step == 0:
            more = _prompt_ids(model, 8, gen)
            prompts.append(torch.cat([warm.sequences if feed.answer_in_prompt else ids, more], dim=1))
        else:
            prompts.append(ids)
    fallbacks = store.stats().fallbacks
    store.detach()
    if fallbacks:
        return "cold", ", ".join(f"`{k}`" for k in sorted(fallbacks)), ""
    hit_text = f"{hits[1]} / {hits[2]}"
    if hits[2] == 0:
        return "WRONG", f"no reuse and no fallback reason (hits {hit_text})", hit_text
    return "served", "", hit_text


def run_row(model_type: str, mappings: list[str]) -> Row:
    """Build and check one model type (in this process): the text scenario, then its media cases."""
    row = _text_row(model_type, mappings)
    row.media = support_media.media_cell(model_type, LOGIT_TOL)
    return row


def _text_row(model_type: str, mappings: list[str]) -> Row:
    auto_class = next(a for label, _, a in MAPPINGS if label == mappings[0])
    row = Row(model_type, mappings, "not buildable")
    try:
        model = build(model_type, auto_class)
    except Exception as exc:  # noqa: BLE001 - any build failure is the row's result
        row.detail = _short(f"{type(exc).__name__}: {exc}")
        return row
    row.model_class = type(model).__name__
    try:
        row.status, row.detail, row.hit_tokens = scenario(model)
    except Exception as exc:  # noqa: BLE001 - a crash in generate is recorded, cold or cached alike
        row.status, row.detail = "error", _short(f"{type(exc).__name__}: {exc}")
    return row


def _short(text: str) -> str:
    text = " ".join(text.split()).replace("|", "/")
    # Which allocation hits the sweep's memory limit varies from run to run; the failure does not.
    text = re.sub(r"you tried to allocate \d+ bytes", "you tried to allocate N bytes", text)
    return text if len(text) <= 160 else text[:157] + "..."


# --------------------------------------------------------------------------- worker pool


def _worker() -> None:
    """Read `model_type<TAB>mappings` lines on stdin; print each result as a marked JSON line."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # A config the shrink misses can ask for gigabytes: fail that row (MemoryError), not the machine.
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    import transformers

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    for line in sys.stdin:
        model_type, mappings = line.rstrip("\n").split("\t")
        row = run_row(model_type, mappings.split(","))
        sys.stdout.write(MARK + json.dumps(asdict(row)) + "\n")
        sys.stdout.flush()
        if _out_of_memory(row):
            return  # the parent starts a fresh worker


class _Slot:
    """One worker process; restarted after a timeout or a crash."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen[str] | None = None
        self.num_rows = 0

    def _start(self) -> subprocess.Popen[str]:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        return subprocess.Popen(
            [sys.executable, __file__, "--worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
            cwd=ROOT,
        )

    def run(self, model_type: str, mappings: list[str], timeout: float) -> Row:
        row = self._run(model_type, mappings, timeout)
        if _out_of_memory(row):
            row = self._run(model_type, mappings, timeout)  # once more in a fresh worker
        self.num_rows += 1
        if self.num_rows % ROWS_PER_WORKER == 0:
            self.close()  # memory grows with every family's modules: start afresh
        return row

    def _run(self, model_type: str, mappings: list[str], timeout: float) -> Row:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        stdout = self.proc.stdout
        assert self.proc.stdin is not None and stdout is not None
        self.proc.stdin.write(f"{model_type}\t{','.join(mappings)}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([stdout], [], [], max(left, 0))
            if not ready:
                self.proc.kill()
                self.proc.wait()
                self.proc = None
                return Row(model_type, mappings, "timeout", f"no result in {timeout:.0f} s")
            line = stdout.readline()
            if not line:
                code = self.proc.wait()
                self.proc = None
                return Row(model_type, mappings, "error", f"worker exited with code {code}")
            if line.startswith(MARK):
                row = Row(**json.loads(line[len(MARK) :]))
                if _out_of_memory(row):
                    self.proc.wait()  # the worker exits after this row
                    self.proc = None
                return row

    def close(self) -> None:
        if self.proc is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait()
            self.proc = None


def _out_of_memory(row: Row) -> bool:
    return "allocate" in row.detail or "MemoryError" in row.detail


def sweep(types: dict[str, list[str]], workers: int, timeout: float) -> list[Row]:
    """Rows of every type in `types`, `workers` processes at a time."""
    todo = list(types.items())
    rows: list[Row] = []
    lock = threading.Lock()

    def drain() -> None:
        slot = _Slot()
        while True:
            with lock:
                if not todo:
                    break
                model_type, mappings = todo.pop(0)
            row = slot.run(model_type, mappings, timeout)
            with lock:
                rows.append(row)
                print(f"{len(rows)}/{len(types)} {row.model_type}: {row.status} {row.detail}", file=sys.stderr)
        slot.close()

    threads = [threading.Thread(target=drain) for _ in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sorted(rows, key=lambda r: r.model_type)


# --------------------------------------------------------------------------- the document

_HEADER = (
    "| model type | mappings | class built | status | hit tokens (hit / repeat)"
    " | media (hit / changed / repeat) | reason |"
)
_BUCKETS = ("served", "cold", "not buildable", "other")
_MEDIA_BUCKETS = ("served", "cold", "other")  # WRONG counts as other (and fails the tests)


def _bucket(status: str) -> str:
    return status if status in _BUCKETS else "other"


def render(rows: Iterable[Row]) -> str:
    """The whole docs/support.md text for `rows`."""
    import transformers

    from hf_prefix_cache.multimodal import registry

    rows = list(rows)
    cold_families = ", ".join(f"`{t}`" for t in sorted(registry.cold()))
    lines = [
        "# Support matrix",
        "",
        f"Generated by `scripts/support_matrix.py` against transformers {transformers.__version__};",
        "do not edit by hand.",
        "",
        "Each model type is built as a tiny random-weight float32 model from its config class and run",
        "through a store: a cold first prompt, a second turn that should reuse it (hit), and an exact",
        "repeat, each compared with a cold run (tokens identical, logits within 1e-4). Prompts are",
        "random text ids that never hold (or generate) a token id the config names, so a media model",
        "sees no placeholder without its medium. A type that cannot generate from text ids alone gets",
        "what its forward needs besides, built from its tiny config and the same on every call",
        "(`scripts/support_inputs.py`): encoder-decoders whose encoder reads audio features (Speech2Text,",
        "Canary, Cohere ASR, SeamlessM4T, Pop2Piano), a waveform (Moonshine, SpeechT5, speech",
        "encoder-decoder), pixels or patches (vision encoder-decoder, PP-FormulaNet, Pix2Struct) or a",
        "page of boxed words (UDOP) get it as their encoder input and the prompt as `decoder_input_ids`;",
        "models whose forward needs a medium get one image (BLIP, BLIP-2, InstructBLIP, Kosmos-2,",
        "Idefics), four frames (InstructBLIP-Video) or streamed audio (Voxtral Realtime), with the",
        "medium's placeholder ids leading every prompt where the model reads them; Dia (text to speech)",
        "answers in audio codes, so its later prompts grow by text only. CI regenerates every row",
        "(`tests/project/test_support_matrix.py`). `served`: exact with the hit tokens shown;",
        "`cold`: the store ran cold and counted these reasons in `stats().fallbacks`; `not buildable`:",
        "the tiny config or model could not be made; `error`: generate itself failed (cold as well);",
        "`not run`: the scenario does not apply (encoder-decoder models served keyed by their encoder",
        "input, covered by their own tests); `WRONG` would mean cached output differs from cold.",
        "",
        "**Media.** Every model type whose media an adapter serves (the hand-written adapters and",
        "the generic table of `hf_prefix_cache/multimodal/`) also runs a media scenario",
        "(`scripts/support_media.py`) on the test suite's tiny media model of its family (the",
        "conditional-generation class, built by `hf_prefix_cache.testing`: `tiny_vlms`, `tiny_qwen_media` and",
        "the family modules of `testing/media/`; not the row's shrunk model): cold,",
        "text + medium A + text; hit, that prompt + its answer + more text (+ a second medium, except",
        "for PaliGemma and Mllama); changed, the first prompt with medium B (same placeholders, other",
        "content) in place of A, which must reuse nothing past A's first placeholder; repeat, the hit",
        "prompt again. Each is compared with a cold run as above. The media model does not depend on",
        "the row's (the Qwen2.5-Omni thinker's shrunk model cannot generate; its media model is served).",
        "The media column gives the hit tokens of the last three steps, or `cold:` and the fallback",
        "reasons; LLaVA's cell adds its Pixtral-tower case. PaliGemma (prefix-LM) reuses only an",
        "identical prompt, so its hit and changed steps reuse 0 by design; Mllama scopes entries by the",
        "prompt's images, so a changed image reuses nothing. Phi-4-multimodal keeps prompts holding both",
        "an audio clip and an image in their own scope (a clip's projection depends on whether its prompt",
        "has an image), so its hit step, which adds a clip and an image to an image-only conversation,",
        "reuses 0 by design (its repeat reuses the whole prompt). Families whose text layers hold",
        "recurrent states restore only at a snapshot, so their changed step reuses 0 (the first",
        "request took no snapshot before A). An empty media cell means no media case:",
        "the type has no media adapter, so its media requests run cold with a fallback reason (among",
        "them GLM-4V, Qwen3-Omni and those `generic_table.COLD_FAMILIES` explains:",
        f"{cold_families}),",
        "or its audio goes to an encoder (Whisper-like speech seq2seq models are keyed by their",
        "encoder input: `tests/integration/test_whisper.py`, `tests/integration/test_seq2seq.py`). Media",
        "families' other paths (videos, several media per prompt, real processors, memory pressure)",
        "are covered by `tests/media/test_media_*.py`.",
        "",
        "| mapping | types | " + " | ".join(_BUCKETS) + " | " + " | ".join(f"media {b}" for b in _MEDIA_BUCKETS) + " |",
        "|---|---|" + "---|" * (len(_BUCKETS) + len(_MEDIA_BUCKETS)),
    ]
    for label, _, _ in MAPPINGS:
        mine = [r for r in rows if label in r.mappings]
        counts = {b: sum(_bucket(r.status) == b for r in mine) for b in _BUCKETS}
        media = [support_media.media_status(r.media) for r in mine]
        media_counts = {b: sum(m == b or (b == "other" and m == "WRONG") for m in media) for b in _MEDIA_BUCKETS}
        cells = [*(str(counts[b]) for b in _BUCKETS), *(str(media_counts[b]) for b in _MEDIA_BUCKETS)]
        lines.append(f"| {label} | {len(mine)} | " + " | ".join(cells) + " |")
    lines += ["", _HEADER, "|---|---|---|---|---|---|---|"]
    lines += [r.line() for r in rows]
    return "\n".join(lines) + "\n"


def parse(text: str) -> dict[str, str]:
    """Row lines of a rendered document by model type."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("| `"):
            out[line.split("`")[1]] = line
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--check", action="store_true", help="compare the rows with docs/support.md, write nothing")
    parser.add_argument("--in-process", action="store_true", help="run rows here, without workers or timeouts")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per model type")
    parser.add_argument("--out", type=Path, default=DOC)
    args = parser.parse_args(argv)
    if args.worker:
        _worker()
        return 0
    types = model_types()
    if args.only:
        wanted = args.only.split(",")
        missing = [t for t in wanted if t not in types]
        if missing:
            parser.error(f"not in the swept mappings: {', '.join(missing)}")
        types = {t: types[t] for t in wanted}
    in_process = [run_row(t, m) for t, m in types.items()] if args.in_process else None
    rows = in_process if in_process is not None else sweep(types, args.workers, args.timeout)
    if args.check:
        stored = parse(args.out.read_text())
        stale = [r.model_type for r in rows if stored.get(r.model_type) != r.line()]
        for t in stale:
            print(f"stale: {t}\n  doc: {stored.get(t)}\n  now: {next(r.line() for r in rows if r.model_type == t)}")
        return 1 if stale else 0
    if args.only and args.out.exists():
        # Replace only these rows; the rest stays as last generated.
        old = parse(args.out.read_text())
        merged = {**{t: _row_from_line(line) for t, line in old.items()}, **{r.model_type: r for r in rows}}
        rows = sorted(merged.values(), key=lambda r: r.model_type)
    args.out.write_text(render(rows))
    return 0


def _row_from_line(line: str) -> Row:
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    return Row(
        model_type=cells[0].strip("`"),
        mappings=[m.strip() for m in cells[1].split(",")],
        model_class=cells[2],
        status=cells[3],
        hit_tokens=cells[4],
        media=cells[5],
        detail=cells[6],
    )


if __name__ == "__main__":
    # This checkout's package, not an installed copy (sys.path[0] is scripts/ when run as a script).
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
