"""Families served by the generic media adapter (`multimodal/generic.py`) equal cold runs and key media by content.

Every request runs cold and through the store: equal tokens, logits within 1e-4, all media
passed every time as a processor would. Random conversations (Hypothesis) check each request
against its cold run and against a reference model of the keying rules: a prompt position is
keyed by its token, or by (medium, row, index) inside a row's placeholder span; a request
reuses the longest common prefix with any stored sequence, capped at all but the last prompt
token and moved back to the start of a span it would cut. Deterministic tests pin a changed
medium, a medium re-sent, the suffix-only encoding and Pixtral's per-prompt padding.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from typing import Any

import pytest
import torch
import transformers
from conftest import LOGIT_TOL, Hits, assert_same_as_cold, generate, max_logit_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.multimodal.generic_table import COLD_FAMILIES
from hf_prefix_cache.multimodal.generic_table import GENERIC_FAMILIES as GENERIC_RULES
from hf_prefix_cache.testing.media.generic import NEW, PIXTRAL, GenericFamily, Medium
from hf_prefix_cache.testing.media.generic_ids import BREAK, IMG, SPECIAL_IDS
from hf_prefix_cache.testing.media.generic_images import pixtral_processor, tiny_llava_pixtral
from hf_prefix_cache.testing.media.generic_models import GENERIC_FAMILIES
from hf_prefix_cache.testing.media.harness import conversation_store, converse_checked, expected_reuse, served
from hf_prefix_cache.testing.tiny_vlm_media import pil_image, text
from media.conftest import family_fixture

POOL_SIZE = 3


def check(family: GenericFamily, ids: torch.Tensor, media: list[Medium], store: PrefixCache, **extra: Any) -> Any:
    """Run `ids` cold and through `store` (`assert_same_as_cold`); return the cached run."""
    kwargs = {**family.kwargs(media), "suppress_tokens": SPECIAL_IDS, **extra}
    return assert_same_as_cold(family.model, ids, store, NEW, cache_argument="past_key_values", **kwargs)


#: Families transformers itself cannot run on the installed release: even a cold `generate` raises.
UPSTREAM_BROKEN = (
    {
        "llama4": "transformers 5.24's Llama4ForConditionalGeneration.forward reads `image_outputs` from its "
        "language model's output, which has none: every generate raises, with or without a store"
    }
    if transformers.__version__.startswith("5.24.")
    else {}
)


def runnable(names: Iterable[str]) -> list[Any]:
    """`names` as parameters, those in `UPSTREAM_BROKEN` skipped with its reason."""
    return [
        pytest.param(n, marks=pytest.mark.skip(reason=UPSTREAM_BROKEN[n])) if n in UPSTREAM_BROKEN else n for n in names
    ]


family = family_fixture(GenericFamily, runnable(GENERIC_FAMILIES))


def test_generic_families_get_the_generic_adapter() -> None:
    for name in GENERIC_FAMILIES:
        adapter = media_adapter_for(GenericFamily(name).model)
        assert adapter is not None
        assert isinstance(adapter, GenericMedia) == (name != "smolvlm_video"), name


def test_second_medium_in_the_suffix(family: tuple[GenericFamily, PrefixCache]) -> None:
    """A prompt adding a second medium after a cached first reuses the first and encodes only the second."""
    fam, store = family
    hits = Hits(store)
    m1, m2 = fam.medium(1), fam.medium(2)
    prefix = torch.cat([text(5, 1), fam.placeholders(m1), text(6, 2)], dim=1)
    check(fam, prefix, [m1], store)
    second = torch.cat([prefix, text(4, 3), fam.placeholders(m2), text(3, 4)], dim=1)
    check(fam, second, [m1, m2], store)
    assert hits.last() == prefix.shape[1]
    store.clear()
    check(fam, prefix, [m1], store)
    alone = torch.cat([text(2, 5), fam.placeholders(m2), text(3, 4)], dim=1)
    assert fam.encoded(second, [m1, m2], store) == fam.encoded(alone, [m2]) > 0


def test_changed_first_medium_with_identical_tokens(family: tuple[GenericFamily, PrefixCache]) -> None:
    """Identical token ids with another first medium reuse nothing past that medium's first placeholder."""
    fam, store = family
    hits = Hits(store)
    m1, other, m2 = fam.medium(1), fam.medium(13), fam.medium(2)  # seeds 1 and 13: same shape, other content
    head = text(5, 1)
    ids = torch.cat([head, fam.placeholders(m1), text(6, 2), fam.placeholders(m2), text(3, 4)], dim=1)
    assert torch.equal(fam.placeholders(m1), fam.placeholders(other))
    check(fam, ids, [m1, m2], store)
    check(fam, ids, [other, m2], store)
    assert hits.last() == head.shape[1] + m1.spans[0][0]  # the framing before the first placeholder is text
    check(fam, ids, [m1, m2], store)
    assert hits.last() == ids.shape[1] - 1


