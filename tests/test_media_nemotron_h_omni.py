"""Nemotron-H Omni's images and audio clips (a generic-table row: ``"thw"`` images with ``(h, w)`` grids,
``"conv"`` clips) are served exactly.

Its text layers hold Mamba-2 states, so the hook prefills media prompts itself from suffix
embeddings (text embeddings with the suffix media's features over their placeholders). Every
request runs cold and through the store: equal tokens, logits within 1e-4, all media passed every
time as the processor would. Videos (on the image placeholder id, pruned by content) run cold, named.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import transformers
from conftest import LOGIT_TOL, Hits, generate, max_logit_diff
from packaging.version import Version
from tiny_vlms import _TEXT, _build, text

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia

IMG, VID, AUD, OPEN, CLOSE = 120, 121, 126, 110, 111
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Patch grids of pool seeds (seeds 1 and 13 alike): 4 patches per placeholder.
GRIDS = [(4, 6), (4, 6), (2, 4)]
#: Valid mel frames of a clip per pool seed, padded to 50: (n + 1) through three stride-2 convolutions.
FRAMES, PADDED, MEL_BINS = [50, 50, 30], 50, 16
AUDIO_COUNTS = {50: 7, 30: 4}
PATCH_DIM = 3 * 4 * 4


@functools.cache
def tiny_nemotron_h_omni() -> Any:
    """Nemotron-H Omni: a RADIO tower on 4x4-pixel patch rows, a 2x2 pixel shuffle; a one-layer Parakeet
    encoder (8x subsampling) on 16 mel bins; Nemotron-H text [Mamba-2, attention, Mamba-2, MLP]."""
    text_config = {
        **{k: v for k, v in _TEXT.items() if k != "num_hidden_layers"},
        "model_type": "nemotron_h",
        "head_dim": 16,
        "layers_block_type": ["linear_attention", "full_attention", "linear_attention", "mlp"],
        "ssm_state_size": 16,
        "mamba_num_heads": 4,
        "mamba_head_dim": 16,
        "n_groups": 2,
        "conv_kernel": 4,
        "expand": 1,
        "chunk_size": 8,
        "mlp_hidden_act": "relu2",
    }
    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "patch_size": 4,
        "image_size": 32,
        "max_img_size": 64,
        "num_cls_tokens": 1,
        "num_registers": 1,
        "summary_idxs": [0],
        "patch_dim": PATCH_DIM,
        "video_patch_dim": 2 * PATCH_DIM,
        "video_temporal_patch_size": 2,
    }
    config = transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config=text_config,
        vision_config=vision,
        audio_config={
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "intermediate_size": 64,
            "conv_kernel_size": 3,
            "subsampling_conv_channels": 8,
            "num_mel_bins": MEL_BINS,
            "projection_hidden_size": 64,
            "projection_bias": False,
            "dropout": 0.0,
            "layerdrop": 0.0,
            "activation_dropout": 0.0,
            "attention_dropout": 0.0,
        },
        vision_hidden_size=32,
        projector_hidden_size=64,
        image_token_id=IMG,
        video_token_id=VID,
        audio_token_id=AUD,
    )
    return _build(transformers.NemotronH_Omni_Reasoning_V3, config)


@dataclass(frozen=True)
class Image:
    seed: int
    grid: tuple[int, int]


@dataclass(frozen=True)
class Clip:
    seed: int
    frames: int


def image(seed: int) -> Image:
    return Image(seed, GRIDS[seed % 3])


def clip(seed: int) -> Clip:
    return Clip(seed, FRAMES[seed % 3])


def placeholders(medium: Image | Clip) -> torch.Tensor:
    if isinstance(medium, Clip):
        return torch.tensor([[OPEN, *[AUD] * AUDIO_COUNTS[medium.frames], CLOSE]])
    return torch.tensor([[OPEN, *[IMG] * (medium.grid[0] * medium.grid[1] // 4), CLOSE]])


def media_kwargs(media: list[Any]) -> dict[str, Any]:
    """What the processor hands `generate`: all images' patch rows, one ``(h, w)`` grid each; clips padded to
    50 frames with their masks."""
    out: dict[str, Any] = {}
    images = [m for m in media if isinstance(m, Image)]
    if images:
        rows = [
            torch.rand(i.grid[0] * i.grid[1], PATCH_DIM, generator=torch.Generator().manual_seed(i.seed))
            for i in images
        ]
        out.update(pixel_values=torch.cat(rows), image_grid_hw=torch.tensor([list(i.grid) for i in images]))
    clips = [m for m in media if isinstance(m, Clip)]
    if clips:
        features = torch.zeros(len(clips), PADDED, MEL_BINS)
        mask = torch.zeros(len(clips), PADDED, dtype=torch.long)
        for k, c in enumerate(clips):
            features[k, : c.frames] = torch.rand(c.frames, MEL_BINS, generator=torch.Generator().manual_seed(c.seed))
            mask[k, : c.frames] = 1
        out.update(input_features=features, input_features_mask=mask)
    return out


def check(ids: torch.Tensor, images: list[Any], store: PrefixCache, **extra: Any) -> Any:
    """Run `ids` cold and through `store`; assert equal tokens and logits within tolerance; return the cached run."""
    model = tiny_nemotron_h_omni()
    kwargs = {**media_kwargs(images), "suppress_tokens": SPECIAL_IDS, **extra}
    cold = generate(model, ids, NEW, **kwargs)
    warm = generate(model, ids, NEW, past_key_values=store, **kwargs)
    assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
    diff = max_logit_diff(cold, warm)
    assert diff < LOGIT_TOL, f"logits differ by {diff}"
    return warm


@pytest.fixture
def store() -> Iterator[PrefixCache]:
    cache = PrefixCache(tiny_nemotron_h_omni())
    yield cache
    cache.check_integrity()
    assert not cache.stats().fallbacks, cache.stats().fallbacks
    cache.detach()


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_nemotron_h_omni()), GenericMedia)


def test_the_tower_encodes_each_image_on_its_own() -> None:
    model = tiny_nemotron_h_omni()
    images = [image(1), image(2), image(0)]
    with torch.no_grad():
        together = model.get_image_features(**media_kwargs(images)).pooler_output
        for img, features in zip(images, together, strict=True):
            (alone,) = model.get_image_features(**media_kwargs([img])).pooler_output
            torch.testing.assert_close(alone, features, rtol=0, atol=1e-6)


@pytest.mark.parametrize("kinds", [(image, image), (image, clip), (clip, image)])
def test_second_medium_after_a_cached_turn(kinds: tuple[Any, Any], store: PrefixCache) -> None:
    """A turn adding an image or clip reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_medium, second_medium = kinds[0](1), kinds[1](2)
    first = torch.cat([text(5, 1), placeholders(first_medium), text(6, 2)], dim=1)
    answer = check(first, [first_medium], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_medium), text(3, 4)], dim=1)
    check(second, [first_medium, second_medium], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_medium, second_medium], store)
    assert hits.last() == second.shape[1] - 1


