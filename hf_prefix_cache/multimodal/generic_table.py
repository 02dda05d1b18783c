"""The families `GenericMedia` serves: one `FamilyRule` per family, keyed by model type.

A key ``"<model_type>/<vision model_type>"`` picks a rule for one tower of a family
(LLaVA with a Pixtral tower); a plain ``"<model_type>"`` key covers the family otherwise.
Each row was checked against transformers 5.23 (each item is encoded on its own and its
features fill its placeholders in order; OmniASR against 5.24, which added it) and is proven
exact by `tests/media/test_media_generic.py` (LFM2-VL, whose text layers hold conv states, by
`tests/media/test_media_lfm2_vl.py`; the ``"thw"`` rows, Kimi-K2.5 on, by `tests/media/test_media_grid.py`;
MiniCPM-o OCR, Nemotron-H Omni and Inkling, whose text layers hold states, by
`tests/media/test_media_minicpm.py`, `tests/media/test_media_nemotron_h_omni.py` and
`tests/media/test_media_inkling.py`; Gemma 3n, whose timm tower needs torchvision, by
`tests/media/test_media_gemma3n.py` in its own venv). Families left out, and why, are listed in
`COLD_FAMILIES`.
"""

from __future__ import annotations

from typing import Any

from hf_prefix_cache.multimodal.generic_rules import FamilyRule, KindRule

_IMAGE_ID = ("image_token_id", "image_token_index")
_VIDEO_ID = ("video_token_id", "video_token_index")
#: `generate` kwargs of LLaVA-like models that change which tower states become features.
_LLAVA_SETTINGS = ("vision_feature_layer", "vision_feature_select_strategy")

#: Pixtral tower: images padded to the prompt's largest, `image_sizes` the valid part; the tower
#: attends within each image only (block-diagonal mask) and reads whole patches.
_PIXTRAL_PATCH = ("vision_config.patch_size",)