def test_exact_repeat_encodes_nothing(family: tuple[GenericFamily, PrefixCache]) -> None:
    """Repeating a two-medium prompt reuses all but the last token and passes no media."""
    fam, store = family
    hits = Hits(store)
    m1, m2 = fam.medium(1), fam.medium(2)
    ids = torch.cat([text(3, 1), fam.placeholders(m1), text(2, 2), fam.placeholders(m2), text(4, 3)], dim=1)
    check(fam, ids, [m1, m2], store)
    check(fam, ids, [m1, m2], store)
    assert hits.last() == ids.shape[1] - 1
    assert fam.encoded(ids, [m1, m2], store) == 0


@pytest.mark.parametrize("name", PIXTRAL)
def test_pixtral_padding_per_prompt_keeps_an_image_key(name: str) -> None:
    """The real Pixtral processor pads turn 2's first image to its larger second one: the first still matches."""
    fam = GenericFamily(name)
    processor = pixtral_processor(spatial_merge_size=1 if name == "llava_pixtral" else 2)
    small, large = pil_image(0, 32, 16), pil_image(1, 48, 64)
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        one = processor(text="describe [IMG] please", images=[small], return_tensors="pt")
        two = processor(text="describe [IMG] please and compare [IMG]", images=[small, large], return_tensors="pt")
        assert one["pixel_values"].shape != two["pixel_values"].shape  # the same picture, padded per prompt
        _check_kwargs(
            fam, one["input_ids"], {"pixel_values": one["pixel_values"], "image_sizes": one["image_sizes"]}, store
        )
        _check_kwargs(
            fam, two["input_ids"], {"pixel_values": two["pixel_values"], "image_sizes": two["image_sizes"]}, store
        )
        shared = _common_prefix_len(one["input_ids"][0].tolist(), two["input_ids"][0].tolist())
        last_placeholder = max(i for i, t in enumerate(one["input_ids"][0].tolist()) if t == IMG)
        assert hits.last() == shared > last_placeholder
        assert not store.stats().fallbacks


@pytest.mark.parametrize("name", PIXTRAL)
def test_pixtral_padding_content_is_not_keyed_and_not_consumed(name: str) -> None:
    """Noise where a processor pads (past `image_sizes`) changes neither the key nor the answer."""
    fam = GenericFamily(name)
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        small, large = fam.medium(2), fam.medium(0)  # 3x2 and 2x3 placeholders: each padded in one dimension
        ids = torch.cat([text(3, 1), fam.placeholders(small), text(2, 2), fam.placeholders(large), text(4, 3)], dim=1)
        kwargs = fam.kwargs([small, large])
        _check_kwargs(fam, ids, kwargs, store)
        noisy = kwargs["pixel_values"].clone()
        height, width = kwargs["image_sizes"][0].tolist()
        assert width < noisy.shape[-1]
        noisy[0, :, :, width:] = torch.rand(noisy.shape[1], noisy.shape[2], noisy.shape[3] - width)
        _check_kwargs(fam, ids, {**kwargs, "pixel_values": noisy}, store)
        assert hits.last() == ids.shape[1] - 1


