"""Random conversations of text and media through every tiny VLM family of the exactness tests:
every request equals its cold run, and reuses exactly what a reference model of the rules
predicts.

The reference keys each prompt position by its token, or by (medium, index in the medium) for
a placeholder; a request reuses the longest common prefix with any stored sequence (prompt plus
answer minus its last token), capped at all but the last prompt token and moved back to the
start of a medium it would cut. Media come from a pool of three per family, texts from a pool
of four tokens, so prompts share prefixes often, and the same placeholders often stand for
other content.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import pytest
import torch
from conftest import assert_same_as_cold
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache.testing.media.families import FAMILIES, NEW, SPECIAL_IDS, Family
from hf_prefix_cache.testing.media.harness import conversation_store, converse_checked, expected_reuse
from hf_prefix_cache.testing.tiny_vlm_parts import AUDIO_ID, IMAGE_ID

POOL_SIZE = 3
PLACEHOLDER_IDS = (IMAGE_ID, AUDIO_ID)

# A prompt piece: a few text tokens, or the index of a medium in the family's pool.
pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, POOL_SIZE - 1))
# A request: its new pieces, and whether it continues the previous answer (a chat turn).
requests = st.lists(st.tuples(st.lists(pieces, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=4)


class Prompt:
    """Token ids, the media in order (pool indexes), and the reference symbol of every position."""

    def __init__(self, family: Family, pool: list[Any]) -> None:
        self.family, self.pool = family, pool
        self.ids: list[int] = []
        self.media: list[int] = []
        self.symbols: list[Hashable] = []
        self.spans: list[tuple[int, int]] = []

    def add_text(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.symbols += tokens

    def add_medium(self, index: int) -> None:
        tokens = self.family.placeholders(self.pool[index])[0].tolist()
        # A medium spans its first placeholder to its last (a video's frames with the text between them).
        at = [i for i, t in enumerate(tokens) if t in PLACEHOLDER_IDS]
        first, last = at[0], at[-1] + 1
        self.spans.append((len(self.ids) + first, len(self.ids) + last))
        self.symbols += [("medium", index, i - first) if first <= i < last else t for i, t in enumerate(tokens)]
        self.ids += tokens
        self.media.append(index)

    def continued(self, answer: list[int]) -> Prompt:
        """This prompt followed by `answer` (the next chat turn starts so)."""
        out = Prompt(self.family, self.pool)
        out.ids, out.media, out.symbols, out.spans = (
            list(self.ids),
            list(self.media),
            list(self.symbols),
            list(self.spans),
        )
        out.add_text(answer)
        return out

    def kwargs(self) -> dict[str, Any]:
        if not self.media:
            return {}
        return self.family.kwargs(torch.tensor([self.ids]), [self.pool[i] for i in self.media])


@pytest.mark.parametrize("name", FAMILIES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(name: str, conversation: list[Any]) -> None:
    _converse(name, conversation, pressure=False)


@pytest.mark.parametrize("name", ["llava", "qwen2_vl", "gemma3", "llava_next"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_under_memory_pressure_reuse_stays_exact(name: str, conversation: list[Any]) -> None:
    """With room for about 40 tokens in memory and 60 on disk, entries are split, moved to disk,
    reloaded and dropped between requests: every request still equals its cold run, and never
    reuses more than the rules allow."""
    _converse(name, conversation, pressure=True)


def _converse(name: str, conversation: list[Any], pressure: bool) -> None:
    family = Family(name)
    pool = [family.image(seed) for seed in range(POOL_SIZE)]

    def run(ids: torch.Tensor, prompt: Prompt) -> Any:
        if prompt.media:
            return family.check(ids, [pool[i] for i in prompt.media], store)
        return assert_same_as_cold(family.model, ids, store, new=NEW, suppress_tokens=SPECIAL_IDS)

    with conversation_store(family.model, pressure=pressure) as store:
        converse_checked(store, conversation, lambda: Prompt(family, pool), run, expected_reuse, at_most=pressure)
