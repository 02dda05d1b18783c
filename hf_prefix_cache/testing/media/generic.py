"""The media of the families `GenericMedia` serves, built per family by `GenericFamily` for the generic media tests.

Each family has a tiny random-weight model built from its config classes (float32, eager, seed 0;
`generic_models` names the builders of `generic_images`, `generic_tiles` and `generic_audio`)
and, per pool seed, one medium: its rows (one per media item the adapter keys: an image, a
tile, a video, an audio chunk), its placeholder tokens with the family's framing ids, and the
span of every row's placeholders within them. Framing ids are 110-119, placeholders 120-126;
generated answers never contain ids above 99 (`SPECIAL_IDS` are suppressed).

* ``mistral3`` / ``lighton_ocr`` / ``llava_pixtral``: Pixtral tower (8x8 patches), images of
  several sizes padded per prompt to the largest, `image_sizes` their valid size; ``[IMG]`` rows
  split by ``[IMG_BREAK]``, ended by ``[IMG_END]`` (all but LLaVA merge 2x2 patches per placeholder).
* ``video_llava``: 16 placeholders per image, 17 per video frame (2 frames), no framing.
* ``deepseek_vl`` / ``janus`` / ``vipllava`` / ``chameleon`` / ``step3p7``: 16 placeholders per image, no framing;
  ``deepseek_vl_hybrid`` the same, each image with a 64x64 high-resolution version (a second row).
* ``voxtral``: audio chunks of 40 mel frames, 5 placeholders each, after a begin-audio id.
* ``fuyu``: Fuyu, 2x3 or 3x2 patches of 4x4 pixels, each row of placeholders ended by an
  image-newline id; every patch is an item (one placeholder, embedded on its own).
* ``omniasr`` (transformers 5.24 on): clips of raw samples padded to 100 with their mask, 100
  or 60 valid samples (9 or 5 placeholders), framed by begin/end-audio ids.
* ``glmasr``: clips of 16 mel bins padded to 40 frames with their mask, 40 or 24 valid frames
  (5 or 3 placeholders), framed by begin/end-audio ids.
* ``internvl`` / ``qianfan_ocr`` / ``cohere2_vision`` / ``got_ocr2`` / ``pp_chart2table`` / ``aria`` /
  ``aya_vision`` / ``llama4``: one or two tiles (GOT-OCR 2 and PP-Chart2Table: 64x64 images) of 4 placeholders each, framed by begin/end ids
  (Aya Vision and Llama 4 as their processors frame tiles); Aria's crops come with a pixel mask.
* ``lfm2_vl``: LFM2-VL (conv + attention text layers; kept out of `GENERIC_FAMILIES`, whose hit
  counts assume attention-only models: `tests/media/test_media_lfm2_vl.py` tests it): a SigLIP 2
  NaFlex tower on 4x4-pixel patches, rows of patches padded to 24 as its processor pads them,
  2x2 patches per placeholder; one tile of 4x6 patches (6 placeholders), or two 4x4 tiles and a
  2x4 thumbnail (4 + 4 + 2), framed by image start/end, tile and thumbnail ids as its processor does.
* ``smolvlm_video``: SmolVLM (Idefics3's adapter) fed one video per prompt as its processors
  do: frames as rows of `pixel_values` with their `pixel_attention_mask`, each frame after its
  timestamp text and framed like an image. (Several videos of one prompt are padded to one
  frame count; that adapter runs such prompts cold.)
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Any

import torch

from hf_prefix_cache.testing.compare import generate
from hf_prefix_cache.testing.media import registry
from hf_prefix_cache.testing.media.generic_ids import AUD, BREAK, END, IMG, SPECIAL_IDS, VID
from hf_prefix_cache.testing.media.generic_images import LFM2_PATCH, LFM2_ROW_LEN
from hf_prefix_cache.testing.media.generic_models import cached_generic
from hf_prefix_cache.testing.tiny_vlm_parts import FAKE_IMAGE_ID

NEW = 5

#: The Pixtral-tower families: images padded per prompt, `image_sizes` their valid size.
PIXTRAL = ("mistral3", "llava_pixtral", "lighton_ocr", "mistral_large4")
#: One placeholder run per image, no framing (LLaVA-like): 16 per 32x32 image.
PLAIN = ("deepseek_vl", "janus", "vipllava", "deepseek_vl_hybrid", "chameleon", "step3p7")
#: Tiles of 4 placeholders, framed by begin/end ids (GOT-OCR 2: one 64x64 image per tile).
FRAMED_TILES = ("internvl", "qianfan_ocr", "cohere2_vision", "got_ocr2", "pp_chart2table", "aria")
#: Families whose image rows come with a high-resolution version of each image (64x64).
HIGH_RES = ("deepseek_vl_hybrid",)


def _rand(seed: int, *shape: int) -> torch.Tensor:
    return torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 2 - 1


#: The families whose clips are one padded row each: its rows (1 of raw samples, 16 of mel bins), padded length,
#: valid length per pool shape, and placeholders per valid length.
_PADDED_CLIPS: dict[str, tuple[int, int, list[int], dict[int, int]]] = {
    "omniasr": (1, 100, [100, 100, 60], {100: 9, 60: 5}),
    "glmasr": (16, 40, [40, 40, 24], {40: 5, 24: 3}),
}


@dataclass(frozen=True)
class Medium:
    """One medium: its kind, its rows (one per keyed item), its placeholder tokens and each row's span in them."""

    kind: str
    rows: tuple[torch.Tensor, ...]
    tokens: tuple[int, ...]
    spans: tuple[tuple[int, int], ...]


