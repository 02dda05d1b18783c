"""The store works through a transformers text-generation pipeline, with a tokenizer built offline."""

from __future__ import annotations

from conftest import cached_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, pipeline

from hf_prefix_cache import PrefixCache


def _word_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {f"t{i}": i for i in range(128)}
    inner = Tokenizer(models.WordLevel(vocab, unk_token="t3"))
    inner.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=inner, unk_token="t3", pad_token="t0", bos_token="t1", eos_token="t2"
    )


def test_pipeline_passes_the_store_to_generate_and_hits() -> None:
    """A repeated pipeline call reuses all but the last prompt token and returns the cold text."""
    model = cached_model("qwen3")
    store = PrefixCache(model)
    try:
        tokenizer = _word_tokenizer()
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        text = " ".join(f"t{i}" for i in range(10, 60))
        prompt_len = len(tokenizer(text).input_ids)
        cold = generator(text, max_new_tokens=5, do_sample=False)
        first = generator(text, max_new_tokens=5, do_sample=False, past_key_values=store)
        second = generator(text, max_new_tokens=5, do_sample=False, past_key_values=store)
        assert cold == first == second
        assert store.stats().hit_tokens == prompt_len - 1
    finally:
        store.detach()