GENERIC_FAMILIES: dict[str, FamilyRule] = {
    # Mistral 3 (Mistral Small 3.x): Pixtral tower, 2x2 patch merger; [IMG] rows split by [IMG_BREAK].
    "mistral3": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="grid",
                sizes="image_sizes",
                stride=(*_PIXTRAL_PATCH, "spatial_merge_size"),
                patch=_PIXTRAL_PATCH,
            ),
        ),
    ),
    # LLaVA with a Pixtral tower (Pixtral-12B): one placeholder per patch, rows split by [IMG_BREAK].
    # With the "default" strategy the model drops the first patch of all images together: not per item.
    "llava/pixtral": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="grid",
                sizes="image_sizes",
                stride=_PIXTRAL_PATCH,
                patch=_PIXTRAL_PATCH,
            ),
        ),
        settings=_LLAVA_SETTINGS,
        requires=(("vision_feature_select_strategy", "full"),),
    ),
    # LightOnOCR: Mistral 3's layout (Pixtral tower, patch merger, [IMG] rows split by [IMG_BREAK]).
    "lighton_ocr": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="grid",
                sizes="image_sizes",
                stride=(*_PIXTRAL_PATCH, "spatial_merge_size"),
                patch=_PIXTRAL_PATCH,
            ),
        ),
    ),
    # Mistral Large 4: Mistral 3's layout (Pixtral tower, 2x2 patch merger, [IMG] rows split by [IMG_BREAK]).
    "mistral_large4": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="grid",
                sizes="image_sizes",
                stride=(*_PIXTRAL_PATCH, "spatial_merge_size"),
                patch=_PIXTRAL_PATCH,
            ),
        ),
        settings=("vision_feature_layer",),
    ),
    # VipLLaVA: LLaVA with features from several tower layers (`vision_feature_layers`, renamed
    # `vision_feature_layer` in 5.24: both settings); one pixel_values row per image, a fixed count each.
    "vipllava": FamilyRule(
        kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),),
        settings=("vision_feature_layer", "vision_feature_layers"),
    ),
    # Video-LLaVA: one tower per kind; an image row is a picture, a video row all its frames.
    "video_llava": FamilyRule(
        kinds=(
            KindRule("image", _IMAGE_ID, "pixel_values"),
            KindRule("video", _VIDEO_ID, "pixel_values_videos"),
        ),
        settings=_LLAVA_SETTINGS,
        # Its image processor returns images as `pixel_values_images` unless told otherwise.
        aliases=(("pixel_values_images", "pixel_values"),),
    ),
    # Voxtral: each row of `input_features` is one 30 s chunk of mel frames, a fixed number of placeholders.
    "voxtral": FamilyRule(kinds=(KindRule("audio", ("audio_token_id", "audio_token_index"), "input_features"),)),
    # GLM-ASR: each row of `input_features` one clip of mel frames, padded to the prompt's longest; its
    # tower attends over the padding too, then keeps the valid frames' features after two convolutions
    # and a 4-frame merge: a clip is its whole row with its mask row.
    "glmasr": FamilyRule(
        kinds=(
            KindRule(
                "audio",
                ("audio_token_id",),
                "input_features",
                count="conv",
                mask="input_features_mask",
                convs=((1, 3, 1), (1, 3, 2), (0, 4, 4)),
            ),
        ),
    ),
    # Fuyu: each image patch is embedded on its own (one linear layer) into one placeholder; a prompt's
    # patches are `pixel_values[0]` (rows of an image split by image-newline text ids): every patch an item.
    # Its processor's older name for them, `image_patches`, is read as `pixel_values`.
    "fuyu": FamilyRule(
        kinds=(KindRule("image", _IMAGE_ID, "pixel_values", item_axis=1),),
        aliases=(("image_patches", "pixel_values"),),
    ),
    # OmniASR: each row of `input_values` (`[clips, 1, samples]`) one clip of raw samples padded to one
    # length, `padding_mask` its valid samples; a wav2vec-style conv stack (the config's kernels and strides,
    # unpadded) gives its frames, one placeholder each: a clip is its whole row and mask row.
    "omniasr": FamilyRule(
        kinds=(
            KindRule(
                "audio",
                ("audio_token_id",),
                "input_values",
                count="conv",
                mask="padding_mask",
                conv_paths=("audio_config.conv_kernel", "audio_config.conv_stride"),
            ),
        ),
    ),
    # InternVL: each row one tile (or video frame) of `image_seq_length` placeholders, pixel-shuffled.
    "internvl": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),), settings=_LLAVA_SETTINGS),
    # Aya Vision: each row one tile, its placeholders after a tile marker; pixel-shuffled per tile.
    "aya_vision": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),), settings=_LLAVA_SETTINGS),
    # Cohere 2 Vision: Aya Vision's tiles, pixel-shuffled per tile.
    "cohere2_vision": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),)),
    # Qianfan-OCR: InternVL's tiles.
    "qianfan_ocr": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),), settings=_LLAVA_SETTINGS),
    # GOT-OCR 2: a SAM-style tower per image, a fixed number of placeholders each.
    "got_ocr2": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),)),
    # PP-Chart2Table: GOT-OCR 2's model under its own config.
    "pp_chart2table": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),)),
    # DeepSeek-VL: a SigLIP tower per image, a fixed number of placeholders each.
    "deepseek_vl": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),)),
    # DeepSeek-VL hybrid: each image twice, a SigLIP tower on `pixel_values` and a SAM-style tower on its
    # `high_res_pixel_values` row, their features joined per image: a fixed number of placeholders each.
    "deepseek_vl_hybrid": FamilyRule(
        kinds=(KindRule("image", _IMAGE_ID, "pixel_values", extras=("high_res_pixel_values",)),)
    ),
    # Janus (text generation; its image-generation mode runs cold: `model_kwarg:generation_mode`): a
    # SigLIP-style tower per image, a fixed number of placeholders each.
    "janus": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),)),
    # Aria: each row one crop with its `pixel_mask` row (the crop's valid pixels); a fixed number of queries each.
    "aria": FamilyRule(kinds=(KindRule("image", _IMAGE_ID, "pixel_values", extras=("pixel_mask",)),)),
    # LFM2-VL: a SigLIP 2 NaFlex tower; each row one tile or thumbnail, its patches flattened and padded
    # to one length, `spatial_shapes` its h x w patches and `pixel_attention_mask` its first h * w; 2x2
    # patches per placeholder (framing ids between tiles are text). Its LFM2 text layers hold conv
    # states, so the hook prefills media prompts itself, fed the embeddings the forward would compute.
    "lfm2_vl": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="area",
                sizes="spatial_shapes",
                stride=("downsample_factor",),
                mask="pixel_attention_mask",
            ),
        ),
        embeds_suffix=True,
    ),
    # Llama 4: each row one tile (the image's tiles, then its global view), one <|patch|> run per tile.
    "llama4": FamilyRule(
        kinds=(KindRule("image", _IMAGE_ID, "pixel_values"),), settings=("vision_feature_select_strategy",)
    ),
    # Gemma 3n: a timm MobileNetV5 tower per image and a conformer per audio clip, each a fixed number of
    # placeholders (`vision_soft_tokens_per_image`, `audio_soft_tokens_per_image`); causal attention over
    # them, per-layer inputs computed per token. A clip is its `input_features` row (padded to the prompt's
    # longest clip) with its mask row, hashed whole: the padding the tower reads is part of the key. The
    # processor's `token_type_ids` reach the model and are never read.
    "gemma3n": FamilyRule(
        kinds=(
            KindRule("image", ("image_token_id",), "pixel_values"),
            KindRule("audio", ("audio_token_id",), "input_features", extras=("input_features_mask",)),
        ),
        ignored=("token_type_ids",),
    ),
    # Kimi-K2.5: a MoonViT-style tower on flattened patch rows, attention within each item; a 2x2 merge
    # kernel, a video chunk's frames averaged into one frame's placeholders (each chunk its own run).
    "kimi_k25": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.merge_kernel_size",),
                pooled_time=True,
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.merge_kernel_size",),
                pooled_time=True,
            ),
        ),
    ),
    # EXAONE 4.5: a Qwen2.5-VL-style tower (windows within each item) on flattened patch rows, 2x2 merge,
    # 1D positions (no M-RoPE); a video is one placeholder run of all its frames.
    "exaone4_5": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
        ),
    ),
    # HyperCLOVA X Vision V2: a Qwen2.5-VL tower (windows within each item) on flattened patch rows, 2x2 merge;
    # 1D positions (its generate drops position ids, its text model counts them); a video is one run of all its frames.
    "hyperclovax_vision_v2": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
        ),
    ),
    # Muse Glimmer: a windowed tower (windows and attention within each item) on flattened patch rows, a 2x2
    # pixel shuffle (`merge_size`); 1D positions; videos go through the image tower.
    "muse_glimmer": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.merge_size", "vision_config.merge_size"),
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.merge_size", "vision_config.merge_size"),
            ),
        ),
    ),
    # MiniMax-M3-VL: a CLIP-like tower on flattened Conv3d patch rows, attention within each item; 2x2 merge.
    "minimax_m3_vl": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
        ),
    ),
    # LFM3-VL: a conv + attention tower on flattened patch rows, attention within each item; 2x2 merge. Its
    # LFM3 text layers hold conv states, so the hook prefills media prompts itself (suffix embeddings).
    "lfm3_vl": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="thw",
                sizes="image_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"),
            ),
        ),
        embeds_suffix=True,
    ),
    # MiniCPM-o OCR: a NaViT tower (attention within each image) on one packed row of all images' patches,
    # `target_sizes` each image's patch grid, a 2x2 merger: its "4x" mode, the default. In "16x" mode a window
    # merger inside the tower makes an image's features depend on the images packed before it (MiniCPM-V
    # 4.6's default: see `COLD_FAMILIES`): such a model keeps no adapter, and a call overriding
    # `downsample_mode` runs cold. Its Qwen3.5 text layers hold recurrent states, so the hook prefills media
    # prompts itself (suffix embeddings). Videos (frames packed per video, one size for all) are not served:
    # such calls run cold (`media_inputs:pixel_values_videos`).
    "minicpm_ocr": FamilyRule(
        kinds=(
            KindRule(
                "image",
                _IMAGE_ID,
                "pixel_values",
                count="packed",
                sizes="target_sizes",
                stride=("merge_kernel_size",),
                patch=("vision_config.patch_size",),
            ),
        ),
        settings=("downsample_mode",),
        requires=(("downsample_mode", "4x"), ("merger_times", 1)),
        embeds_suffix=True,
    ),
    # Nemotron-H Omni: images by a RADIO tower (attention within each image) on flattened patch rows,
    # `image_grid_hw` each image's patch grid, a 2x2 pixel shuffle the model hardcodes (so `downsample_ratio`
    # must be 0.5); audio clips by a Parakeet encoder (attention masked to the valid frames), padded to one
    # length, each clip's placeholders its valid frames + 1 through three stride-2 convolutions (the
    # subsampling the kind requires of `audio_config`). Its Nemotron-H text layers hold Mamba-2 states, so
    # the hook prefills media prompts itself (suffix embeddings). Videos (on the image placeholder id, with
    # EVS pruning by content) are not served: such calls run cold (`media_inputs:pixel_values_videos`).
    "nemotron_h_omni": FamilyRule(
        kinds=(
            KindRule("image", ("image_token_id",), "pixel_values", count="thw", sizes="image_grid_hw", merge_area=4),
            KindRule(
                "audio",
                ("audio_token_id",),
                "input_features",
                count="conv",
                mask="input_features_mask",
                convs=((1, 3, 2),) * 3,
                frames_axis=1,
                frames_offset=1,
                requires=(
                    ("audio_config.subsampling_conv_kernel_size", 3),
                    ("audio_config.subsampling_conv_stride", 2),
                    ("audio_config.subsampling_factor", 8),
                ),
            ),
        ),
        requires=(("downsample_ratio", 0.5),),
        embeds_suffix=True,
    ),
    # Inkling: its vision tower encodes each patch row (`[patches, t, p, p, c]`) on its own into one
    # placeholder, so every row is an item; an audio clip is a row of dMel bin ids (`[clips, frames, bins]`),
    # one placeholder per valid frame (`audio_input_ids_mask`), each frame embedded on its own (hashed
    # whole with its mask). Its hybrid text layers hold conv states, so the hook prefills media prompts
    # itself (suffix embeddings). The processor's `token_type_ids` reach the model and are never read.
    "inkling_mm_model": FamilyRule(
        kinds=(
            KindRule("image", ("image_token_id",), "pixel_values"),
            KindRule(
                "audio",
                ("audio_token_id",),
                "audio_input_ids",
                count="conv",
                mask="audio_input_ids_mask",
                frames_axis=1,
            ),
        ),
        embeds_suffix=True,
        ignored=("token_type_ids",),
    ),
    # Video-LLaMA 3: a SigLIP-style tower on flattened patch rows, attention within each item; each item merges
    # by its own `*_merge_sizes` entry. Videos with a token-compression mask (features dropped by content)
    # are not this pattern: such calls run cold on `media_inputs:video_compression_mask`.
    "video_llama_3": FamilyRule(
        kinds=(
            KindRule(
                "image", _IMAGE_ID, "pixel_values", count="thw", sizes="image_grid_thw", merges="image_merge_sizes"
            ),
            KindRule(
                "video",
                _VIDEO_ID,
                "pixel_values_videos",
                count="thw",
                sizes="video_grid_thw",
                merges="video_merge_sizes",
            ),
        ),
    ),
}