def _grid_tokens(rows: int, cols: int) -> tuple[list[int], tuple[int, int]]:
    """Pixtral placeholders: `rows` runs of `cols` [IMG], [IMG_BREAK] between, [IMG_END] last; span of the item."""
    tokens: list[int] = []
    for _ in range(rows):
        tokens += [IMG] * cols + [BREAK]
    tokens[-1] = END
    return tokens, (0, len(tokens) - 1)


class GenericFamily:
    """Builds one family's media, their placeholders and a prompt's media kwargs."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.model = cached_generic(name)

    def medium(self, seed: int) -> Medium:
        """Pool medium `seed`: sizes, tile or chunk counts and kinds vary with the seed (seeds 1 and 13 agree)."""
        name, shape = self.name, seed % 3
        if name in PIXTRAL:
            stride = 8 if name == "llava_pixtral" else 16
            height, width = [(2, 3), (2, 3), (3, 2)][shape]  # seeds 0 and 1: one layout, other pixels
            tokens, span = _grid_tokens(height, width)
            return Medium("image", (_rand(seed, 3, height * stride, width * stride),), tuple(tokens), (span,))
        if name in HIGH_RES:
            # The processor's two versions of one picture: here the 32x32 rows and unrelated 64x64 ones.
            return Medium("image", (_rand(seed, 3, 32, 32), _rand(seed + 100, 3, 64, 64)), (IMG,) * 16, ((0, 16),))
        if name in PLAIN:
            return Medium("image", (_rand(seed, 3, 32, 32),), (IMG,) * 16, ((0, 16),))
        if name == "video_llava":
            if seed % 2:
                return Medium("video", (_rand(seed, 2, 3, 32, 32),), (VID,) * 34, ((0, 34),))
            return Medium("image", (_rand(seed, 3, 32, 32),), (IMG,) * 16, ((0, 16),))
        if name == "lfm2_vl":
            return lfm2_vl_medium(seed, framed=True)
        if name == "fuyu":
            # Rows of patches, each row ended by an image-newline id; every patch an item of one placeholder.
            lines, cols = [(2, 3), (2, 3), (3, 2)][shape]
            patches = tuple(_rand(seed * 7 + i, 48) for i in range(lines * cols))
            tokens = [t for _ in range(lines) for t in (*[IMG] * cols, 111)]
            spans = tuple((r * (cols + 1) + c, r * (cols + 1) + c + 1) for r in range(lines) for c in range(cols))
            return Medium("image", patches, tuple(tokens), spans)
        if name in _PADDED_CLIPS:
            # One clip (raw samples or mel frames) padded with zeros past its valid part, its mask; framed by
            # begin/end-audio ids.
            bins, padded, valids, counts = _PADDED_CLIPS[name]
            valid = valids[shape]
            clip, mask = _rand(seed, bins, padded), torch.zeros(padded, dtype=torch.long)
            clip[:, valid:], mask[:valid] = 0, 1
            return Medium("audio", (clip, mask), (110, *[AUD] * counts[valid], 111), ((1, 1 + counts[valid]),))
        count = 2 if shape == 2 else 1  # tiles, chunks or frames
        if name == "voxtral":
            rows = tuple(_rand(seed * 7 + i, 16, 40) for i in range(count))
            return Medium("audio", rows, (110, *[AUD] * 5 * count), tuple((1 + 5 * i, 6 + 5 * i) for i in range(count)))
        side = 64 if name in ("got_ocr2", "pp_chart2table") else 32
        tiles = tuple(_rand(seed * 7 + i, 3, side, side) for i in range(count))
        if name in FRAMED_TILES:
            return Medium(
                "image", tiles, (110, *[IMG] * 4 * count, 111), tuple((1 + 4 * i, 5 + 4 * i) for i in range(count))
            )
        if name == "aya_vision":
            tokens = [110, *[t for _ in range(count) for t in (111, *[IMG] * 4)], 112]
            return Medium("image", tiles, tuple(tokens), tuple((2 + 5 * i, 6 + 5 * i) for i in range(count)))
        if name == "llama4":
            # Local tiles (x-separated, then a y-separator), then <|image|> and the global tile.
            local = [t for _ in range(count - 1) for t in (*[IMG] * 4, 111)] + ([112] if count > 1 else [])
            tokens = [110, *local, 113, *[IMG] * 4, 114]
            starts = [1 + 5 * i for i in range(count - 1)] + [len(tokens) - 5]
            return Medium("image", tiles, tuple(tokens), tuple((s, s + 4) for s in starts))
        # SmolVLM video: each frame after its timestamp text, framed by fake-image ids.
        frames = (*tiles, _rand(seed * 7 + 5, 3, 32, 32))
        frame_tokens: list[int] = []
        frame_spans: list[tuple[int, int]] = []
        for f in range(len(frames)):
            frame_tokens += [9, 10 + f, FAKE_IMAGE_ID, 111]  # timestamp text, fake-image and global-image ids
            frame_spans.append((len(frame_tokens), len(frame_tokens) + 4))
            frame_tokens += [IMG] * 4 + [FAKE_IMAGE_ID]
        return Medium("video", frames, tuple(frame_tokens), tuple(frame_spans))

    def placeholders(self, medium: Medium) -> torch.Tensor:
        return torch.tensor([list(medium.tokens)])

    def kwargs(self, media: list[Medium]) -> dict[str, Any]:
        """What the family's processor hands `generate` for `media` in prompt order."""
        if not media:
            return {}
        if self.name in PIXTRAL:
            images = [m.rows[0] for m in media]
            height, width = max(i.shape[1] for i in images), max(i.shape[2] for i in images)
            padded = torch.zeros(len(images), 3, height, width)
            for k, image in enumerate(images):
                padded[k, :, : image.shape[1], : image.shape[2]] = image
            sizes = torch.tensor([list(i.shape[1:]) for i in images])
            return {"pixel_values": padded, "image_sizes": sizes}
        if self.name == "video_llava":
            out: dict[str, Any] = {}
            for kind, name in (("image", "pixel_values"), ("video", "pixel_values_videos")):
                firsts = [m.rows[0] for m in media if m.kind == kind]
                if firsts:
                    out[name] = torch.stack(firsts)
            return out
        if self.name == "lfm2_vl":
            return lfm2_vl_kwargs([row for m in media for row in m.rows])
        if self.name == "fuyu":
            return {"pixel_values": torch.stack([row for m in media for row in m.rows])[None]}
        if self.name == "glmasr":
            return {
                "input_features": torch.stack([m.rows[0] for m in media]),
                "input_features_mask": torch.stack([m.rows[1] for m in media]),
            }
        if self.name == "omniasr":
            return {
                "input_values": torch.stack([m.rows[0] for m in media]),
                "padding_mask": torch.stack([m.rows[1] for m in media]),
            }
        if self.name in HIGH_RES:
            return {
                "pixel_values": torch.stack([m.rows[0] for m in media]),
                "high_res_pixel_values": torch.stack([m.rows[1] for m in media]),
            }
        rows = torch.stack([row for m in media for row in m.rows])
        if self.name == "voxtral":
            return {"input_features": rows}
        if self.name == "aria":
            # The processor pads each crop to a square; its mask marks the valid pixels (here: the right
            # quarter of a medium's second crop is padding).
            masks = [torch.ones(32, 32, dtype=torch.bool) for m in media for _ in m.rows]
            seconds = [i for i, j in enumerate(j for m in media for j in range(len(m.rows))) if j == 1]
            for i in seconds:
                masks[i][:, 24:] = False
            mask = torch.stack(masks)
            return {"pixel_values": rows * mask[:, None], "pixel_mask": mask}
        if self.name == "smolvlm_video":
            # The video processor's frames of one video, and its padding mask (all valid: one video per prompt).
            mask = torch.ones(1, rows.shape[0], *rows.shape[2:], dtype=torch.bool)
            return {"pixel_values": rows[None], "pixel_attention_mask": mask}
        return {"pixel_values": rows}

    def towers(self) -> list[Any]:
        if self.name == "llama4":
            return [self.model.vision_model]
        if self.name == "fuyu":
            return [self.model.model.vision_embed_tokens]
        if self.name == "chameleon":
            return [self.model.model.vqmodel.encoder]  # its VQ model runs `encode`, not `forward`
        inner = self.model.model
        names = {
            "video_llava": ["image_tower", "video_tower"],
            "voxtral": ["audio_tower"],
            "glmasr": ["audio_tower"],
            "omniasr": ["audio_tower"],
            "smolvlm_video": ["vision_model"],
            "deepseek_vl": ["vision_model"],
            "deepseek_vl_hybrid": ["vision_model"],
            "janus": ["vision_model"],
            "lighton_ocr": ["vision_encoder"],
            "step3p7": ["vision_model"],
        }
        return [getattr(inner, n) for n in names.get(self.name, ["vision_tower"])]

    def encoded(self, ids: torch.Tensor, media: list[Medium], store: Any = None) -> int:
        """Run `ids` (through `store` if given); return how many rows (images, tiles, frames, chunks) the towers saw."""
        seen: list[int] = []

        def record(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], _out: Any) -> None:
            first = args[0] if args else next(v for v in kwargs.values() if isinstance(v, torch.Tensor))
            seen.append(int(first.shape[1] if self.name == "fuyu" else first.shape[0]))  # Fuyu: [1, patches, ...]

        handles = [tower.register_forward_hook(record, with_kwargs=True) for tower in self.towers()]
        extra = {"past_key_values": store} if store is not None else {}
        try:
            generate(self.model, ids, NEW, suppress_tokens=SPECIAL_IDS, **extra, **self.kwargs(media))
        finally:
            for handle in handles:
                handle.remove()
        return sum(seen)


