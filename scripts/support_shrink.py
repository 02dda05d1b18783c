"""How the support matrix shrinks a model type's config to a tiny model: sizes, ids, per-type overrides.

`shrunk_kwargs(model_type)` gives the constructor kwargs of the type's config class: every integer
size named in `SIZES` set wherever a config or any nested sub-config has it, per-layer lists and
layer kinds cut to the tiny layer count, token ids moved inside the tiny vocabulary, and then the
per-type `OVERRIDES` merged on top (only where the generic rules fail). Knows nothing about
models, stores or the document.
"""

from __future__ import annotations

from typing import Any

VOCAB = 128

# Integer config attributes set wherever a config (or sub-config) has them.
SIZES: dict[str, int] = {
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
_VIBEVOICE_TOKENIZER = {"num_filters": 4, "depths": [1] * 7}
# (0 shared layers: the config then shares all of them, however many the shrink leaves.)
_GEMMA4_DRAFTER = {"hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0, "num_kv_shared_layers": 0}
# KV sharing: the last layer of each kind reuses an earlier one's cache.
_INKLING2_LOOP = {
    "unpadded_vocab_size": VOCAB,
    "n_layers_per_attn_res_block": 1,
    "loop_layer_index_start": 1,
    "loop_layer_index_end": 2,
    "loop_num_passes": 2,
}
_GEMMA3N_TEXT = {
    "num_hidden_layers": 4,
    "num_kv_shared_layers": 2,
    "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
    "activation_sparsity_pattern": [0.0, 0.0, 0.0, 0.0],
    "intermediate_size": 128,
}
OVERRIDES: dict[str, dict[str, Any]] = {
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
    "gemma3n_text": _GEMMA3N_TEXT,
    # Gemma 3n's MobileNetV5 (timm) at a sixteenth of its channels, as the test suite's tiny model; its output
    # width is fixed. Image and audio soft tokens follow the text ids.
    "gemma3n": {
        "text_config": {**_GEMMA3N_TEXT, "vocab_size_per_layer_input": VOCAB},
        "vision_config": {
            "model_args": {"channel_multiplier": 0.0625, "msfa_output_resolution": 2},
            "hidden_size": 2048,
            "vocab_size": 16,
            "vocab_offset": VOCAB,
        },
        "audio_config": {"vocab_size": 16, "vocab_offset": VOCAB + 16},
    },
    # Perception LM's timm tower (a ResNet-50 by default, which its projector cannot read): a tiny PE ViT.
    "perception_lm": {
        "vision_config": {
            "architecture": "vit_pe_core_tiny_patch16_384",
            "model_args": {"embed_dim": 64, "depth": 2, "num_heads": 4, "img_size": 32},
        }
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
    # Its second layer looped twice (by default the loop starts past the shrunk layers, so nothing would loop).
    "inkling2_loop_text": _INKLING2_LOOP,
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
    # Widths a projector hands to the text model, which these configs check against its hidden size
    # (set here, not in `SIZES`: the other families' projectors are never run by text prompts).
    "fun_asr_nano": {"adaptor_config": {"intermediate_size": 16}},  # a quarter of the text width
    "granite_docling": {"vision_config": {"out_hidden_size": 64}},
    "hunyuan_vl": {
        "vision_config": {"out_hidden_size": 64, "text_hidden_size": 64},
        "text_config": {"head_dim": 16, "rope_parameters": {"mrope_section": [2, 2, 2, 2]}},
    },
    "inkling2": {"vision_config": {"text_hidden_size": 64}, "text_config": {"unpadded_vocab_size": VOCAB}},
    "inkling2_loop": {"vision_config": {"text_hidden_size": 64}, "text_config": _INKLING2_LOOP},
    "muse_spark": {"out_hidden_size": 64, "audio_config": {"out_hidden_size": 64}},
    # One codebook: generate then takes one row of audio codes per prompt, as the sweep's prompts are.
    "musicgen": {"decoder": {"num_codebooks": 1}},
    "musicgen_melody": {"decoder": {"num_codebooks": 1}},
    # Vision layers the adapter reads, inside the tiny tower.
    "molmo2": {"adapter_config": {"vision_feature_layer": [-1, -2], "text_hidden_size": 64}},
    # Deepstack projections (vision layer, text layer) and spatial targets, inside the tiny towers (None by default).
    "granite4_vision": {"deepstack_layer_map": [[-1, 0]], "spatial_target_layers": [1], "downsample_rate": "1/2"},
    # Its audio tokenizer has no projections around the quantizer: codebook and hidden widths are one.
    # Image and audio codes follow the text ids in one vocabulary: 16 and 8 codes, at 100 and 116.
    "apertus1p5": {
        "image_token_offset": 100,
        "audio_token_offset": 116,
        "vision_config": {"codebook_size": 16},
        "audio_config": {"codebook_dim": 64, "codebook_size": 8},
    },
    # Sizes the default config leaves unset (None) or the model reads without the config defining them.
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"], "num_experts_per_tok": 2}},
    "diffusion_gemma": {"text_config": {"num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 32}},
    "qwen3_omni_moe": {
        "talker_config": {"spatial_merge_size": 2, "text_config": {"shared_expert_intermediate_size": 32}}
    },
    "moonshine_streaming": {"num_key_value_heads": 4},
    "chameleon": {"vocabulary_map": {"<image>": 120}},  # no image tokens: text prompts only
    # Its rotary embedding reads M-RoPE sections (height, width, time; height and width alike) the default config
    # does not list; experts as `SIZES` would.
    "ernie4_5_vl_moe": {
        "text_config": {"moe_num_experts": 4, "moe_k": 2, "rope_parameters": {"mrope_section": [3, 3, 2]}}
    },
    # MLA sliding layers whose head size is nope + rope (the generic MLA rule sets the rotary part only).
    # Its vision and audio adapters read their encoders' widths and write the text model's.
    "dots3_note": {
        "text_config": {"head_dim": 16},
        "vision_config": {"adapter_in_dim": 64, "adapter_out_dim": 64},
        "audio_config": {"adapter_input_size": 64, "adapter_out_dim": 64},
    },
    # Drafters: every layer reads the key / value states the Gemma 4 target hands it (no per-layer inputs).
    "gemma4_assistant": {"text_config": _GEMMA4_DRAFTER},
    "gemma4_unified_assistant": {"text_config": _GEMMA4_DRAFTER},
    # The audio pad id is the last row of the joint text + codebook embedding.
    "kyutai_speech_to_text": {"audio_pad_token_id": VOCAB + 32 * 2049, "codec_config": {"upsample_groups": 64}},
    # Audio tokenizers whose channels double at each of 6 stages from `num_filters`: 4 filters, one block a stage.
    "vibevoice": {"audio_config": _VIBEVOICE_TOKENIZER, "semantic_model_config": _VIBEVOICE_TOKENIZER},
    # Input, looped and output blocks adding up to the layer count (its to_dict doubles the counts).
    "dory": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]}
    | {"n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
}
# Types whose per_layer_config names layers past the tiny layer count (see `_shrunk_kwargs`).
# (A standalone text config does not check the keys; trimming there would change rows already served.)
_TRIM_PER_LAYER = frozenset(
    {"gemma4", "gemma4_unified", "gemma4_assistant", "gemma4_unified_assistant", "diffusion_gemma", "dots3_note"}
)
# Types whose deeper configs tie vocabularies and widths to each other (Nemotron 3.5 Transcribe: its ASR and
# diarization configs inside the audio config check blank ids and head widths): only the named sub-configs shrink.
_NAMED_ONLY = frozenset({"nemo_speechlm"})
_SUB_CONFIGS = (
    "text_config", "vision_config", "audio_config", "decoder", "encoder", "speech_config",
    "encoder_config", "decoder_config", "global_config", "patcher_config",
)  # fmt: skip


def _shrunk_kwargs(
    config: Any, depth: int = 0, trim_per_layer: bool = False, named_only: bool = False
) -> dict[str, Any]:
    """Constructor kwargs of `config`'s class giving a tiny model: sizes, ids and sub-configs.

    `named_only` shrinks only the sub-configs `_SUB_CONFIGS` names, two levels deep (see `_NAMED_ONLY`).
    `trim_per_layer` drops `per_layer_config` entries of layers past the tiny count (Gemma 4,
    whose config refuses them; other families' per-layer entries set sizes that must stay).
    """
    present = config.to_dict()
    kwargs: dict[str, Any] = {k: v for k, v in SIZES.items() if isinstance(present.get(k), int)}
    # A head size of 0 switches its part off (GLM-5-Next's NoPE heads): it stays 0.
    kwargs.update({k: 0 for k in kwargs if k.endswith("_dim") and present[k] == 0})
    kwargs.update({k: v for k, v in _IDS.items() if k in present})
    if "eos_token_id" in kwargs and not _allows_none(config, "eos_token_id"):
        kwargs["eos_token_id"] = VOCAB - 1  # a config that must name one (never prompted, suppressed in answers)
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
    rope = present.get("rope_parameters")
    if isinstance(rope, dict) and isinstance(rope.get("mrope_section"), list) and len(rope["mrope_section"]) == 3:
        kwargs["rope_parameters"] = {**rope, "mrope_section": _mrope_section(present, kwargs, rope)}
    if depth < (2 if named_only else 3):
        for name, sub in _sub_configs(config, named_only).items():
            kwargs[name] = {**sub.to_dict(), **_shrunk_kwargs(sub, depth + 1, trim_per_layer, named_only)}
    return kwargs


def _allows_none(config: Any, name: str) -> bool:
    """Whether the config dataclass's field `name` accepts None (True where it is no dataclass field)."""
    import dataclasses

    fields = {f.name: f for f in dataclasses.fields(config)} if dataclasses.is_dataclass(config) else {}
    return name not in fields or "None" in str(fields[name].type)


def _mrope_section(present: dict[str, Any], kwargs: dict[str, Any], rope: dict[str, Any]) -> list[int]:
    """Three M-RoPE sections (time, height, width) adding up to half the tiny rotary dimension."""
    head_dim = kwargs.get("qk_rope_head_dim") or kwargs.get("head_dim")
    if not head_dim:
        head_dim = kwargs.get("hidden_size", 64) // kwargs.get("num_attention_heads", 4)
    factor = rope.get("partial_rotary_factor", present.get("partial_rotary_factor")) or 1.0
    half = int(head_dim * factor) // 2
    base, rest = divmod(half, 3)
    return [base, base + (rest >= 2), base + (rest >= 1)]


def _sub_configs(config: Any, named_only: bool = False) -> dict[str, Any]:
    """The nested configs of `config` by constructor name: every attribute holding a config (adaptors, talkers,
    codecs, Q-Formers included), never a read-only property (WavTokenizer's `encoder_config` is derived)."""
    found: dict[str, Any] = {}
    named = [(n, getattr(config, n, None)) for n in _SUB_CONFIGS]
    for name, value in named if named_only else [*named, *vars(config).items()]:
        if isinstance(getattr(type(config), name, None), property) or name.startswith("_"):
            continue
        if value is not None and hasattr(value, "to_dict") and hasattr(value, "model_type"):
            found[name] = value
    return found


def _merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated by `extra`, dicts merged key by key (a sub-config keeps its shrunk sizes)."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def shrunk_kwargs(model_type: str) -> dict[str, Any]:
    """Constructor kwargs of `model_type`'s config class for a tiny model (its overrides merged in)."""
    import transformers

    config_cls = transformers.CONFIG_MAPPING[model_type]
    overrides = OVERRIDES.get(model_type, {})
    try:
        default = config_cls()
    except Exception:  # noqa: BLE001 - the default config fails its own validators (Gemma 4 Assistant): start from the overrides
        default = config_cls(**overrides)
    trim = model_type in _TRIM_PER_LAYER
    return _merged(_shrunk_kwargs(default, trim_per_layer=trim, named_only=model_type in _NAMED_ONLY), overrides)