def test_pixtral_break_tokens_are_keyed_with_the_image() -> None:
    """The text inside an image's span (its row breaks) is hashed with it: other break ids, no reuse past its start."""
    fam = GenericFamily("mistral3")
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        image = fam.medium(0)
        head = text(3, 1)
        ids = torch.cat([head, fam.placeholders(image), text(4, 2)], dim=1)
        other = ids.clone()
        other[other == BREAK] = 7  # same image, same placeholder positions, another token between its rows
        check(fam, ids, [image], store)
        check(fam, other, [image], store)
        assert hits.last() == head.shape[1]


def test_pixtral_rows_that_do_not_match_the_sizes_run_cold() -> None:
    """A 3x2 grid of placeholders for a 2x3 image (same count, so transformers accepts it) is not keyed: cold."""
    fam = GenericFamily("mistral3")
    with served(fam.model, clean=False) as store:
        wide, tall = fam.medium(0), fam.medium(2)
        assert wide.tokens != tall.tokens and wide.tokens.count(IMG) == tall.tokens.count(IMG)
        ids = torch.cat([text(3, 1), fam.placeholders(tall), text(4, 2)], dim=1)
        check(fam, ids, [wide], store)
        assert store.stats().fallbacks == {"media_placeholders": 1}


def _common_prefix_len(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _check_kwargs(fam: GenericFamily, ids: torch.Tensor, kwargs: dict[str, Any], store: PrefixCache) -> Any:
    cold = generate(fam.model, ids, NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
    warm = generate(fam.model, ids, NEW, past_key_values=store, suppress_tokens=SPECIAL_IDS, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences)
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    return warm


def test_cold_families_have_no_generic_row() -> None:
    """The families `generic_table` names as cold (VipLLaVA, Ovis2) get no generic rule."""
    assert COLD_FAMILIES and not set(COLD_FAMILIES) & set(GENERIC_RULES)


def test_llava_with_pixtral_and_the_default_strategy_runs_cold() -> None:
    """With the "default" strategy LLaVA drops the first patch of all images together: not per item, no adapter."""
    assert media_adapter_for(tiny_llava_pixtral(strategy="default")) is None


def test_overridden_vision_setting_runs_cold() -> None:
    """A `generate` kwarg changing how media are encoded runs cold (items are keyed by content only)."""
    fam = GenericFamily("internvl")
    with served(fam.model, clean=False) as store:
        m1 = fam.medium(1)
        ids = torch.cat([text(3, 1), fam.placeholders(m1), text(4, 2)], dim=1)
        check(fam, ids, [m1], store, vision_feature_layer=-2)
        assert store.stats().fallbacks == {"vision_settings:vision_feature_layer": 1}


# ------------------------------------------------------------------ random conversations

# A prompt piece: a few text tokens, or the index of a medium in the family's pool.
pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, POOL_SIZE - 1))
# A request: its new pieces, and whether it continues the previous answer (a chat turn).
requests = st.lists(st.tuples(st.lists(pieces, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=4)


class Prompt:
    """Token ids, the media in order (pool indexes), every row's span, and the reference symbol of every position."""

    def __init__(self, pool: list[Medium]) -> None:
        self.pool = pool
        self.ids: list[int] = []
        self.media: list[int] = []
        self.symbols: list[Hashable] = []
        self.spans: list[tuple[int, int]] = []

    def add_text(self, tokens: list[int]) -> None:
        self.ids += tokens
        self.symbols += tokens

    def add_medium(self, index: int) -> None:
        medium, at = self.pool[index], len(self.ids)
        symbols: list[Hashable] = list(medium.tokens)
        for row, (start, end) in enumerate(medium.spans):
            symbols[start:end] = [("medium", index, row, i) for i in range(end - start)]
            self.spans.append((at + start, at + end))
        self.ids += medium.tokens
        self.symbols += symbols
        self.media.append(index)

    def continued(self, answer: list[int]) -> Prompt:
        out = Prompt(self.pool)
        out.ids, out.media, out.symbols, out.spans = (
            list(self.ids),
            list(self.media),
            list(self.symbols),
            list(self.spans),
        )
        out.add_text(answer)
        return out


#: Families whose own continuation of a prompt can differ from its prefill on random text, without a store:
#: Mistral Large 4's indexer keeps its top-k keys by scores that tie exactly on repeated tokens, and
#: transformers' choice among ties changes with the query count (README, `DynamicIndexedLayer`). A store runs
#: a request cold on such a tie (`indexer_tie`, tests/hooks/test_indexer_top_k.py), which these checks do not expect.
INDEXER_TIES = ("mistral_large4",)


def test_an_indexer_with_ties_differs_from_itself_without_a_store() -> None:
    """Why Mistral Large 4 sits out the random conversations: transformers' own continuation is not its prefill."""
    model = GenericFamily("mistral_large4").model
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.index_topk = 4  # fewer than the prompt's keys: the selection by score matters
    ids = torch.tensor(
        [[6, 4, 6, 6, 42, 84, 2, 54, 0, 4, 33, 29, 81, 51, 59, 4, 4, 4]]
    )  # found by the random conversations
    with torch.no_grad():
        full = model(ids).logits
        head = model(ids[:, :10], use_cache=True)
        rest = model(ids[:, 10:], past_key_values=head.past_key_values, position_ids=torch.arange(10, 18)[None])
    assert (rest.logits - full[:, 10:]).abs().max() > LOGIT_TOL


@pytest.mark.parametrize("name", runnable(n for n in GENERIC_FAMILIES if n not in INDEXER_TIES))
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(name: str, conversation: list[Any]) -> None:
    _converse(name, conversation, pressure=False)


@pytest.mark.parametrize("name", runnable(["mistral3", "llama4"]))
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_under_memory_pressure_reuse_stays_exact(name: str, conversation: list[Any]) -> None:
    """With room for about 40 tokens in memory and 60 on disk, entries are split (never inside a span, breaks
    included), moved to disk, reloaded and dropped: every request still equals its cold run and never
    reuses more than the rules allow."""
    _converse(name, conversation, pressure=True)


def _converse(name: str, conversation: list[Any], pressure: bool) -> None:
    fam = GenericFamily(name)
    pool = [fam.medium(seed) for seed in range(POOL_SIZE)]
    with conversation_store(fam.model, pressure=pressure) as store:
        converse_checked(
            store,
            conversation,
            lambda: Prompt(pool),
            lambda ids, prompt: check(fam, ids, [pool[i] for i in prompt.media], store),
            expected_reuse,
            at_most=pressure,
        )


@pytest.mark.parametrize("name", ["mistral3", "internvl"])
def test_media_not_in_one_tensor_are_not_keyed(name: str) -> None:
    """Rows passed as a list of tensors raise `UnhashableMediaError` (the hook then runs cold: `unhashable_media`)."""
    fam = GenericFamily(name)
    adapter = media_adapter_for(fam.model)
    assert adapter is not None
    m1 = fam.medium(1)
    kwargs = fam.kwargs([m1])
    kwargs["pixel_values"] = list(kwargs["pixel_values"])
    with pytest.raises(UnhashableMediaError):
        adapter.layout(fam.placeholders(m1)[0].tolist(), kwargs)


def test_placeholder_ids_are_the_families_media_ids() -> None:
    """`lookup`/`insert` (token ids only) refuse prompts holding a generic family's placeholders."""
    fam = GenericFamily("mistral3")
    adapter = media_adapter_for(fam.model)
    assert adapter is not None
    assert adapter.placeholder_ids() == (IMG,)
    assert adapter.manual_problem([4, IMG, 5]) == "media_placeholders"
