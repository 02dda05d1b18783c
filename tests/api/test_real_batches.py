"""Batches and several samples on the real SmolLM2-135M-Instruct, with its tokenizer and chat template.

Each call runs cold and through the store: equal outputs, and the reuse counted, so none of these
can pass with the store running cold. On CI the model must load; elsewhere they skip when it cannot.
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import LOGIT_TOL, Hits, max_logit_diff
from transformers import pipeline

from hf_prefix_cache.api.sample_text import HANDBOOK, QUESTIONS
from hf_prefix_cache.testing.compare import served

SYSTEM = {"role": "system", "content": HANDBOOK[:1500]}


def test_a_batched_pipeline_reuses_the_shared_system_prompt_in_every_row(smollm2: tuple[Any, Any]) -> None:
    """`pipeline(..., batch_size=2)` pads each batch; every row reuses the stored system prompt and answers as cold."""
    model, tokenizer = smollm2
    with served(model, clean=False) as store:
        generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
        chats = [[SYSTEM, {"role": "user", "content": q}] for q in QUESTIONS[:4]]
        cold = generator(chats, max_new_tokens=6, do_sample=False, batch_size=2)
        generator(chats[:1], max_new_tokens=1, do_sample=False, past_key_values=store)  # stores the system prompt
        system_len = len(tokenizer.apply_chat_template([SYSTEM], tokenize=True))
        hits = Hits(store)
        warm = generator(chats, max_new_tokens=6, do_sample=False, batch_size=2, past_key_values=store)
        assert warm == cold
        # Each of the 4 rows reuses most of the system prompt (a row loses only what its padding covers), and each
        # padded batch says its shorter row lost that (`batch_layout`), rather than losing it in silence.
        assert hits.last() > 4 * (system_len - 40)
        assert store.stats().fallbacks == {"batch_layout": 2}


def test_several_samples_of_one_prompt_reuse_it_and_are_each_stored(smollm2: tuple[Any, Any]) -> None:
    """`num_return_sequences=3` with sampling equals the cold call, reuses the stored prompt, and stores each answer."""
    model, tokenizer = smollm2
    with served(model, clean=False) as store:
        chat = [SYSTEM, {"role": "user", "content": QUESTIONS[0]}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids = ids["input_ids"]
        kwargs: dict[str, Any] = {
            "do_sample": True,
            "num_return_sequences": 3,
            "max_new_tokens": 6,
            "output_logits": True,
            "return_dict_in_generate": True,
        }
        model.generate(ids, max_new_tokens=1, do_sample=False, past_key_values=store)
        torch.manual_seed(0)
        cold = model.generate(ids, **kwargs)
        hits = Hits(store)
        torch.manual_seed(0)
        warm = model.generate(ids, past_key_values=store, **kwargs)
        assert torch.equal(cold.sequences, warm.sequences)
        assert max_logit_diff(cold, warm) < LOGIT_TOL
        assert hits.last() == ids.shape[1] - 1
        for row in warm.sequences:
            hits = Hits(store)
            model.generate(row[None], max_new_tokens=1, do_sample=False, past_key_values=store)
            assert hits.last() == row.shape[0] - 1  # the answer was stored, all but its last token
