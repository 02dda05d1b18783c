"""The generic table's families whose media items are whole rows of a kwarg: a picture, a tile, a clip.

An item is one leading row of its kind's kwarg (one entry along `KindRule.item_axis`), with
its placeholders counted per row: a fixed number each (``"equal"``), Pixtral-style runs from
its valid size (``"grid"``), its valid NaFlex patches (``"area"``), or its valid audio frames
through the tower's convolutions (``"conv"``). `generic_table` combines these rows with
`generic_table_patches` into the one table `GenericMedia` reads.
"""

from __future__ import annotations

from dataclasses import replace

from hf_prefix_cache.multimodal.generic_rules import (
    CONV_AUDIO,
    IMAGE_ROWS,
    SAMPLE_AUDIO,
    VIDEO_ROWS,
    FamilyRule,
    KindRule,
)

#: `generate` kwargs of LLaVA-like models that change which tower states become features.
_LLAVA_SETTINGS = ("vision_feature_layer", "vision_feature_select_strategy")

#: Pixtral tower: images padded to the prompt's largest, `image_sizes` the valid part; the tower
#: attends within each image only (block-diagonal mask) and reads whole patches.
_PIXTRAL_PATCH = ("vision_config.patch_size",)


def _pixtral(stride: tuple[str, ...]) -> KindRule:
    """Pixtral-tower images: rows of `stride`-pixel placeholders split by a break id, valid sizes in `image_sizes`."""
    return replace(IMAGE_ROWS, count="grid", sizes="image_sizes", stride=stride, patch=_PIXTRAL_PATCH)


def _images(settings: tuple[str, ...] = ()) -> FamilyRule:
    """A family of images alone, one `pixel_values` row each with a fixed number of placeholders."""
    return FamilyRule(kinds=(IMAGE_ROWS,), settings=settings)


#: Mistral 3's layout: a Pixtral tower, a 2x2 patch merger, [IMG] rows split by [IMG_BREAK].
_MISTRAL3 = FamilyRule(kinds=(_pixtral((*_PIXTRAL_PATCH, "spatial_merge_size")),))
#: Granite Speech's audio: a conformer and a Q-Former per clip row, `input_features_mask` marking its outputs.
_GRANITE_SPEECH = FamilyRule(
    kinds=(replace(CONV_AUDIO, mask_per_placeholder=True),), requires=(("has_lora_adapter", False),)
)


