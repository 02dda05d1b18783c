"""The rules `GenericMedia` serves a family by: its media kinds, their kwargs and placeholder layouts, as data.

A family is one `FamilyRule` (in `generic_table`), holding a `KindRule` per media kind:

* which kwargs hold each kind's rows (`KindRule.data`) and their valid sizes (`KindRule.sizes`);
* how a row's placeholders are laid out (`KindRule.count`):
  ``"equal"``: every row of the kind has the same number, so runs of placeholders cut into
  equal items (adjacent items may share a run);
  ``"grid"``: Pixtral-style, a row of valid size ``h x w`` is ``h // s`` runs of ``w // s``
  placeholders, one break token between runs (``s``: `KindRule.stride`), and its item spans
  from its first placeholder to its last (the breaks inside are hashed with it);
  ``"area"``: NaFlex-style (SigLIP 2), rows of flattened patches padded to one length: a row
  of valid size ``h x w`` patches (`KindRule.sizes`) is its first ``h * w`` patches, exactly
  those marked by `KindRule.mask`, and has ``(h // s) * (w // s)`` placeholders in one run
  (``s``: `KindRule.stride`; adjacent items may share a run);
  ``"thw"``: Qwen-VL-style flattened patch rows, `KindRule.sizes` a grid kwarg of one
  ``(t, h, w)`` row per item (or ``(h, w)``, one frame): an item is ``t * h * w`` consecutive rows of `KindRule.data`
  and has ``t * h * w // m`` placeholders (``h * w // m`` when `KindRule.pooled_time`: the
  tower averages a video's frames), ``m`` the product of `KindRule.stride` (the merge area;
  a list value counts as the product of its elements); adjacent items may share a run;
  ``"packed"``: NaViT-packed rows (MiniCPM-V), `KindRule.data` one ``[1, channels, p, L]`` row of
  all items' patches side by side along its last axis (``p``: `KindRule.patch`, the pixels per
  patch side), `KindRule.sizes` one ``(h, w)`` patch grid per item: an item is the next
  ``h * w * p`` columns and has ``h * w // m`` placeholders (``m``: `KindRule.stride`'s
  product); adjacent items may share a run;
  ``"conv"``: audio clips as rows of frames padded to one length (frames along
  `KindRule.frames_axis`), `KindRule.mask` each row's valid frames: a row of ``n`` valid
  frames has the placeholders left after the convolutions `KindRule.convs` (each
  ``(padding, kernel, stride)`` maps ``n`` to ``(n + 2 * padding - kernel) // stride + 1``;
  none: one per frame); a tower may read the padding too, so an item is its whole row and mask
  row (its valid frames its content: reuse stopped at a re-padded clip counts `media_padding`),
  unless the tower reads its frames in chunks of `KindRule.chunk` frames (Qwen3-ASR; 1:
  Fun-ASR-Nano, whose tower masks the padding out): then an item is its row and mask cropped
  to its valid frames' chunks, each chunk through the convolutions on its own; with
  `KindRule.mask_per_placeholder` the mask marks each row's placeholders instead of its frames
  (Granite Speech); adjacent items may share a run;
* which `generate` kwargs change how media are encoded (`FamilyRule.settings`), which
  config values the pattern needs (`FamilyRule.requires`; otherwise the family keeps no
  adapter and runs cold), which kwargs its processor returns that the model never reads
  (`FamilyRule.ignored`), and which `generate` kwargs a call with media must set for its
  encoding to be deterministic (`FamilyRule.call_requires`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: Placeholder layouts a `KindRule` may declare.
COUNTS = ("equal", "grid", "area", "thw", "packed", "conv")
#: The `KindRule.token_id` of most image and video kinds: the config attributes their placeholder id is under.
IMAGE_TOKEN_ID = ("image_token_id", "image_token_index")
VIDEO_TOKEN_ID = ("video_token_id", "video_token_index")


@dataclass(frozen=True, slots=True)
class KindRule:
    """How one media kind of a family reaches `generate` and the prompt.

    `token_id` names the config attributes of the placeholder id (the first int one wins).
    `data` is the kwarg whose leading rows are the items; `extras` are kwargs with one row per
    item as well (a pixel mask), hashed with the item and sliced alongside. `sizes` is the kwarg of each row's
    valid ``[height, width]`` in pixels, when the processor pads rows per prompt (in patches,
    for rows of flattened patches with a `mask`). `stride`
    (config attribute paths, multiplied) is the pixels per placeholder side of a ``"grid"``
    kind (the patches per placeholder side of an ``"area"`` kind); `patch` (likewise) the
    pixels per vision patch, to which a valid size is rounded
    down before hashing (the tower reads whole patches only). `mask` is the kwarg of each
    row's valid-patch mask, for rows of flattened patches (NaFlex): sliced alongside, and
    required to mark exactly the row's first ``height * width`` patches. `pooled_time` (``"thw"``
    kinds) marks towers that average an item's frames into one frame's placeholders; `merges`
    (``"thw"`` kinds) names a kwarg of each item's own spatial merge size ``s`` (Video-LLaMA 3),
    which then makes the merge area ``s * s`` instead of `stride`'s product; `merge_area`
    (``"thw"`` kinds) is a merge area the model hardcodes (Nemotron-H Omni's 2x2 pixel shuffle),
    used when `stride` is empty. `convs` (``"conv"``
    kinds) are the ``(padding, kernel, stride)`` steps from a row's valid frames to its placeholders
    (none: one placeholder per valid frame), followed by unpadded ones of the kernel and stride
    lists at the config paths `conv_paths` (a wav2vec-style feature encoder); `frames_axis` the
    axis of the frames in `data`,
    `frames_offset` a count the model adds to the valid frames first (Nemotron-H Omni's 1), `chunk`
    the frames a tower reads as one unit (config paths and numbers, multiplied: Qwen3-ASR's
    ``2 * n_window``): a row's valid frames must lead it, its chunks of valid frames are what is
    hashed (the chunks past them hold padding only, never read) and its placeholders are each
    chunk's count through `convs`, summed; `mask_per_placeholder` marks a mask over each row's
    placeholders (its sum their count, the row hashed whole), not over its frames; `hop`
    config paths (multiplied; a list counts as its product) of the samples per placeholder after
    those steps: a row then has one placeholder per started hop (VibeVoice ASR's tokenizer).
    `item_axis` 1 (``"equal"`` kinds) takes one prompt's items along the second axis of a
    ``[1, items, ...]`` kwarg (Fuyu's patches) instead of its rows.
    `requires` holds ``(config attribute path, value)`` pairs this kind's layout relies on: a
    call passing this kind's media to a model whose config differs runs cold (`media_placeholders`).
    """

    kind: str
    token_id: tuple[str, ...]
    data: str
    count: str = "equal"
    sizes: str | None = None
    stride: tuple[str, ...] = ()
    patch: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    mask: str | None = None
    pooled_time: bool = False
    merges: str | None = None
    merge_area: int = 0
    convs: tuple[tuple[int, int, int], ...] = ()
    frames_axis: int = -1
    frames_offset: int = 0
    conv_paths: tuple[str, ...] = ()
    hop: tuple[str, ...] = ()
    chunk: tuple[str | int, ...] = ()
    mask_per_placeholder: bool = False
    item_axis: int = 0
    requires: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True, slots=True)
class FamilyRule:
    """One family's media, as data: its kinds, its encoding settings and the config it needs.

    `requires` holds ``(config attribute path, value)`` pairs: a model whose config differs
    gets no adapter, so its media run cold (`media_inputs:<model_type>`). `embeds_suffix`
    declares that the model's forward embeds a prompt as its text embeddings with each kind's
    features (``get_{image,video,audio}_features(**rows).pooler_output``, its items' rows
    concatenated) scattered over its placeholder ids, so a suffix's embeddings may be computed the same way
    outside the forward: models with recurrent layers then prefill media prompts
    (`MediaAdapter.embeds_suffix`). `ignored`
    names media kwargs the processor returns and the model accepts but never reads (Gemma 3n's
    `token_type_ids`): a call passing them is served, and they reach `generate` unchanged.
    `aliases` holds ``(old name, name)`` pairs of kwargs the model still takes under a
    deprecated name (Video-LLaVA's processor returns `pixel_values_images`): read as the new
    name, and handed to `generate` under it after a hit (the model maps one to the other).
    `call_requires` holds ``(kwarg, value)`` pairs a call passing media must set (VibeVoice ASR's
    ``sample=False``: by default its audio encoder adds random noise, so no two runs of a prompt
    agree): a call with media that leaves one unset or sets another value runs cold
    (`media_random:<kwarg>`).
    """

    kinds: tuple[KindRule, ...]
    settings: tuple[str, ...] = ()
    requires: tuple[tuple[str, Any], ...] = ()
    embeds_suffix: bool = False
    ignored: tuple[str, ...] = ()
    aliases: tuple[tuple[str, str], ...] = ()
    call_requires: tuple[tuple[str, Any], ...] = ()

    def fits(self, config: Any) -> bool:
        """Whether `config` has every value this family's pattern relies on."""
        return all(config_path(config, path) == value for path, value in self.requires)


# The kinds the table's rows start from, each adjusted per family with `dataclasses.replace`.
#: An image per `pixel_values` row, a fixed number of placeholders each.
IMAGE_ROWS = KindRule("image", IMAGE_TOKEN_ID, "pixel_values")
#: A video per `pixel_values_videos` row (all its frames), a fixed number of placeholders each.
VIDEO_ROWS = KindRule("video", VIDEO_TOKEN_ID, "pixel_values_videos")
#: Images as Qwen-VL-style grids of flattened patch rows (their merge set per family).
THW_IMAGE = KindRule("image", IMAGE_TOKEN_ID, "pixel_values", count="thw", sizes="image_grid_thw")
#: Videos as Qwen-VL-style grids of flattened patch rows (their merge set per family).
THW_VIDEO = KindRule("video", VIDEO_TOKEN_ID, "pixel_values_videos", count="thw", sizes="video_grid_thw")
#: Audio clips as rows of mel frames padded to one length, `input_features_mask` their valid frames.
CONV_AUDIO = KindRule("audio", ("audio_token_id",), "input_features", count="conv", mask="input_features_mask")
#: Audio clips as rows of raw samples padded to one length, `padding_mask` their valid samples.
SAMPLE_AUDIO = KindRule("audio", ("audio_token_id",), "input_values", count="conv", mask="padding_mask")


def config_path(config: Any, path: str) -> Any:
    """The value at a dotted attribute `path` of `config` (``"vision_config.patch_size"``), or None."""
    value = config
    for name in path.split("."):
        value = getattr(value, name, None)
    return value
