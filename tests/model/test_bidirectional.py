"""BERT-style causal LMs attend both ways unless `config.is_decoder`: the store must run them cold then.

Without `is_decoder=True` a later token changes every earlier position's states, so a stored
prefix is never valid for a longer prompt (transformers warns about such a model but runs it).
With it, they are ordinary decoders and are served exactly.
"""

from __future__ import annotations

import inspect

import torch
import transformers
from transformers import BertConfig, BertLMHeadModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.profile import BIDIRECTIONAL_UNLESS_DECODER


def _bert(is_decoder: bool) -> BertLMHeadModel:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=96, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        is_decoder=is_decoder,
    )  # fmt: skip
    model = BertLMHeadModel(config).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _run(model: BertLMHeadModel, ids: torch.Tensor, store: PrefixCache | None) -> tuple[torch.Tensor, torch.Tensor]:
    kwargs = {"past_key_values": store} if store is not None else {}
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
        output_scores=True, return_dict_in_generate=True, **kwargs,
    )  # fmt: skip
    return out.sequences, torch.stack(out.scores)


def test_bidirectional_bert_runs_cold_with_its_reason() -> None:
    model = _bert(is_decoder=False)
    store = PrefixCache(model)
    try:
        ids = torch.randint(4, 96, (1, 20), generator=torch.Generator().manual_seed(1))
        longer = torch.cat([ids, torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(2))], 1)
        for prompt in (ids, longer):
            cold_seq, cold_scores = _run(model, prompt, None)
            seq, scores = _run(model, prompt, store)
            assert torch.equal(seq, cold_seq)
            assert torch.equal(scores, cold_scores)
        assert store.stats().hit_tokens == 0
        assert store.stats().fallbacks == {"bidirectional_attention": 2}
        assert store.stats().entries == 0
    finally:
        store.detach()


def test_bert_as_a_decoder_is_served_exactly() -> None:
    model = _bert(is_decoder=True)
    store = PrefixCache(model)
    try:
        ids = torch.randint(4, 96, (1, 20), generator=torch.Generator().manual_seed(1))
        _run(model, ids, store)
        longer = torch.cat([ids, torch.randint(4, 96, (1, 6), generator=torch.Generator().manual_seed(2))], 1)
        cold_seq, cold_scores = _run(model, longer, None)
        seq, scores = _run(model, longer, store)
        assert torch.equal(seq, cold_seq)
        torch.testing.assert_close(scores, cold_scores, atol=1e-4, rtol=0)
        assert store.stats().hit_tokens == 20
        assert store.stats().fallbacks == {}
    finally:
        store.detach()


def test_the_list_matches_transformers() -> None:
    """The causal-LM classes whose __init__ reads `is_decoder` are listed, and only those: the list cannot drift."""
    reading = set()
    for model_type, class_name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items():
        cls = getattr(transformers, class_name, None)
        if cls is not None and "is_decoder" in inspect.getsource(cls.__init__):
            reading.add(model_type)
    assert reading == BIDIRECTIONAL_UNLESS_DECODER