#: Families whose items are whole rows, keyed as in `generic_table.GENERIC_FAMILIES`.
ROW_FAMILIES: dict[str, FamilyRule] = {
    # Mistral 3 (Mistral Small 3.x): Pixtral tower, 2x2 patch merger; [IMG] rows split by [IMG_BREAK].
    "mistral3": _MISTRAL3,
    # LLaVA with a Pixtral tower (Pixtral-12B): one placeholder per patch, rows split by [IMG_BREAK].
    # With the "default" strategy the model drops the first patch of all images together: not per item.
    "llava/pixtral": FamilyRule(
        kinds=(_pixtral(_PIXTRAL_PATCH),),
        settings=_LLAVA_SETTINGS,
        requires=(("vision_feature_select_strategy", "full"),),
    ),
    # LightOnOCR: Mistral 3's layout (Pixtral tower, patch merger, [IMG] rows split by [IMG_BREAK]).
    "lighton_ocr": _MISTRAL3,
    # Mistral Large 4: Mistral 3's layout (Pixtral tower, 2x2 patch merger, [IMG] rows split by [IMG_BREAK]).
    "mistral_large4": replace(_MISTRAL3, settings=("vision_feature_layer",)),
    # VipLLaVA: LLaVA with features from several tower layers (`vision_feature_layers`, renamed
    # `vision_feature_layer` in 5.24: both settings); one pixel_values row per image, a fixed count each.
    "vipllava": _images(("vision_feature_layer", "vision_feature_layers")),
    # Video-LLaVA: one tower per kind; an image row is a picture, a video row all its frames.
    "video_llava": FamilyRule(
        kinds=(IMAGE_ROWS, VIDEO_ROWS),
        settings=_LLAVA_SETTINGS,
        # Its image processor returns images as `pixel_values_images` unless told otherwise.
        aliases=(("pixel_values_images", "pixel_values"),),
    ),
    # Voxtral: each row of `input_features` is one 30 s chunk of mel frames, a fixed number of placeholders.
    "voxtral": FamilyRule(kinds=(KindRule("audio", ("audio_token_id", "audio_token_index"), "input_features"),)),
    # GLM-ASR: each row of `input_features` one clip of mel frames, padded to the prompt's longest; its
    # tower attends over the padding too, then keeps the valid frames' features after two convolutions
    # and a 4-frame merge: a clip is its whole row with its mask row.
    "glmasr": FamilyRule(kinds=(replace(CONV_AUDIO, convs=((1, 3, 1), (1, 3, 2), (0, 4, 4))),)),
    # Fuyu: each image patch is embedded on its own (one linear layer) into one placeholder; a prompt's
    # patches are `pixel_values[0]` (rows of an image split by image-newline text ids): every patch an item.
    # Its processor's older name for them, `image_patches`, is read as `pixel_values`.
    "fuyu": FamilyRule(
        kinds=(replace(IMAGE_ROWS, item_axis=1),),
        aliases=(("image_patches", "pixel_values"),),
    ),
    # OmniASR: each row of `input_values` (`[clips, 1, samples]`) one clip of raw samples padded to one
    # length, `padding_mask` its valid samples; a wav2vec-style conv stack (the config's kernels and strides,
    # unpadded) gives its frames, one placeholder each: a clip is its whole row and mask row.
    "omniasr": FamilyRule(
        kinds=(replace(SAMPLE_AUDIO, conv_paths=("audio_config.conv_kernel", "audio_config.conv_stride")),)
    ),
    # VibeVoice ASR: each row of `input_values` (`[clips, 1, samples]`) one clip of raw samples padded to one
    # length, `padding_mask` its valid samples; two causal conv tokenizers (acoustic, semantic) encode each row
    # on its own, one placeholder per started hop of valid samples (the product of the downsampling ratios).
    # Its acoustic latents get random noise unless the call passes `sample=False`: only such calls are served.
    "vibevoice_asr": FamilyRule(
        kinds=(replace(SAMPLE_AUDIO, hop=("acoustic_tokenizer_encoder_config.downsampling_ratios",)),),
        call_requires=(("sample", False),),
    ),
    # InternVL: each row one tile (or video frame) of `image_seq_length` placeholders, pixel-shuffled.
    "internvl": _images(_LLAVA_SETTINGS),
    # Aya Vision: each row one tile, its placeholders after a tile marker; pixel-shuffled per tile.
    "aya_vision": _images(_LLAVA_SETTINGS),
    # Cohere 2 Vision: Aya Vision's tiles, pixel-shuffled per tile.
    "cohere2_vision": _images(),
    # Qianfan-OCR: InternVL's tiles.
    "qianfan_ocr": _images(_LLAVA_SETTINGS),
    # GOT-OCR 2: a SAM-style tower per image, a fixed number of placeholders each.
    "got_ocr2": _images(),
    # PP-Chart2Table: GOT-OCR 2's model under its own config.
    "pp_chart2table": _images(),
    # DeepSeek-VL: a SigLIP tower per image, a fixed number of placeholders each.
    "deepseek_vl": _images(),
    # DeepSeek-VL hybrid: each image twice, a SigLIP tower on `pixel_values` and a SAM-style tower on its
    # `high_res_pixel_values` row, their features joined per image: a fixed number of placeholders each.
    "deepseek_vl_hybrid": FamilyRule(kinds=(replace(IMAGE_ROWS, extras=("high_res_pixel_values",)),)),
    # Janus (text generation; its image-generation mode runs cold: `model_kwarg:generation_mode`): a
    # SigLIP-style tower per image, a fixed number of placeholders each.
    "janus": _images(),
    # Aria: each row one crop with its `pixel_mask` row (the crop's valid pixels); a fixed number of queries each.
    "aria": FamilyRule(kinds=(replace(IMAGE_ROWS, extras=("pixel_mask",)),)),
    # LFM2-VL: a SigLIP 2 NaFlex tower; each row one tile or thumbnail, its patches flattened and padded
    # to one length, `spatial_shapes` its h x w patches and `pixel_attention_mask` its first h * w; 2x2
    # patches per placeholder (framing ids between tiles are text). Its LFM2 text layers hold conv
    # states, so the hook prefills media prompts itself, fed the embeddings the forward would compute.
    "lfm2_vl": FamilyRule(
        kinds=(
            replace(
                IMAGE_ROWS,
                count="area",
                sizes="spatial_shapes",
                stride=("downsample_factor",),
                mask="pixel_attention_mask",
            ),
        ),
        embeds_suffix=True,
    ),
    # Llama 4: each row one tile (the image's tiles, then its global view), one <|patch|> run per tile.
    "llama4": _images(("vision_feature_select_strategy",)),
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
    # Inkling: its vision tower encodes each patch row (`[patches, t, p, p, c]`) on its own into one
    # placeholder, so every row is an item; an audio clip is a row of dMel bin ids (`[clips, frames, bins]`),
    # one placeholder per valid frame (`audio_input_ids_mask`), each frame embedded on its own (hashed
    # whole with its mask). Its hybrid text layers hold conv states, so the hook prefills media prompts
    # itself (suffix embeddings). The processor's `token_type_ids` reach the model and are never read.
    "inkling_mm_model": FamilyRule(
        kinds=(
            KindRule("image", ("image_token_id",), "pixel_values"),
            replace(CONV_AUDIO, data="audio_input_ids", mask="audio_input_ids_mask", frames_axis=1),
        ),
        embeds_suffix=True,
        ignored=("token_type_ids",),
    ),
    # FastVLM: LLaVA with a timm FastViTHD tower (convolutions, then attention within each image); one
    # pixel_values row per image, a fixed number of placeholders each. It takes only the default feature
    # settings: a call naming others runs cold.
    "fast_vlm": _images(_LLAVA_SETTINGS),
    # Perception LM: a timm PE tower encodes each tile (or video frame) on its own, pooled within the tile; each
    # row of `pixel_values` one image's tiles, of `pixel_values_videos` one video's frames, a fixed number each.
    "perception_lm": FamilyRule(
        kinds=(IMAGE_ROWS, VIDEO_ROWS),
    ),
    # Chameleon: a VQ-VAE per image (convolutions and attention within it, a code per latent cell), the codes'
    # text embeddings fill the image's fixed number of placeholders.
    "chameleon": _images(),
    # Step 3.7: each global view a ViT (2-D RoPE, attention within the image) and two stride-2 convolutions, a
    # fixed number of placeholders each. Local crops (`pixel_values_local`: a variable number per image, their
    # features before the image's own) are no whole rows of one kwarg: such calls run cold.
    "step3p7": _images(),
    # Apertus 1.5: each image tokenized at its valid size (`image_sizes`; rows padded to the prompt's largest) by a
    # VQ tokenizer, one code per `spatial_scale_factor` pixels a side, laid out as rows split by an end-of-line
    # id; each clip of `input_values` coded at its valid length (`padding_mask`) by a WavTokenizer encoder, one
    # code per started hop (the product of `upsampling_ratios`). Codes are embedded as text ids.
    "apertus1p5": FamilyRule(
        kinds=(
            replace(IMAGE_ROWS, count="grid", sizes="image_sizes", stride=("vision_config.spatial_scale_factor",)),
            replace(SAMPLE_AUDIO, hop=("audio_config.upsampling_ratios",)),
        ),
    ),
    # Granite Speech: each row of `input_features` one clip of stacked mel frames padded to the prompt's
    # longest; a conformer (block attention and convolutions over the padding too) and a Q-Former over
    # windows of its output encode each row on its own, `input_features_mask` marking the row's outputs
    # that fill its placeholders: a clip is its whole row and mask row. Its generate turns the model's
    # LoRA adapter on only for calls passing audio, so a hit whose suffix holds no clip would run the text
    # without it: models with an adapter (`has_lora_adapter`, the released checkpoints) keep media cold.
    "granite_speech": _GRANITE_SPEECH,
    # Granite Speech Plus: Granite Speech with intermediate encoder layers joined into the projector's input.
    "granite_speech_plus": _GRANITE_SPEECH,
    # Qwen3-ASR: each row of `input_features` (`[clips, mel, frames]`) one clip padded to a multiple of
    # `2 * n_window` frames; the tower cuts rows into chunks of that many frames, three stride-2 convolutions
    # per chunk, keeps each chunk's valid outputs and attends within windows of one clip: a clip is its
    # chunks of valid frames (the padding chunks past them give nothing), whatever a longer clip pads it to.
    "qwen3_asr": FamilyRule(
        kinds=(replace(CONV_AUDIO, convs=((1, 3, 2), (1, 3, 2), (1, 3, 2)), chunk=(2, "audio_config.n_window")),)
    ),
    # Fun-ASR-Nano: each row of `input_features` (`[clips, frames, features]`) one clip padded to the longest,
    # one placeholder per valid frame; its encoder and adaptor mask the padding out of attention and zero it
    # before each FSMN convolution (as the convolution's own zero padding would): a clip is its valid frames.
    "fun_asr_nano": FamilyRule(kinds=(replace(CONV_AUDIO, frames_axis=1, chunk=(1,)),)),
    # Nemotron 3.5 Transcribe: each row of `input_features` (`[clips, frames, mels]`) one clip padded to the
    # longest (a multiple of `subsampling_factor` frames); a speech encoder and a diarization model run on each
    # row on its own, one placeholder per started stack of `subsampling_factor` valid frames. Speaker activity is
    # thresholded, so a clip keys with its padding (its whole row and mask row): a float difference from
    # other padding could flip it. Its Nemotron-H text layers hold states: the hook prefills media prompts.
    "nemo_speechlm": FamilyRule(
        kinds=(replace(CONV_AUDIO, frames_axis=1, hop=("audio_config.subsampling_factor",)),),
        embeds_suffix=True,
    ),
}
