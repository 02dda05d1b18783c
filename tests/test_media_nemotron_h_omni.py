"""Nemotron-H Omni's images (a generic-table ``"thw"`` row with ``(h, w)`` grids) are served exactly.

Its text layers hold Mamba-2 states, so the hook prefills media prompts itself from suffix
embeddings (text embeddings with the suffix images' features over their placeholders). Every
request runs cold and through the store: equal tokens, logits within 1e-4, all images passed
every time as the processor would. Videos (on the image placeholder id, pruned by content) and
audio clips run cold, named.
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

IMG, VID, OPEN, CLOSE = 120, 121, 110, 111
NEW = 4
SPECIAL_IDS = list(range(100, 128))
#: Patch grids of pool seeds (seeds 1 and 13 alike): 4 patches per placeholder.
GRIDS = [(4, 6), (4, 6), (2, 4)]
PATCH_DIM = 3 * 4 * 4


@functools.cache
def tiny_nemotron_h_omni() -> Any:
    """Nemotron-H Omni: a RADIO tower on 4x4-pixel patch rows, a 2x2 pixel shuffle; Nemotron-H text
    [Mamba-2, attention, Mamba-2, MLP]; no audio tower."""
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
        audio_config=None,
        vision_hidden_size=32,
        projector_hidden_size=64,
        image_token_id=IMG,
        video_token_id=VID,
        audio_token_id=126,
    )
    return _build(transformers.NemotronH_Omni_Reasoning_V3, config)


@dataclass(frozen=True)
class Image:
    seed: int
    grid: tuple[int, int]


def image(seed: int) -> Image:
    return Image(seed, GRIDS[seed % 3])


def placeholders(img: Image) -> torch.Tensor:
    return torch.tensor([[OPEN, *[IMG] * (img.grid[0] * img.grid[1] // 4), CLOSE]])


def media_kwargs(images: list[Image]) -> dict[str, Any]:
    """What the processor hands `generate`: all images' patch rows, one ``(h, w)`` grid each."""
    if not images:
        return {}
    rows = [
        torch.rand(i.grid[0] * i.grid[1], PATCH_DIM, generator=torch.Generator().manual_seed(i.seed)) for i in images
    ]
    return {"pixel_values": torch.cat(rows), "image_grid_hw": torch.tensor([list(i.grid) for i in images])}


def check(ids: torch.Tensor, images: list[Image], store: PrefixCache, **extra: Any) -> Any:
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


def test_second_image_after_a_cached_turn(store: PrefixCache) -> None:
    """A turn adding an image reuses the first turn whole, and its repeat all but the last token."""
    hits = Hits(store)
    first_image, second_image = image(1), image(2)
    first = torch.cat([text(5, 1), placeholders(first_image), text(6, 2)], dim=1)
    answer = check(first, [first_image], store).sequences
    second = torch.cat([answer, text(4, 3), placeholders(second_image), text(3, 4)], dim=1)
    check(second, [first_image, second_image], store)
    assert hits.last() == answer.shape[1] - 1
    check(second, [first_image, second_image], store)
    assert hits.last() == second.shape[1] - 1


def test_changed_image_reuses_nothing_past_its_first_placeholder(store: PrefixCache) -> None:
    """Identical ids with another image reuse at most the text and framing before its placeholders (once a
    snapshot was taken there)."""
    hits = Hits(store)
    head = text(4, 7)
    ids = torch.cat([head, placeholders(image(1)), text(5, 2)], dim=1)
    check(ids, [image(1)], store)
    check(ids, [image(13)], store)
    assert hits.last() == 0
    check(ids, [image(25)], store)
    assert hits.last() == head.shape[1] + 1


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
