"""LLaVA-OneVision and LLaVA-NeXT loose ends through the store equal cold runs and reuse what is the same.

Every request runs cold and through the store (`assert_same_as_cold`: equal tokens, logits
within 1e-4), passing all media every time as a processor would. Placeholder counts come from
the model's own features (or the real processor), never from the adapter under test. The tiny
OneVision model uses `vision_aspect_ratio="anyres_max_1"`, so large images take the model's
feature-shrinking path.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, generate
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.media.onevision import (
    NEW,
    SIZES,
    SPECIAL_IDS,
    OneVision,
    onevision_processor,
    tiny_onevision,
)
from hf_prefix_cache.testing.reference import longest_prefix, span_cut
from hf_prefix_cache.testing.tiny_processors import llava_next_processor
from hf_prefix_cache.testing.tiny_vlm_media import llava_next_tokens, pil_image, run, text, video_frames
from hf_prefix_cache.testing.tiny_vlm_parts import IMAGE_ID, VIDEO_ID
from hf_prefix_cache.testing.tiny_vlms import cached_vlm
from media.conftest import family_fixture


class Tower:
    """Counts the images (patches) or frames a model's vision tower encodes."""

    def __init__(self, model: Any) -> None:
        self.seen: list[int] = []
        self._handle = model.model.vision_tower.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
        first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
        self.seen.append(int(first.shape[0]))

    def __enter__(self) -> Tower:
        return self

    def __exit__(self, *exc: object) -> None:
        self._handle.remove()


def encoded(model: Any, ids: torch.Tensor, store: PrefixCache, **kwargs: Any) -> int:
    """Run through `store` only; return how many patches or frames the vision tower saw."""
    with Tower(model) as tower:
        generate(model, ids, NEW, past_key_values=store, **kwargs)
    return sum(tower.seen)


onevision = family_fixture(OneVision, ["tiled", "single"])


# --------------------------------------------------------------------------- placeholder counts


@pytest.mark.parametrize("name", ["llava_next", "llava_next_video", "onevision_tiled", "onevision_single"])
def test_adapter_counts_equal_the_models_feature_lengths(name: str) -> None:
    """Per-image placeholder counts computed from sizes equal the lengths of the model's packed features."""
    model = tiny_onevision() if name.startswith("onevision") else cached_vlm(name)
    adapter = media_adapter_for(model)
    assert adapter is not None
    sizes = [(h, w) for h in (1, 7, 30, 33, 64, 200) for w in (2, 31, 32, 64, 97, 300)]
    image_sizes = torch.tensor(sizes)
    kwargs: dict[str, Any] = {"image_sizes": image_sizes}
    if name == "onevision_single":
        kwargs["batch_num_images"] = torch.tensor([len(sizes)])
    elif name.startswith("onevision"):
        kwargs["batch_num_images"] = torch.ones(len(sizes), dtype=torch.long)
    patches = adapter._num_patches(image_sizes, kwargs)
    pixels = torch.randn(len(sizes), max(patches), 3, 32, 32)
    with torch.no_grad():
        extra = {"batch_num_images": kwargs["batch_num_images"]} if "batch_num_images" in kwargs else {}
        features = model.model.get_image_features(pixels, image_sizes, **extra).pooler_output
    actual = [int(f.shape[0]) for f in features]
    assert adapter._num_tokens([IMAGE_ID] * sum(actual), image_sizes, kwargs) == actual
    if name == "onevision_tiled":
        # The shrink path ran: a 64x64 image's 8x8 grid map became 4x4 (16 base + 4 rows of 4 + newline).
        assert actual[sizes.index((64, 64))] == 16 + 4 * 5


# --------------------------------------------------------------------------- OneVision scenarios


def test_onevision_second_image_in_the_suffix(onevision: tuple[OneVision, PrefixCache]) -> None:
    """A second image after a cached first one: the first is reused, only the second is encoded."""
    fam, store = onevision
    hits = Hits(store)
    img1, img2 = fam.image(1), fam.image(2)
    # In single-patch mode the first prompt must already hold two images for the first one's mode to stay.
    first = [img1] if fam.mode == "tiled" else [img1, fam.image(3)]
    prefix = torch.cat(
        [text(5, 1), *[torch.cat([fam.placeholders(first, i), text(3, 2 + i)], 1) for i in range(len(first))]], 1
    )
    fam.check(prefix, first, store)
    both = [*first, img2]
    second = torch.cat([prefix, run(99, 1), text(4, 3), fam.placeholders(both, len(first)), text(3, 4)], dim=1)
    fam.check(second, both, store)
    assert hits.last() == prefix.shape[1]
    store.clear()
    fam.check(prefix, first, store)
    assert encoded(fam.model, second, store, **fam.kwargs(both)) == fam.num_patches([img2])


