"""How every tiny causal LM of the test-suite is built: shared sizes, seeding, and generation that never stops early.

Every model is built from its config class (no hub access), seeded with ``torch.manual_seed(0)``,
put in ``eval()`` mode, float32, with ``attn_implementation="eager"``: ``"sdpa"`` is rejected at build
time by Gemma2, Mamba, Mamba2 and FalconMamba, while eager works for every model here.
Sizes are chosen so that a 20-token greedy generate on a ~60-token prompt runs in well under a
second on 2 CPU cores.

Generation never stops early: ``eos_token_id`` is ``None`` in both the config and the generation
config, so ``generate(..., max_new_tokens=n)`` always yields exactly ``n`` new tokens.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
import transformers
from transformers import PreTrainedConfig, PreTrainedModel

#: Vocabulary size shared by all tiny models.
VOCAB_SIZE = 128
#: Sliding-window / attention-chunk size; shorter than the prompts used in tests (~40-80 tokens).
WINDOW = 8
#: Attention implementation used for every model.
ATTN_IMPLEMENTATION = "eager"
#: Special token ids (all below 4, never produced by :func:`random_prompt`).
PAD_ID, BOS_ID = 0, 1

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "pad_token_id": PAD_ID,
    "bos_token_id": BOS_ID,
    "eos_token_id": None,
    "tie_word_embeddings": False,
}

# Decoder-only transformer sizes (hidden 64, 4 heads of 16, 2 KV heads).
_ATTN: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
}

# Mamba-2 style mixer sizes (d_inner = 2 * 64 = 128 = 8 heads * 16).
_MAMBA2: dict[str, Any] = {
    "mamba_n_heads": 8,
    "mamba_d_head": 16,
    "mamba_n_groups": 1,
    "mamba_d_state": 16,
    "mamba_d_conv": 4,
    "mamba_expand": 2,
    "mamba_chunk_size": 16,
}

# The Mamba (v1) mixer of the hybrids that take one (Jamba, Zamba): state 8, conv 4, d_inner = 2 * hidden.
_MAMBA_MIXER: dict[str, Any] = {"mamba_d_state": 8, "mamba_d_conv": 4, "mamba_expand": 2}

# Mamba (v1) sizes: d_inner = 2 * 64, state 8, a pure-torch selective scan.
_MAMBA1: dict[str, Any] = {
    "hidden_size": 64,
    "state_size": 8,
    "num_hidden_layers": 2,
    "expand": 2,
    "conv_kernel": 4,
    "use_mambapy": False,
}

# Sparse MoE of 4 experts, 2 per token, each 32 wide (the key names of Qwen-MoE style configs).
_EXPERTS: dict[str, Any] = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
# The same experts under DeepSeek-style key names.
_ROUTED_EXPERTS: dict[str, Any] = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}

# Multi-head latent attention (DeepSeek-V3 style): 4 heads, keys 8 + 8 wide, values 16.
_MLA: dict[str, Any] = {
    "num_key_value_heads": 4,
    "head_dim": 8,
    "q_lora_rank": 32,
    "kv_lora_rank": 16,
    "qk_rope_head_dim": 8,
    "qk_nope_head_dim": 8,
    "v_head_dim": 16,
}

# A sparse-attention indexer keeping 256 keys per query (every key of the tests' prompts), 8 heads of 16.
_INDEXER: dict[str, Any] = {"index_topk": 256, "index_n_heads": 8, "index_head_dim": 16}

# Gated delta-net (linear attention) heads: 2 key heads and 4 value heads, 16 wide each.
_GATED_DELTA: dict[str, Any] = {
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
}

# Inkling's hybrid layers: attention heads of 16 over all keys, and 4 sliding-window heads (window 8) beside them.
_INKLING_ATTENTION: dict[str, Any] = {
    "head_dim": 16,
    "swa_num_attention_heads": 4,
    "swa_num_key_value_heads": 2,
    "swa_head_dim": 16,
    "sliding_window_size": 8,
}


def merged(*parts: dict[str, Any], **overrides: Any) -> dict[str, Any]:
    """The config kwargs of `parts` merged in order, then `overrides`: a later key wins.

    Example:
        >>> merged(_ATTN, _MLA, num_hidden_layers=2)["num_key_value_heads"]
        4
    """
    out: dict[str, Any] = {}
    for part in parts:
        out.update(part)
    out.update(overrides)
    return out


#: The generation settings of every tiny model: no eos (generation never stops early), pad and bos ids, greedy.
_GREEDY: dict[str, Any] = {"eos_token_id": None, "pad_token_id": PAD_ID, "bos_token_id": BOS_ID, "do_sample": False}
#: Limits and sampling knobs `_make`'s models drop, so that only `max_new_tokens` bounds a generation.
_UNBOUNDED: dict[str, Any] = dict.fromkeys(("max_length", "min_new_tokens", "temperature", "top_p", "top_k"))


def _set(config: Any, values: dict[str, Any]) -> None:
    for key, value in values.items():
        setattr(config, key, value)


def _finalize(model: PreTrainedModel) -> PreTrainedModel:
    """Put ``model`` in eval/float32 mode and make greedy generation run to ``max_new_tokens``."""
    model = model.to(torch.float32).eval()  # type: ignore[arg-type]
    _set(model.generation_config, {**_GREEDY, **_UNBOUNDED})
    return model


def seeded(model_cls: Any, config: Any) -> Any:
    """``model_cls(config)`` built after ``torch.manual_seed(0)``, float32 and in eval mode, greedy to ``max_new_tokens``.

    For a test's own tiny model of a class `_make` does not build (its attention implementation is the
    config's): its generation config gets no eos, the pad and bos ids 0 and 1, and no sampling.

    Example:
        >>> import transformers
        >>> config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
        ...     num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)
        >>> seeded(transformers.LlamaForCausalLM, config).generation_config.do_sample
        False
    """
    torch.manual_seed(0)
    model = model_cls(config).float().eval()
    _set(model.generation_config, _GREEDY)
    return model


@functools.cache
def one_model(build: Callable[[], Any]) -> Any:
    """The model `build` makes, built once per session: the tests share each tiny model.

    Example:
        >>> one_model(object) is one_model(object)
        True
    """
    return build()


class ModelTable(dict[str, Callable[[], Any]]):
    """Tiny model builders by name, and the one model of each a session shares (`one`).

    Example:
        >>> table = ModelTable(plain=object)
        >>> table.one("plain") is table.one("plain")
        True
    """

    def one(self, name: str) -> Any:
        """The model `name` builds, built once per session."""
        return one_model(self[name])


def _make(config_cls: type[PreTrainedConfig], model_cls_name: str, **kwargs: object) -> PreTrainedModel:
    """Seed, build ``model_cls_name`` from ``config_cls(**_COMMON, **kwargs)`` and finalize it."""
    torch.manual_seed(0)
    config = config_cls(**{**_COMMON, **kwargs})
    model = transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
        config, attn_implementation=ATTN_IMPLEMENTATION, dtype=torch.float32
    )
    if type(model).__name__ != model_cls_name:
        raise TypeError(f"expected {model_cls_name}, AutoModelForCausalLM built {type(model).__name__}")
    return _finalize(model)


def lm(name: str, model: str | None = None, **kwargs: object) -> PreTrainedModel:
    """`_make` by name: transformers' ``{name}Config``, its causal LM class `model` (``{name}ForCausalLM`` unless given).

    Example:
        >>> lm("Llama", num_hidden_layers=1, **_ATTN).config.model_type
        'llama'
    """
    return _make(getattr(transformers, f"{name}Config"), model or f"{name}ForCausalLM", **kwargs)