@pytest.mark.parametrize("build", [image, clip])
def test_changed_medium_reuses_nothing_past_its_first_placeholder(build: Any, store: PrefixCache) -> None:
    """Identical ids with another image or clip reuse at most the text and framing before its placeholders
    (once a snapshot was taken there)."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(build(1)), text(5, 2)], dim=1)
    check(ids, [build(1)], store)
    check(ids, [build(13)], store)
    assert hits.last() == 0
    check(ids, [build(25)], store)
    assert hits.last() == head.shape[1] + 1


def test_an_audio_tower_of_other_subsampling_runs_clips_cold() -> None:
    """The clips' counts assume the checkpoints' 8x subsampling: with another, calls with clips run cold."""
    model = tiny_nemotron_h_omni()
    adapter = media_adapter_for(model)
    assert adapter is not None
    ids = torch.cat([text(3, 1), placeholders(clip(1)), text(2, 2)], dim=1)[0].tolist()
    assert adapter.layout(ids, media_kwargs([clip(1)])) is not None
    model.config.audio_config.subsampling_factor = 4
    try:
        assert adapter.layout(ids, media_kwargs([clip(1)])) is None
        assert adapter.layout(ids[:3], media_kwargs([])) is not None  # text and images are unaffected
    finally:
        model.config.audio_config.subsampling_factor = 8


def test_only_suffix_images_reach_the_tower(store: PrefixCache) -> None:
    a, b, new = image(1), image(2), image(4)
    first = torch.cat([text(3, 1), placeholders(a), text(2, 6), placeholders(b), text(3, 2)], dim=1)
    check(first, [a, b], store)
    second = torch.cat([first, text(2, 4), placeholders(new), text(2, 5)], dim=1)
    seen: list[list[list[int]]] = []

    def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen.append(kwargs["image_grid_hw"].tolist())

    handle = tiny_nemotron_h_omni().vision_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        check(second, [a, b, new], store)
    finally:
        handle.remove()
    assert seen == [[list(a.grid), list(b.grid), list(new.grid)], [list(new.grid)]]


@pytest.mark.skipif(
    Version(transformers.__version__) < Version("5.24"),
    reason="transformers 5.23's Nemotron-H Omni cannot generate with videos at all: its forward concatenates the "
    "video features' one tensor as if it were a tuple (TypeError), with or without a store",
)
def test_videos_run_cold_named() -> None:
    """Videos share the image placeholder id (and may be pruned by content): calls with them run cold, named."""
    model = tiny_nemotron_h_omni()
    cache = PrefixCache(model)
    # One video's frames (the form both releases take): 2 frames of 8x8 pixels, one tubelet of 2x2 patches.
    frames = torch.rand(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    ids = torch.cat([text(4, 1), torch.tensor([[OPEN, IMG, CLOSE]]), text(3, 2)], dim=1)
    try:
        for _ in range(2):
            cold = generate(model, ids, NEW, pixel_values_videos=frames, suppress_tokens=SPECIAL_IDS)
            warm = generate(
                model, ids, NEW, pixel_values_videos=frames, past_key_values=cache, suppress_tokens=SPECIAL_IDS
            )
            assert torch.equal(cold.sequences, warm.sequences)
        assert cache.stats().fallbacks == {"media_inputs:pixel_values_videos": 2}
    finally:
        cache.detach()