def test_onevision_changed_first_image_with_identical_tokens(onevision: tuple[OneVision, PrefixCache]) -> None:
    """Identical token ids with another first image (same size, other pixels) reuse nothing past its start."""
    fam, store = onevision
    hits = Hits(store)
    img1, other, img2 = fam.image(1), fam.image(1 + len(SIZES)), fam.image(2)
    head = text(5, 1)
    images = [img1, img2]
    ids = torch.cat([head, fam.placeholders(images, 0), text(6, 2), fam.placeholders(images, 1), text(3, 4)], dim=1)
    assert torch.equal(fam.placeholders(images, 0), fam.placeholders([other, img2], 0))
    fam.check(ids, images, store)
    fam.check(ids, [other, img2], store)
    assert hits.last() == head.shape[1]
    fam.check(ids, images, store)
    assert hits.last() == ids.shape[1] - 1


def test_onevision_multi_turn_chat_with_a_new_image_later(onevision: tuple[OneVision, PrefixCache]) -> None:
    """Three turns, a new image in turn 2: each turn reuses the previous prompt and answer."""
    fam, store = onevision
    hits = Hits(store)
    # Single-patch mode needs two images from turn 1 on, or turn 2 would change the first image's mode.
    first = [fam.image(1)] if fam.mode == "tiled" else [fam.image(1), fam.image(4)]
    turn = torch.cat([text(4, 10), *[fam.placeholders(first, i) for i in range(len(first))], text(5, 11)], dim=1)
    out = fam.check(turn, first, store)
    assert hits.last() == 0
    previous = out.sequences.shape[1]
    images = [*first, fam.image(2)]
    turn = torch.cat([out.sequences, text(3, 12), fam.placeholders(images, len(first)), text(4, 13)], dim=1)
    out = fam.check(turn, images, store)
    assert hits.last() == previous - 1
    previous = out.sequences.shape[1]
    turn = torch.cat([out.sequences, text(6, 14)], dim=1)
    fam.check(turn, images, store)
    assert hits.last() == previous - 1


def test_onevision_exact_repeat_skips_the_vision_tower(onevision: tuple[OneVision, PrefixCache]) -> None:
    """Repeating a two-image prompt reuses all but the last token and never runs the vision tower."""
    fam, store = onevision
    hits = Hits(store)
    images = [fam.image(1), fam.image(2)]
    ids = torch.cat([text(3, 1), fam.placeholders(images, 0), text(2, 2), fam.placeholders(images, 1), text(4, 3)], 1)
    fam.check(ids, images, store)
    fam.check(ids, images, store)
    assert hits.last() == ids.shape[1] - 1
    assert encoded(fam.model, ids, store, **fam.kwargs(images)) == 0


def test_onevision_prompt_ending_in_an_image_never_cuts_inside_it(onevision: tuple[OneVision, PrefixCache]) -> None:
    """When the token kept for logits is a placeholder, reuse stops at that image's start."""
    fam, store = onevision
    hits = Hits(store)
    images = [fam.image(1), fam.image(2)]
    head = torch.cat([text(3, 1), fam.placeholders(images, 0), text(2, 2)], dim=1)
    ids = torch.cat([head, fam.placeholders(images, 1)], dim=1)
    fam.check(ids, images, store)
    fam.check(ids, images, store)
    assert hits.last() == head.shape[1]


def test_onevision_image_cached_then_video_in_the_suffix() -> None:
    """A video after a cached image is the only medium encoded; another video of the same length reuses up to it."""
    fam = OneVision("tiled")
    with served(fam.model, clean=False) as store:
        hits = Hits(store)
        image = fam.image(1)
        head = torch.cat([text(4, 1), fam.placeholders([image], 0), text(3, 2)], dim=1)
        fam.check(head, [image], store)
        with torch.no_grad():
            n_video = fam.model.model.get_video_features(video_frames(1)[None]).pooler_output.shape[1]
        assert n_video == 2 * 4 + 1  # two frames pooled to 2x2, one newline
        ids = torch.cat([head, run(99, 1), run(VIDEO_ID, n_video), text(3, 3)], dim=1)
        for seed, expected in ((1, head.shape[1]), (2, head.shape[1] + 1), (2, ids.shape[1] - 1)):
            fam.check(ids, [image], store, pixel_values_videos=video_frames(seed)[None])
            assert hits.last() == expected
        store.clear()
        fam.check(head, [image], store)
        kwargs = {**fam.kwargs([image]), "pixel_values_videos": video_frames(1)[None]}
        assert encoded(fam.model, ids, store, **kwargs) == 2  # the video's two frames, not the image's patches
        assert not store.stats().fallbacks


