"""What the support matrix feeds a model type besides its text prompt: features, pixels, placeholders.

`support_matrix.scenario` grows one prompt of random text ids (cold, hit, repeat). Most types
take it as `input_ids`; the types listed in `FEEDS` need more to generate at all, built here from
the tiny model's config, the same on every call (seeded):

- encoder-decoder types whose encoder reads audio features, waveforms, pixels or patches get those
  as the encoder input, and the growing prompt as `decoder_input_ids`;
- decoder-only types whose forward needs a medium (BLIP-2, Kosmos-2, Idefics, ...) get it, with its
  placeholder tokens at the head of every prompt, and whatever per-token mask the model reads.

Knows nothing about stores, workers or the document.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

#: Seed of every tensor built here.
SEED = 7


@dataclass(frozen=True)
class Feed:
    """How one model's `generate` is called for a prompt of text ids."""

    #: Ids that lead every prompt (media placeholders), shape (1, n); None: the text alone.
    head: Any = None
    #: The generate keyword the prompt goes to.
    prompt_name: str = "input_ids"
    #: Inputs the same for every prompt (the medium, the encoder's input).
    fixed: dict[str, Any] = field(default_factory=dict)
    #: Inputs that follow the prompt (masks as long as it), from the whole prompt's ids.
    per_prompt: Callable[[Any], dict[str, Any]] | None = None
    #: Whether a later prompt holds the answer (False: its output is no text, so only the text grows).
    answer_in_prompt: bool = True

    def call(self, ids: Any) -> dict[str, Any]:
        """generate's keyword arguments for the whole prompt `ids` (head included)."""
        import torch

        # Fresh tensors per call: some generate methods write into their inputs (BLIP sets BOS in place).
        kwargs: dict[str, Any] = {self.prompt_name: ids.clone()}
        if self.prompt_name == "input_ids":
            kwargs["attention_mask"] = torch.ones_like(ids)
        kwargs.update({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self.fixed.items()})
        if self.per_prompt is not None:
            kwargs.update(self.per_prompt(ids))
        return kwargs


def _randn(*shape: int) -> Any:
    import torch

    return torch.randn(*shape, generator=torch.Generator().manual_seed(SEED))


def _pixels(config: Any, frames: int = 0) -> Any:
    """One image (or `frames` frames) of the vision config's size."""
    size = config.image_size
    size = size if isinstance(size, int) else size[0]
    channels = getattr(config, "num_channels", 3)
    return _randn(1, frames, channels, size, size) if frames else _randn(1, channels, size, size)


def _ids(*ids: int) -> Any:
    import torch

    return torch.tensor([list(ids)])


# --------------------------------------------------------------------------- encoder-decoder inputs


def _encoder(name: str, value: Any) -> Feed:
    return Feed(prompt_name="decoder_input_ids", fixed={name: value})


def _speech_to_text(model: Any) -> Feed:
    c = model.config
    return _encoder("input_features", _randn(1, 32, c.input_feat_per_channel * c.input_channels))


def _mel_encoder(model: Any) -> Feed:
    """Canary, Cohere ASR: log-mel frames of the encoder config's bins, time first."""
    return _encoder("input_features", _randn(1, 64, model.config.encoder_config.num_mel_bins))


def _seamless(model: Any) -> Feed:
    return _encoder("input_features", _randn(1, 32, model.config.feature_projection_input_dim))


def _waveform(name: str) -> Callable[[Any], Feed]:
    """Raw audio (Moonshine, SpeechT5, wav2vec2 encoders): 4,000 samples, a quarter second at 16 kHz."""
    return lambda _model: _encoder(name, _randn(1, 4000))


def _pop2piano(model: Any) -> Feed:
    # Its encoder reads the features as embeddings, after one composer token (see `_name_composers`).
    return _encoder("input_features", _randn(1, 16, model.config.d_model))


def _vision_encoder(model: Any) -> Feed:
    return _encoder("pixel_values", _pixels(model.config.encoder))


def _vision_config_encoder(model: Any) -> Feed:
    """PP-FormulaNet: an image of its vision config's size."""
    return _encoder("pixel_values", _pixels(model.config.vision_config))


def _pix2struct(model: Any) -> Feed:
    """Pix2Struct: 4 x 4 flattened patches, each led by its 1-based row and column."""
    import torch

    width = model.config.vision_config.patch_embed_hidden_size
    rows, cols = torch.meshgrid(torch.arange(1, 5), torch.arange(1, 5), indexing="ij")
    positions = torch.stack([rows.flatten(), cols.flatten()], dim=1).float()
    patches = torch.cat([positions, _randn(16, width)], dim=1)[None]
    return Feed(prompt_name="decoder_input_ids", fixed={"flattened_patches": patches})


def _udop(model: Any) -> Feed:
    """UDOP: a page of 8 words, each with its box (relative x0, y0, x1, y1), and the page image."""
    import torch

    words = torch.arange(8)[None] + 10
    corner = torch.linspace(0.0, 0.8, 8)
    boxes = torch.stack([corner, corner, corner + 0.1, corner + 0.1], dim=-1)[None]
    fixed = {"input_ids": words, "bbox": boxes, "pixel_values": _pixels(model.config)}
    return Feed(prompt_name="decoder_input_ids", fixed=fixed)


# --------------------------------------------------------------------------- decoder-only media inputs


def _blip(model: Any) -> Feed:
    """BLIP: the text decoder cross-attends to the image; its generate sets the first id to BOS."""
    return Feed(fixed={"pixel_values": _pixels(model.config.vision_config)})


