"""LFM2-VL (conv-state text layers, SigLIP 2 NaFlex tower) serves prompts with images exactly.

The hook prefills an LFM2-VL prompt itself, in chunks that end at snapshots, fed the input
embeddings the model would compute (text embeddings, the suffix's image features over its
placeholders); `generate` then feeds the last token and gets no media. Every request runs cold
and through the store: equal tokens, logits within 1e-4. A recurrent state restores only at a
snapshot (prompt end, answer end, divergence, every `snapshot_interval` tokens outside media),
so the random conversations check hit counts against a reference model of the keying rules
and of those snapshots.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, Hits, generate, max_logit_diff
from hypothesis import HealthCheck, given, settings

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.multimodal.generic_table import COLD_FAMILIES, GENERIC_FAMILIES
from hf_prefix_cache.testing.media.generic import NEW, GenericFamily, Medium, lfm2_vl_kwargs, lfm2_vl_medium
from hf_prefix_cache.testing.media.generic_ids import IMG, SPECIAL_IDS
from hf_prefix_cache.testing.media.generic_images import LFM2_ROW_LEN
from hf_prefix_cache.testing.media.harness import conversation_store, converse, expected_reuse, served
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.test_media_generic import POOL_SIZE, Prompt, check, requests


@pytest.fixture
def fam() -> GenericFamily:
    return GenericFamily("lfm2_vl")


@pytest.fixture
def store(fam: GenericFamily) -> Iterator[PrefixCache]:
    store = PrefixCache(fam.model)
    yield store
    store.check_integrity()
    assert not store.stats().fallbacks, store.stats().fallbacks
    store.detach()


def _features(model: Any, kwargs: dict[str, Any]) -> list[torch.Tensor]:
    with torch.no_grad():
        return list(model.get_image_features(**kwargs).pooler_output)


def test_lfm2_vl_is_served_by_the_generic_adapter(fam: GenericFamily) -> None:
    """LFM2-VL has a generic rule with suffix embeddings, and is no longer listed cold."""
    adapter = media_adapter_for(fam.model)
    assert isinstance(adapter, GenericMedia) and adapter.embeds_suffix
    assert "lfm2_vl" in GENERIC_FAMILIES and "lfm2_vl" not in COLD_FAMILIES
    assert adapter.handled == {"pixel_values", "pixel_attention_mask", "spatial_shapes"}


def test_the_tower_encodes_each_row_on_its_own(fam: GenericFamily) -> None:
    """A row's features depend neither on the other rows, nor on its padding's content or length, nor on the mask's dtype."""
    rows = [row for seed in (1, 2, 0) for row in lfm2_vl_medium(seed).rows]  # shapes 4x6, 4x4, 4x4, 2x4, 4x6
    batch = lfm2_vl_kwargs(rows)
    together = _features(fam.model, batch)
    as_bool = _features(fam.model, {**batch, "pixel_attention_mask": batch["pixel_attention_mask"].bool()})
    for a, b in zip(as_bool, together, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)  # keys ignore the mask's dtype
    for i, row in enumerate(rows):
        alone = _features(fam.model, lfm2_vl_kwargs([row]))[0]
        noisy = lfm2_vl_kwargs([row])
        n = row.shape[0] * row.shape[1]
        noisy["pixel_values"][0, n:] = torch.rand(LFM2_ROW_LEN - n, row.shape[-1]) * 9
        longer = {
            "pixel_values": torch.nn.functional.pad(batch["pixel_values"][i : i + 1], (0, 0, 0, 8), value=3.0),
            "pixel_attention_mask": torch.nn.functional.pad(batch["pixel_attention_mask"][i : i + 1], (0, 8)),
            "spatial_shapes": batch["spatial_shapes"][i : i + 1],
        }
        assert alone.shape == (n // 4, fam.model.config.text_config.hidden_size)
        for other in (together[i], _features(fam.model, noisy)[0], _features(fam.model, longer)[0]):
            torch.testing.assert_close(other, alone, rtol=0, atol=1e-6)


def test_second_image_in_the_suffix(fam: GenericFamily, store: PrefixCache) -> None:
    """A prompt adding a tiled image after a cached one reuses up to the first prompt's end and encodes only the new rows."""
    hits = Hits(store)
    m1, m2 = fam.medium(1), fam.medium(2)
    prefix = torch.cat([text(5, 1), fam.placeholders(m1), text(6, 2)], dim=1)
    check(fam, prefix, [m1], store)
    assert hits.last() == 0
    second = torch.cat([prefix, text(4, 3), fam.placeholders(m2), text(3, 4)], dim=1)
    check(fam, second, [m1, m2], store)
    assert hits.last() == prefix.shape[1] - 1  # the snapshot at the first prompt's end
    store.clear()
    check(fam, prefix, [m1], store)
    assert fam.encoded(second, [m1, m2], store) == len(m2.rows) == 3  # two tiles and the thumbnail
    assert fam.encoded(second, [m1, m2]) == len(m1.rows) + len(m2.rows)  # cold: every row


def test_changed_image_with_identical_tokens_stops_at_its_start(fam: GenericFamily) -> None:
    """Identical token ids with another first image reuse nothing past that image's first placeholder."""
    store = PrefixCache(fam.model, snapshot_interval=1)  # a snapshot wherever a restore may cut
    hits = Hits(store)
    try:
        m1, other, m2 = fam.medium(1), fam.medium(13), fam.medium(2)  # seeds 1 and 13: same shape, other content
        head = text(5, 1)
        ids = torch.cat([head, fam.placeholders(m1), text(6, 2), fam.placeholders(m2), text(3, 4)], dim=1)
        assert torch.equal(fam.placeholders(m1), fam.placeholders(other))
        check(fam, ids, [m1, m2], store)
        check(fam, ids, [other, m2], store)
        assert hits.last() == head.shape[1] + m1.spans[0][0]  # the image-start id before it is text
        check(fam, ids, [m1, m2], store)
        assert hits.last() == ids.shape[1] - 1
        assert not store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()


def test_changed_tile_reuses_the_tiles_before_it(fam: GenericFamily) -> None:
    """Tiles are items: a prompt whose image differs only in its thumbnail reuses up to the thumbnail."""
    with served(fam.model, snapshot_interval=1, clean=False) as store:
        hits = Hits(store)
        image = fam.medium(2)
        changed = Medium(image.kind, (*image.rows[:2], image.rows[2] + 0.5), image.tokens, image.spans)
        head = text(4, 1)
        ids = torch.cat([head, fam.placeholders(image), text(5, 2)], dim=1)
        check(fam, ids, [image], store)
        check(fam, ids, [changed], store)
        assert hits.last() == head.shape[1] + image.spans[2][0]
        assert fam.encoded(ids, [changed], store) == 0  # now an exact repeat
        assert not store.stats().fallbacks


def test_exact_repeat_encodes_nothing(fam: GenericFamily, store: PrefixCache) -> None:
    """Repeating a two-image prompt reuses all but the last token and runs no vision tower."""
    hits = Hits(store)
    m1, m2 = fam.medium(1), fam.medium(2)
    ids = torch.cat([text(3, 1), fam.placeholders(m1), text(2, 2), fam.placeholders(m2), text(4, 3)], dim=1)
    check(fam, ids, [m1, m2], store)
    check(fam, ids, [m1, m2], store)
    assert hits.last() == ids.shape[1] - 1
    assert fam.encoded(ids, [m1, m2], store) == 0


def test_follow_up_text_turn_runs_no_tower(fam: GenericFamily, store: PrefixCache) -> None:
    """A chat turn after a turn with images reuses the whole previous turn, images included, without the tower."""
    hits = Hits(store)
    m1, m2 = fam.medium(0), fam.medium(2)
    first = torch.cat([text(3, 1), fam.placeholders(m1), text(2, 2), fam.placeholders(m2), text(4, 3)], dim=1)
    out = check(fam, first, [m1, m2], store)
    follow = torch.cat([out.sequences, text(5, 4)], dim=1)
    check(fam, follow, [m1, m2], store)
    assert hits.last() == first.shape[1] + NEW - 1  # the snapshot at the answer's end
    third = torch.cat([follow, text(3, 5)], dim=1)
    assert fam.encoded(third, [m1, m2], store) == 0
    assert hits.last() == follow.shape[1] - 1


def test_unframed_rows_share_one_run(fam: GenericFamily) -> None:
    """Without the processor's framing ids an image's tile, tile and thumbnail placeholders form one run, cut by counts."""
    with served(fam.model, snapshot_interval=1, clean=False) as store:
        hits = Hits(store)
        tiled, single = lfm2_vl_medium(2, framed=False), lfm2_vl_medium(1, framed=False)
        assert tiled.tokens == (IMG,) * 10
        head = text(4, 1)
        ids = torch.cat([head, fam.placeholders(tiled), fam.placeholders(single), text(3, 2)], dim=1)
        check(fam, ids, [tiled, single], store)
        other = lfm2_vl_medium(4, framed=False)  # the same shape as `single`, other pixels
        check(fam, ids, [tiled, other], store)
        assert hits.last() == head.shape[1] + len(tiled.tokens)  # where the run's second image starts
        check(fam, ids, [tiled, single], store)
        assert hits.last() == ids.shape[1] - 1
        assert not store.stats().fallbacks


def test_padding_is_not_keyed_and_the_shape_is(fam: GenericFamily) -> None:
    """Noise in a row's padding, or more padding, keeps its key; the same patches declared as another h x w do not."""
    with served(fam.model, snapshot_interval=1, clean=False) as store:
        hits = Hits(store)
        image = fam.medium(2)  # two 4x4 tiles and a 2x4 thumbnail, each padded to 24 patches
        head = text(3, 1)
        ids = torch.cat([head, fam.placeholders(image), text(4, 2)], dim=1)
        kwargs = fam.kwargs([image])
        _check_kwargs(fam, ids, kwargs, store)
        noisy = kwargs["pixel_values"].clone()
        for i, n in enumerate((16, 16, 8)):
            noisy[i, n:] = torch.rand(LFM2_ROW_LEN - n, noisy.shape[-1]) * 9
        wide = {
            "pixel_values": torch.nn.functional.pad(noisy, (0, 0, 0, 8), value=3.0),
            "pixel_attention_mask": torch.nn.functional.pad(kwargs["pixel_attention_mask"], (0, 8)),
            "spatial_shapes": kwargs["spatial_shapes"],
        }
        _check_kwargs(fam, ids, wide, store)
        assert hits.last() == ids.shape[1] - 1
        shapes = kwargs["spatial_shapes"].clone()
        shapes[2] = shapes[2].flip(-1)  # the thumbnail as 4x2 patches: the same 2 placeholders, other positions
        _check_kwargs(fam, ids, {**kwargs, "spatial_shapes": shapes}, store)
        assert hits.last() == head.shape[1] + image.spans[2][0]
        assert not store.stats().fallbacks


def test_rows_the_rule_cannot_key_get_no_layout(fam: GenericFamily) -> None:
    """A mask that is not exactly the first h x w patches (or not integer), or a side of odd patches, is not keyed."""
    adapter = media_adapter_for(fam.model)
    assert adapter is not None
    image = fam.medium(0)
    tokens = fam.placeholders(image)[0].tolist()
    kwargs = fam.kwargs([image])
    assert adapter.layout(tokens, kwargs) is not None
    gap = kwargs["pixel_attention_mask"].clone()
    gap[0, 3] = 0
    assert adapter.layout(tokens, {**kwargs, "pixel_attention_mask": gap}) is None
    as_float = kwargs["pixel_attention_mask"].float()  # the model itself fails on it (it slices by its sums)
    assert adapter.layout(tokens, {**kwargs, "pixel_attention_mask": as_float}) is None
    as_bool = kwargs["pixel_attention_mask"].bool()  # the same features as the processor's int32 mask
    assert adapter.layout(tokens, {**kwargs, "pixel_attention_mask": as_bool}) == adapter.layout(tokens, kwargs)
    odd = lfm2_vl_kwargs([torch.rand(3, 8, image.rows[0].shape[-1])])  # 24 patches, 3x8: no whole 2x2 merges
    assert adapter.layout(tokens, odd) is None


@pytest.mark.parametrize("framed", [True, False])
def test_prompt_ending_on_a_placeholder_runs_cold(fam: GenericFamily, framed: bool) -> None:
    """`generate` would feed a last placeholder alone, without its image: such prompts run cold (`media_prompt_end`)."""
    image = lfm2_vl_medium(0, framed=framed)
    tokens = image.tokens[:-1] if framed else image.tokens  # drop the image-end id
    ids = torch.cat([text(3, 1), torch.tensor([tokens])], dim=1)
    with served(fam.model, clean=False) as store:
        for _ in range(2):
            _check_kwargs(fam, ids, fam.kwargs([image]), store)
        assert store.stats().fallbacks == {"media_prompt_end": 2}
        assert store.stats().hit_tokens == 0


def _check_kwargs(fam: GenericFamily, ids: torch.Tensor, kwargs: dict[str, Any], store: PrefixCache) -> Any:
    cold = generate(fam.model, ids, NEW, suppress_tokens=SPECIAL_IDS, **kwargs)
    warm = generate(fam.model, ids, NEW, past_key_values=store, suppress_tokens=SPECIAL_IDS, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences)
    assert max_logit_diff(cold, warm) < LOGIT_TOL
    return warm


# ------------------------------------------------------------------ random conversations

#: Small enough that interval snapshots fall inside images and are skipped there.
INTERVAL = 4


class _Stored:
    """A stored sequence's reference symbols and the positions its request snapshotted."""

    def __init__(self, symbols: list[Hashable], snapshots: set[int]) -> None:
        self.symbols, self.snapshots = symbols, snapshots


def _common(a: list[Hashable], b: list[Hashable]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _reuse_and_snapshots(prompt: Prompt, stored: list[_Stored]) -> tuple[int, set[int]]:
    """The hit the rules allow, and the prompt positions this request snapshots (`model/prefill.py`)."""
    n = len(prompt.ids)
    common = [_common(seq.symbols, prompt.symbols) for seq in stored]
    matched = max(common, default=0)
    cut = min(matched, n - 1)
    for start, end in prompt.spans:
        if start < cut < end:
            cut = start
    usable = [p for seq, c in zip(stored, common, strict=True) for p in seq.snapshots if p <= min(c, cut)]
    reuse = max(usable, default=0)
    target = n - 1
    if target <= reuse:
        return reuse, set()
    bounds = {target, *range((reuse // INTERVAL + 1) * INTERVAL, target, INTERVAL)}
    if reuse < matched < target:
        bounds.add(matched)
    inside = {b for b in bounds if any(a < b < e for a, e in prompt.spans)}
    return reuse, (bounds - inside) | {target}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_random_conversations_reuse_exactly_what_the_snapshots_allow(conversation: list[Any]) -> None:
    _converse(conversation, pressure=False)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=requests)
def test_under_memory_pressure_reuse_stays_exact(conversation: list[Any]) -> None:
    """With room for about 20 tokens and their snapshots in memory and 40 on disk, entries are split, moved to
    disk, reloaded and dropped: every request still equals its cold run and never reuses more than the rules allow."""
    _converse(conversation, pressure=True)


def _converse(conversation: list[Any], pressure: bool) -> None:
    fam = GenericFamily("lfm2_vl")
    pool = [fam.medium(seed) for seed in range(POOL_SIZE)]
    budget = None
    if pressure:
        # What 20 text tokens with their snapshots take, from one request through a roomy store.
        with served(fam.model, snapshot_interval=INTERVAL, clean=False) as sizing:
            generate(fam.model, torch.tensor([[4] * 20]), 1, past_key_values=sizing)
            budget = (sizing.stats().nbytes, 2 * sizing.stats().nbytes)
    stored: list[_Stored] = []

    def serve(prompt: Prompt) -> list[int]:
        ids = torch.tensor([prompt.ids])
        before = store.stats().hit_tokens
        expected, snapshots = _reuse_and_snapshots(prompt, stored)
        out = check(fam, ids, [pool[i] for i in prompt.media], store)
        reused = store.stats().hit_tokens - before
        if pressure:
            # Evictions change later snapshot points: only the attention-only rule bounds the hit.
            assert reused <= expected_reuse(prompt, [seq.symbols for seq in stored])
        else:
            assert reused == expected
        answer: list[int] = out.sequences[0, ids.shape[1] :].tolist()
        symbols = prompt.symbols + answer[:-1]
        stored.append(_Stored(symbols, snapshots | {len(symbols)}))
        return answer

    with conversation_store(fam.model, pressure=pressure, budget=budget, snapshot_interval=INTERVAL) as store:
        converse(conversation, lambda: Prompt(pool), serve)