def test_onevision_image_changing_mode_is_not_reused() -> None:
    """One image (tiled) in turn 1, then two images (single-patch, as a chat template sends them): reuse stops at the first image."""
    tiled, single = OneVision("tiled"), OneVision("single")
    with served(tiled.model, clean=False) as store:
        hits = Hits(store)
        img1, img2 = tiled.image(1), tiled.image(2)
        head, after = text(4, 1), text(3, 2)
        out = tiled.check(torch.cat([head, tiled.placeholders([img1], 0), after], dim=1), [img1], store)
        answer = out.sequences[:, -NEW:]
        both = [img1, img2]
        parts = [
            head,
            single.placeholders(both, 0),
            after,
            answer,
            text(2, 3),
            single.placeholders(both, 1),
            text(3, 4),
        ]
        turn = torch.cat(parts, dim=1)
        single.check(turn, both, store)
        assert hits.last() == head.shape[1]
        assert not store.stats().fallbacks


def test_onevision_modes_never_share_a_key() -> None:
    """The same pixels and size keyed tiled and single-patch give different item hashes."""
    model = tiny_onevision()
    adapter = media_adapter_for(model)
    assert adapter is not None
    pixels = torch.rand(2, 5, 3, 32, 32)
    sizes = torch.tensor([[30, 60], [30, 60]])
    digests = []
    for counts in ([1, 1], [2]):
        kwargs = {"pixel_values": pixels, "image_sizes": sizes, "batch_num_images": torch.tensor(counts)}
        n = 16 + 1 if counts == [2] else adapter._num_tokens([], sizes, kwargs)[0]
        layout = adapter.layout([5, *[IMAGE_ID] * (2 * n), 6], kwargs)
        assert layout is not None and len(layout.items) == 2
        digests.append(layout.items[0].digest)
    assert digests[0] != digests[1]


def test_onevision_three_turn_chat_through_the_processor() -> None:
    """Through `apply_chat_template`: turn 2's two images switch to single-patch mode (reuse stops at the first), turn 3 reuses turn 2."""
    model, processor = tiny_onevision(), onevision_processor()
    store = PrefixCache(model)
    turns: list[list[dict[str, Any]]] = [
        [{"type": "image", "image": pil_image(1, 40, 50)}, {"type": "text", "text": "what is in the image"}],
        [{"type": "image", "image": pil_image(2, 32, 24)}, {"type": "text", "text": "and now compare both pictures"}],
        [{"type": "text", "text": "tell me more about the colours"}],
    ]
    messages: list[dict[str, Any]] = []
    hits = Hits(store)
    previous_prompt_len = 0
    try:
        for i, content in enumerate(turns):
            messages.append({"role": "user", "content": content})
            inputs = dict(
                processor.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
                )
            )
            ids = inputs.pop("input_ids")
            out = assert_same_as_cold(model, ids, store, new=6, suppress_tokens=SPECIAL_IDS, **inputs)
            first_image = int((ids[0] == IMAGE_ID).nonzero()[0])
            hit = hits.last()
            if i == 0:
                assert hit == 0
            elif i == 1:
                assert inputs["batch_num_images"].tolist() == [2]
                assert hit == first_image  # the first image is now encoded as one patch: other states
            else:
                assert hit >= previous_prompt_len
            previous_prompt_len = ids.shape[1]
            answer = processor.tokenizer.decode(out.sequences[0, ids.shape[1] :], skip_special_tokens=True)
            messages.append({"role": "assistant", "content": answer})
        assert not store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()


# --------------------------------------------------------------------------- LLaVA-NeXT loose ends


def _next_tokens(images: list[Any]) -> list[int]:
    kw = llava_next_processor()(images, return_tensors="pt")
    return llava_next_tokens(cached_vlm("llava_next"), kw["pixel_values"], kw["image_sizes"])


def _next_check(ids: torch.Tensor, kwargs: dict[str, Any], store: PrefixCache) -> Any:
    return assert_same_as_cold(cached_vlm("llava_next"), ids, store, new=NEW, suppress_tokens=SPECIAL_IDS, **kwargs)


def test_llava_next_adjacent_images_in_one_placeholder_run() -> None:
    """Three LLaVA-NeXT images of different sizes with nothing between them are split by their own counts."""
    model = cached_vlm("llava_next")
    with served(model, clean=False) as store:
        hits = Hits(store)
        images = [pil_image(1, 30, 60), pil_image(2, 50, 40), pil_image(3, 64, 20)]
        counts = _next_tokens(images)
        assert len(set(counts)) == 3
        head = text(3, 1)
        ids = torch.cat([head, run(IMAGE_ID, sum(counts)), text(2, 2)], dim=1)
        kwargs = dict(llava_next_processor()(images, return_tensors="pt"))
        _next_check(ids, kwargs, store)
        assert hits.last() == 0
        # Another middle picture of the same size: reuse ends exactly where the second image starts.
        changed = dict(llava_next_processor()([images[0], pil_image(7, 50, 40), images[2]], return_tensors="pt"))
        _next_check(ids, changed, store)
        assert hits.last() == head.shape[1] + counts[0]
        _next_check(ids, kwargs, store)
        assert hits.last() == ids.shape[1] - 1
        assert encoded(model, ids, store, **kwargs) == 0
        assert not store.stats().fallbacks