def _query_tokens(model: Any) -> Feed:
    """BLIP-2 and its kin: one placeholder per query token, then BOS, lead the prompt."""
    c = model.config
    head = _ids(*[c.image_token_index] * c.num_query_tokens, c.text_config.bos_token_id)
    return Feed(head=head, fixed={"pixel_values": _pixels(c.vision_config)})


def _instructblip(model: Any) -> Feed:
    """InstructBLIP: BLIP-2's placeholders, and the instruction its Q-Former reads (8 ids)."""
    import torch

    base = _query_tokens(model)
    return Feed(head=base.head, fixed={**base.fixed, "qformer_input_ids": torch.arange(10, 18)[None]})


def _instructblip_video(model: Any) -> Feed:
    """InstructBLIP-Video: 4 frames (as its generate assumes), one placeholder per query token per frame."""
    import torch

    c = model.config
    head = _ids(*[c.video_token_index] * c.num_query_tokens * 4, c.text_config.bos_token_id)
    fixed = {"pixel_values": _pixels(c.vision_config, frames=4), "qformer_input_ids": torch.arange(10, 18)[None]}
    return Feed(head=head, fixed=fixed)


def _streaming_audio(model: Any) -> Feed:
    """Voxtral Realtime: audio frames added to the text tokens one for one, as many as 48 tokens need."""
    c = model.config
    frames = 2 * c.downsample_factor * 48  # its embedder halves the frames; each token takes `downsample_factor`
    return Feed(fixed={"input_features": _randn(1, c.audio_config.num_mel_bins, frames)})


def _streaming_codec(model: Any) -> Feed:
    """Kyutai speech-to-text: a waveform its codec cuts into one frame per token, as many as 48 tokens need."""
    return Feed(fixed={"input_values": _randn(1, 1, 48 * model.config.codec_config.frame_size)})


def _kosmos2(model: Any) -> Feed:
    """Kosmos-2: BOS, then one position per latent query, marked by `image_embeds_position_mask`."""
    import torch

    num = model.config.latent_query_num
    head = _ids(model.config.text_config.bos_token_id, *[2] * num)

    def mask(ids: Any) -> dict[str, Any]:
        marked = torch.zeros_like(ids)
        marked[:, 1 : num + 1] = 1
        return {"image_embeds_position_mask": marked}

    return Feed(head=head, fixed={"pixel_values": _pixels(model.config.vision_config)}, per_prompt=mask)


def _idefics(model: Any) -> Feed:
    """Idefics: one image every text token cross-attends to (`image_attention_mask`)."""
    import torch

    pixels = _pixels(model.config.vision_config, frames=1)
    return Feed(
        fixed={"pixel_values": pixels},
        per_prompt=lambda ids: {"image_attention_mask": torch.ones(*ids.shape, 1, dtype=torch.long)},
    )


FEEDS: dict[str, Callable[[Any], Feed]] = {
    # speech seq2seq: the encoder's audio input
    "speech_to_text": _speech_to_text,
    "canary": _mel_encoder,
    "cohere_asr": _mel_encoder,
    "seamless_m4t": _seamless,
    "seamless_m4t_v2": _seamless,
    "moonshine": _waveform("input_values"),
    "speecht5": _waveform("input_values"),
    "speech-encoder-decoder": _waveform("inputs"),
    "pop2piano": _pop2piano,
    "voxtral_realtime": _streaming_audio,
    "kyutai_speech_to_text": _streaming_codec,
    "moonshine_streaming": _waveform("input_values"),
    # text to speech: the prompt is the text its encoder reads; it answers in audio codes, not in text
    "dia": lambda _model: Feed(answer_in_prompt=False),
    # image-text encoder-decoders: the encoder's pixels
    "vision-encoder-decoder": _vision_encoder,
    "pp_formulanet": _vision_config_encoder,
    "pix2struct": _pix2struct,
    "udop": _udop,
    # decoder-only models whose forward needs the medium
    "blip": _blip,
    "blip-2": _query_tokens,
    "kosmos-2": _kosmos2,
    "idefics": _idefics,
    "instructblip": _instructblip,
    "instructblipvideo": _instructblip_video,
}


def feed(model: Any) -> Feed:
    """How the sweep calls `model`'s generate: its model type's entry of `FEEDS`, else text ids alone."""
    make = FEEDS.get(model.config.model_type)
    return make(model) if make is not None else Feed()


def _name_composers(model: Any) -> None:
    """Pop2Piano's generate maps a composer name to a token its encoder reads first; the tiny config names none."""
    size = model.config.composer_vocab_size
    model.generation_config.composer_to_feature_token = {f"composer{i + 1}": i for i in range(size)}


def _end_audio(model: Any) -> None:
    """Dia filters its end-of-audio token per channel and reads its id from the config, where the sweep sets none."""
    model.config.decoder_config.eos_token_id = model.config.decoder_config.vocab_size - 1


def _start_codes(model: Any) -> None:
    """MusicGen's own generate pads its delay pattern with the decoder start id and expands by the number of
    sequences, both read raw from a generation config that leaves them unset (None)."""
    gen = model.generation_config
    gen.decoder_start_token_id, gen.num_return_sequences = model.config.bos_token_id, 1


#: Calls a model needs (besides its inputs) before it can generate at all.
PREPARE: dict[str, Callable[[Any], None]] = {
    "xmod": lambda model: model.set_default_language("en_XX"),
    "pop2piano": _name_composers,
    "dia": _end_audio,
    "musicgen": _start_codes,
    "musicgen_melody": _start_codes,
}