#: Families left cold on media that were examined, and what serving them would need (their media
#: requests count `media_inputs:<model_type>`). Documentation as data: the store never reads it;
#: the support matrix shows it in the media column.
COLD_FAMILIES: dict[str, str] = {
    # Its visual-indicator tokens (outside the placeholder runs) get embeddings from the vision
    # embedding table only when pixels are passed: a suffix holding indicators whose images are all
    # cached would embed them as text. Not the generic pattern.
    "ovis2": "visual indicator tokens take vision embeddings only in calls with pixels",
    # MiniCPM-V 4.6: MiniCPM-o OCR's model, in "16x" mode by default: the tower's window merger runs over all
    # images of a call packed together, so an image's features depend on the images before it
    # (`tests/media/test_media_minicpm.py`). Serving it would need a layout whose items are whole prompts' images.
    "minicpmv4_6": "16x mode (the default): an image's features depend on the images packed before it",
    # Emu3: a VQ-VAE turns each image into code ids embedded as text, one run of (h / f) x (w / f + 1)
    # placeholders (codes and row ends) counted from `image_sizes`; needs a layout counting code grids.
    "emu3": "VQ code grids with row ends: no layout counts an image's codes from its size yet",
    # GIT: the image's features are prepended before the prompt's embeddings (no placeholder ids; the
    # cache holds positions the prompt has no ids for) and attend both ways.
    "git": "image tokens are prepended outside input_ids (the cache is longer than the prompt)",
    # Kosmos-2.5: features go where `image_embeds_position_mask` says (a per-position kwarg that also adds
    # segment embeddings), not onto placeholder ids.
    "kosmos-2.5": "features placed by image_embeds_position_mask, not placeholder ids: no such layout",
    # MOSS Transcribe-Diarize: a clip's raw audio is cut into `audio_chunk_size` chunks mapped back through
    # `padding_mask`, each chunk padded and merged on its own; needs a per-clip layout of chunks.
    "moss_transcribe_diarize": "clips are cut into chunks mapped through padding_mask: no layout of chunks yet",
    # VibeVoice ASR: its audio encoder adds Gaussian noise to the latents unless a call passes
    # `sample=False`, so by default no cached run can equal a cold one; the deterministic path has no row.
    "vibevoice_asr": "its audio encoder adds random noise (sample=True, the default): no exact cold run to match",
}


def generic_key(config: Any) -> str | None:
    """The `GENERIC_FAMILIES` key of a model of `config` (tower-specific first), or None."""
    model_type = getattr(config, "model_type", "")
    vision_type = getattr(getattr(config, "vision_config", None), "model_type", None)
    for key in (f"{model_type}/{vision_type}", model_type):
        if key in GENERIC_FAMILIES:
            return key
    return None