def _flatten(kwargs: dict[str, Any]) -> dict[str, Any]:
    """The processor's padded `[images, max_patches, C, H, W]` as `[total_patches, C, H, W]` valid patches."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    config = cached_vlm("llava_next").config
    counts = [
        image_size_to_num_patches(size, config.image_grid_pinpoints, config.vision_config.image_size)
        for size in kwargs["image_sizes"]
    ]
    pixels = torch.cat([kwargs["pixel_values"][i, :n] for i, n in enumerate(counts)])
    return {**kwargs, "pixel_values": pixels}


def test_llava_next_flattened_pixel_values() -> None:
    """`pixel_values` as `[total_patches, C, H, W]`: the second image alone is encoded, and it keys like the padded form."""
    model = cached_vlm("llava_next")
    with served(model, clean=False) as store:
        hits = Hits(store)
        img1, img2 = pil_image(1, 30, 60), pil_image(2, 64, 20)
        n1, n2 = _next_tokens([img1, img2])
        prefix = torch.cat([text(5, 1), run(IMAGE_ID, n1), text(4, 2)], dim=1)
        one = _flatten(dict(llava_next_processor()([img1], return_tensors="pt")))
        assert one["pixel_values"].dim() == 4
        _next_check(prefix, one, store)
        ids = torch.cat([prefix, text(3, 3), run(IMAGE_ID, n2), text(3, 4)], dim=1)
        padded = dict(llava_next_processor()([img1, img2], return_tensors="pt"))
        flat = _flatten(padded)
        _next_check(ids, flat, store)
        assert hits.last() == prefix.shape[1]
        # The padded form of the same prompt restores everything the flattened one stored, and vice versa.
        _next_check(ids, padded, store)
        assert hits.last() == ids.shape[1] - 1
        store.clear()
        _next_check(prefix, one, store)
        expected = flat["pixel_values"].shape[0] - one["pixel_values"].shape[0]
        assert encoded(model, ids, store, **flat) == expected  # only the second image's patches
        assert not store.stats().fallbacks


# --------------------------------------------------------------------------- random conversations

_pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, 2))
_requests = st.lists(st.tuples(st.lists(_pieces, min_size=1, max_size=3), st.booleans()), min_size=1, max_size=4)


@pytest.mark.parametrize("mode", ["tiled", "single"])
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(mode: str, conversation: list[Any]) -> None:
    """Random text-and-image chats equal cold runs and reuse exactly the longest stored prefix.

    The reference keys an image by its picture and its mode: always tiled for a flat image list;
    for a nested one (what `apply_chat_template` sends) tiled only while it is the prompt's only
    image. Each prompt is rebuilt from its pieces, since a second image changes the first one's
    placeholders in the nested form.
    """
    fam = OneVision(mode)
    pool = [fam.image(seed) for seed in range(3)]
    store = PrefixCache(fam.model)
    stored: list[list[Any]] = []
    history: list[tuple[str, Any]] = []
    try:
        for new_pieces, continues in conversation:
            if not continues:
                history = []
            history += [("image", p) if isinstance(p, int) else ("text", p) for p in new_pieces]
            images = [pool[i] for kind, i in history if kind == "image"]
            tiled = mode == "tiled" or len(images) == 1
            ids: list[int] = []
            symbols: list[Any] = []
            spans: list[tuple[int, int]] = []
            k = 0
            for kind, value in history:
                if kind == "image":
                    n = fam.placeholders(images, k).shape[1]
                    spans.append((len(ids), len(ids) + n))
                    ids += [IMAGE_ID] * n
                    symbols += [("image", value, tiled, j) for j in range(n)]
                    k += 1
                else:
                    ids += value
                    symbols += value
            cut = span_cut(longest_prefix(stored, symbols), len(ids), spans)
            prompt = torch.tensor([ids])
            before = store.stats().hit_tokens
            if images:
                out = fam.check(prompt, images, store)
            else:
                out = assert_same_as_cold(fam.model, prompt, store, new=NEW, suppress_tokens=SPECIAL_IDS)
            assert store.stats().hit_tokens - before == cut
            answer = out.sequences[0, len(ids) :].tolist()
            stored.append(symbols + answer[:-1])
            history.append(("text", answer))
        assert not store.stats().fallbacks, store.stats().fallbacks
        store.check_integrity()
    finally:
        store.detach()