def lfm2_vl_medium(seed: int, framed: bool = True) -> Medium:
    """LFM2-VL pool medium `seed` (seeds 1 and 13 agree in shape): rows ``[h, w, 48]`` of patches.

    Shape 0: one 4x6-patch tile, 6 placeholders. Shape 2: two 4x4 tiles (a 1x2 grid) and a 2x4
    thumbnail, 4 + 4 + 2 placeholders. `framed` adds the processor's image start/end (110/111),
    tile (112, 113) and thumbnail (114) ids; without them the placeholders of all rows form one run.
    """
    dim = 3 * LFM2_PATCH * LFM2_PATCH
    shapes = [(4, 4), (4, 4), (2, 4)] if seed % 3 == 2 else [(4, 6)]
    rows = tuple(_rand(seed * 7 + i, h, w, dim) for i, (h, w) in enumerate(shapes))
    counts = [h * w // 4 for h, w in shapes]
    tokens: list[int] = [110] if framed else []
    spans = []
    for i, count in enumerate(counts):
        if framed and len(counts) > 1:
            tokens.append(114 if i == len(counts) - 1 else 112 + i)  # the tile's position, or the thumbnail's mark
        spans.append((len(tokens), len(tokens) + count))
        tokens += [IMG] * count
    tokens += [111] if framed else []
    return Medium("image", rows, tuple(tokens), tuple(spans))


def lfm2_vl_kwargs(rows: list[torch.Tensor]) -> dict[str, Any]:
    """What LFM2-VL's processor hands `generate`: patch rows padded to 24, their int32 mask and h x w patches."""
    pixel_values = torch.zeros(len(rows), LFM2_ROW_LEN, rows[0].shape[-1])
    mask = torch.zeros(len(rows), LFM2_ROW_LEN, dtype=torch.int32)
    for i, row in enumerate(rows):
        n = row.shape[0] * row.shape[1]
        pixel_values[i, :n] = row.reshape(n, -1)
        mask[i, :n] = 1
    shapes = torch.tensor([list(row.shape[:2]) for row in rows])
    return {"pixel_values": pixel_values, "pixel_attention_mask": mask, "spatial_shapes": shapes}


def _sweep(name: str) -> registry.SweepCase:
    """A family of the generic table in the support matrix's scenario."""
    fam = GenericFamily(name)
    media = registry.three(fam.medium)
    tokens = {k: fam.placeholders(m) for k, m in media.items()}
    return registry.SweepCase(
        fam.model, tokens, lambda _ids, names: fam.kwargs([media[n] for n in names]), media["a"].spans[0][0]
    )


#: The generic table's keys (`multimodal/generic_table.py`) -> the family name built here.
SWEPT = {
    **{
        key: key
        for key in (
            "mistral3",
            "lighton_ocr",
            "video_llava",
            "voxtral",
            "glmasr",
            "fuyu",
            "omniasr",
            "internvl",
            "aya_vision",
            "cohere2_vision",
            "qianfan_ocr",
            "got_ocr2",
            "pp_chart2table",
            "deepseek_vl_hybrid",
            "deepseek_vl",
            "janus",
            "vipllava",
            "aria",
            "llama4",
            "lfm2_vl",
            "mistral_large4",
            "chameleon",
            "step3p7",
        )
    },
    "llava/pixtral": "llava_pixtral",
}
for _key, _name in SWEPT.items():
    registry.register_sweep(_key, partial(_sweep, _name))
