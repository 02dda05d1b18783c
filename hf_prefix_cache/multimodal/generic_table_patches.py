"""The generic table's families whose media items are spans of flattened patch rows (Kimi-K2.5 on).

One kwarg holds all items' patches one after another: rows of a Qwen-VL-style flattened
patch tensor, an item the ``t * h * w`` rows its grid row counts (``"thw"``), or columns of one
NaViT-packed row, an item the ``h * w`` patches its size counts (``"packed"``). Some of these
families take other kinds as whole rows as well (Nemotron-H Omni's audio clips).
`generic_table` combines these rows with `generic_table_rows` into the one table
`GenericMedia` reads.
"""

from __future__ import annotations

from dataclasses import replace

from hf_prefix_cache.multimodal.generic_rules import (
    CONV_AUDIO,
    IMAGE_ROWS,
    SAMPLE_AUDIO,
    THW_IMAGE,
    THW_VIDEO,
    FamilyRule,
    KindRule,
)


def _grids(stride: tuple[str, ...], pooled_time: bool = False) -> tuple[KindRule, KindRule]:
    """Images and videos as Qwen-VL-style grids of flattened patch rows, both merged by `stride` (`KindRule`'s)."""
    image, video = (replace(kind, stride=stride, pooled_time=pooled_time) for kind in (THW_IMAGE, THW_VIDEO))
    return image, video


#: Images and videos merged by the vision tower's spatial merge size.
_GRID_KINDS = _grids(stride=("vision_config.spatial_merge_size", "vision_config.spatial_merge_size"))
#: Muse Glimmer's (and Muse Spark's) images and videos: a `merge_size` pixel shuffle.
_MUSE_VISION = _grids(stride=("vision_config.merge_size",) * 2)

#: Families whose items are spans of flattened patch rows, keyed as in `generic_table.GENERIC_FAMILIES`.
PATCH_FAMILIES: dict[str, FamilyRule] = {
    # Kimi-K2.5: a MoonViT-style tower on flattened patch rows, attention within each item; a 2x2 merge
    # kernel, a video chunk's frames averaged into one frame's placeholders (each chunk its own run).
    "kimi_k25": FamilyRule(kinds=_grids(("vision_config.merge_kernel_size",), pooled_time=True)),
    # EXAONE 4.5: a Qwen2.5-VL-style tower (windows within each item) on flattened patch rows, 2x2 merge,
    # 1D positions (no M-RoPE); a video is one placeholder run of all its frames.
    "exaone4_5": FamilyRule(kinds=_GRID_KINDS),
    # LLaVA-OneVision-1.5 (transformers 5.25): a RICE-ViT tower on flattened patch rows, attention within each frame
    # (a class token prepended to each), 2x2 merge; 1D positions; a video is one run of all its frames.
    "llava_onevision1_5": FamilyRule(kinds=_GRID_KINDS),
    # HyperCLOVA X Vision V2: a Qwen2.5-VL tower (windows within each item) on flattened patch rows, 2x2 merge;
    # 1D positions (its generate drops position ids, its text model counts them); a video is one run of all its frames.
    "hyperclovax_vision_v2": FamilyRule(kinds=_GRID_KINDS),
    # Muse Glimmer: a windowed tower (windows and attention within each item) on flattened patch rows, a 2x2
    # pixel shuffle (`merge_size`); 1D positions; videos go through the image tower.
    "muse_glimmer": FamilyRule(kinds=_MUSE_VISION),
    # MiniMax-M3-VL: a CLIP-like tower on flattened Conv3d patch rows, attention within each item; 2x2 merge.
    "minimax_m3_vl": FamilyRule(kinds=_GRID_KINDS),
    # LFM3-VL: a conv + attention tower on flattened patch rows, attention within each item; 2x2 merge. Its
    # LFM3 text layers hold conv states, so the hook prefills media prompts itself (suffix embeddings).
    "lfm3_vl": FamilyRule(kinds=_GRID_KINDS, embeds_suffix=True),
    # MiniCPM-o OCR: a NaViT tower (attention within each image) on one packed row of all images' patches,
    # `target_sizes` each image's patch grid, a 2x2 merger: its "4x" mode, the default. In "16x" mode a window
    # merger inside the tower makes an image's features depend on the images packed before it (MiniCPM-V
    # 4.6's default: see `COLD_FAMILIES`): such a model keeps no adapter, and a call overriding
    # `downsample_mode` runs cold. Its Qwen3.5 text layers hold recurrent states, so the hook prefills media
    # prompts itself (suffix embeddings). Videos (frames packed per video, one size for all) are not served:
    # such calls run cold (`media_inputs:pixel_values_videos`).
    "minicpm_ocr": FamilyRule(
        kinds=(
            replace(
                IMAGE_ROWS,
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
            replace(THW_IMAGE, token_id=("image_token_id",), sizes="image_grid_hw", merge_area=4),
            replace(
                CONV_AUDIO,
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
    # Video-LLaMA 3: a SigLIP-style tower on flattened patch rows, attention within each item; each item merges
    # by its own `*_merge_sizes` entry. Videos with a token-compression mask (features dropped by content)
    # are not this pattern: such calls run cold on `media_inputs:video_compression_mask`.
    "video_llama_3": FamilyRule(
        kinds=(
            replace(THW_IMAGE, merges="image_merge_sizes"),
            replace(THW_VIDEO, merges="video_merge_sizes"),
        ),
    ),
    # Muse Spark: Muse Glimmer's vision (a windowed tower on flattened patch rows, attention within each item,
    # a 2x2 pixel shuffle; videos through the image tower; 1D positions), and audio clips as rows of raw
    # samples padded to one length, `input_values_mask` each row's valid samples: a causal-conv tower (no
    # attention) encodes each row on its own, one placeholder per started `patch_sizes`-product of valid samples.
    "muse_spark": FamilyRule(
        kinds=(
            *_MUSE_VISION,
            replace(SAMPLE_AUDIO, mask="input_values_mask", hop=("audio_config.patch_sizes",)),
        ),
    ),
    # Inkling 2 and Inkling 2 Loop: a ViT per image (a class token in front, attention within the image) on one
    # row of merged patches per placeholder, `image_grid_thw` counted in placeholders; 1D positions. Their
    # hybrid text layers hold conv states, so the hook prefills media prompts itself (suffix embeddings).
    **{
        model_type: FamilyRule(
            kinds=(replace(THW_IMAGE, token_id=("image_token_id",), merge_area=1),),
            embeds_suffix=True,
        )
        for model_type in ("inkling2", "inkling2_loop")
    },
    # dots3 Note: Qwen-VL-style image and video grids (a ViT with routed experts per patch, attention within each
    # item, a 2x2 merger); 1D positions. Its audio (`input_features` in chunks) is not served: such calls run cold.
    "dots3_note": FamilyRule(kinds=_GRID_KINDS),
}
