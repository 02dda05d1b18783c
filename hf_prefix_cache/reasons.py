"""Every reason the store gives, in `stats().fallbacks` and logs, for running cold or reusing less.

The strings are what users see and count on; code names them by these constants only. A
reason with a detail reads ``reason:detail`` (`with_detail`), as in ``model_kwarg:token_type_ids``.

>>> with_detail(MODEL_KWARG, "token_type_ids")
'model_kwarg:token_type_ids'
"""

from __future__ import annotations


def with_detail(reason: str, detail: object) -> str:
    """``reason:detail``: a reason naming what caused it (an argument, a class, a model type)."""
    return f"{reason}:{detail}"


def marks_missing(kwarg: str) -> str:
    """``<kwarg>_missing``: media passed without the processor's token marks (`token_type_ids`, `mm_token_type_ids`)."""
    return f"{kwarg}_missing"


def marks_differ(kwarg: str) -> str:
    """``<kwarg>``: the token marks passed are not exactly the placeholders the processor marks."""
    return kwarg


# --- the model cannot be served at all (model/profile.py)
ENCODER_DECODER = "encoder_decoder"  # an encoder-decoder class no family serves
THINKER_TALKER = "thinker_talker"
MODULE_STATE = "module_state"  # recurrence kept in module attributes (RecurrentGemma)
OWN_CACHE_CLASS = "own_cache_class"
MROPE_POSITIONS = "mrope_positions"  # M-RoPE without an adapter that computes positions
NO_CACHE_ARGUMENT = "no_cache_argument"
NO_CACHE_LAYERS = "no_cache_layers"
UNREADABLE_CACHE_LAYOUT = "unreadable_cache_layout"  # + ":" + the error transformers raised reading it
UNSUPPORTED_LAYER = "unsupported_layer"  # + ":" + the cache layer class
CROSS_ATTENTION_LAYER = "cross_attention_layer"  # + ":" + the cache layer class
# types the support matrix found failing or inexact (model/profile.py names them per type)
WINDOW_MASK_MISMATCH = "window_mask_mismatch"
CACHE_LONGER_THAN_PROMPT = "cache_longer_than_prompt"
NGRAM_CACHE_LAYOUT = "ngram_cache_layout"
# The class overrides `generate` with a loop of its own that does not continue a cache prefix as transformers' does
# (MusicGen's codebook delay pattern, DiffusionGemma's block diffusion, which draws noise for whole blocks).
OWN_GENERATE = "own_generate"
# The model runs its layers more than once per token, each pass with cache layers of its own (Dory's looped block):
# a restored prefix was 1.7e-4 off a cold run on the support matrix's tiny model.
LOOPED_LAYERS = "looped_layers"
# A sparse-attention indexer whose keys are not the width its config names (GLM-5-Next: rotary channels beside
# `index_head_dim`), so the store cannot split them off its stored values.
INDEXER_LAYOUT = "indexer_layout"
SLICES_ITS_OWN_INPUT = "slices_its_own_input"  # the forward drops the cached ids itself and masks by its own lengths
BIDIRECTIONAL_ATTENTION = "bidirectional_attention"  # a BERT-style causal LM without config.is_decoder=True

# --- the call's arguments (hooks/checks.py)
INPUTS_EMBEDS = "inputs_embeds"
NO_INPUT_IDS = "no_input_ids"
NO_INPUT_FEATURES = "no_input_features"
EMPTY_PROMPT = "empty_prompt"
# A sparse-attention indexer (DeepSeek-V3.2, GLM-5, Mistral Large 4, ...) keeps its top-k keys by score once a
# prompt is longer than k; which of two tied scores it keeps depends on how many queries one call holds, so the
# suffix's prefill can pick other keys than the whole prompt's. Up to k every key is kept and reuse is exact.
INDEXER_TOP_K = "indexer_top_k"  # + ":" + the length up to which reuse is exact
# Where the indexers can be watched (`model/indexer_ties.py`), prompts of any length are served; a query whose k-th
# and (k+1)-th best scores tie (to float noise) in the prompt's suffix runs the request cold, and a tie in a cold
# prefill or a decode step stores the states only up to it (counted as reduced reuse).
INDEXER_TIE = "indexer_tie"
# A media item keyed with padding its model reads (Phi-4 audio: a clip padded to a later, longer one) where the
# store holds it padded otherwise or unpadded: reuse stops at it, since the model's output for it changed, though
# the stored prefix goes on (reduced reuse).
MEDIA_PADDING = "media_padding"
# A static cache's sliding-window layer (`cache_implementation="static"` on Gemma, Mistral, ...) keeps only its last
# `window` positions: a call that wrote past the window was served, but its sequence cannot be copied out to store
# (reduced reuse; the prefix it restored stays stored).
STATIC_WINDOW = "static_window"
# A padded batch restores every row to one column (the cache holds as many columns in each row): a row whose stored
# prefix reaches past that column (another row brings less, or nothing, before it) reuses only up to it
# (reduced reuse).
BATCH_LAYOUT = "batch_layout"
BATCH_SIZE = "batch_size"  # a batch of rows where the family restores one row only
PADDING = "padding"  # a padded row (zeros in its attention mask) where the family keys unpadded rows only
ATTENTION_MASK_SHAPE = "attention_mask_shape"  # an attention mask that is not the shape of its ids
EXPLICIT_POSITION_IDS = "explicit_position_ids"  # `position_ids` passed, which a key of token ids does not cover
ENCODER_OUTPUTS = "encoder_outputs"  # `encoder_outputs` passed where the family keys the encoder's input
MODEL_KWARG = "model_kwarg"  # + ":" + the kwarg
ENCODER_KWARG = "encoder_kwarg"  # + ":" + the kwarg
DECODER_KWARG = "decoder_kwarg"  # + ":" + the kwarg
ASSISTED_DECODING = "assisted_decoding"  # an assistant model, where the hook serves no assisted decoding
CUSTOM_GENERATE = "custom_generate"  # a hub `custom_generate` loop, which need not continue a cache prefix
NEGATIVE_PROMPT = "negative_prompt"  # `negative_prompt_ids`: a second prompt, which no key covers
BEAM_SEARCH = "beam_search"  # `num_beams > 1` where the hook does not expand a restored row
NUM_RETURN_SEQUENCES = "num_return_sequences"  # `num_return_sequences > 1`, likewise
USE_CACHE_FALSE = "use_cache_false"  # `use_cache=False`: no cache to restore into
CACHE_IMPLEMENTATION = "cache_implementation"  # + ":" + the implementation
OUTPUT_ATTENTIONS = "output_attentions"  # attentions asked for: a hit skips the positions (or encoder) they cover
OUTPUT_HIDDEN_STATES = "output_hidden_states"  # hidden states asked for, likewise
# Whisper's own settings
RETURN_TIMESTAMPS = "return_timestamps"
RETURN_TOKEN_TIMESTAMPS = "return_token_timestamps"
NO_SPEECH_THRESHOLD = "no_speech_threshold"
TEMPERATURE_FALLBACK = "temperature_fallback"
LONG_FORM = "long_form"
RETURN_SEGMENTS = "return_segments"
MONITOR_PROGRESS = "monitor_progress"
WHISPER_SEGMENTS = "whisper_segments"  # the request looped into a second segment: rerun cold

# A drafting call of an assistant model inside an assisted `generate` of the main model (transformers passes it a
# `generation_config` with `is_assistant=True`): an assistant's own store serves its own `generate` calls, not these.
ASSISTANT_DRAFTING = "assistant_drafting"

# --- media (multimodal/ and the decoder-only hook)
MEDIA_INPUTS = "media_inputs"  # + ":" + the model type without an adapter, or the kwarg it does not handle
MEDIA_BATCH = "media_batch"
MEDIA_RECURRENT = "media_recurrent"  # media on a model with state layers, of a family with no suffix embeddings
MEDIA_PROMPT_END = "media_prompt_end"  # the same, served family: a placeholder last, which generate feeds alone
MEDIA_PLACEHOLDERS = "media_placeholders"
UNHASHABLE_MEDIA = "unhashable_media"
MROPE_BATCH = "mrope_batch"
PREFIX_LM_BATCH = "prefix_lm_batch"
PREFIX_LM = "prefix_lm"  # a prefix-LM prompt the adapter cannot key (no token type marks)
MEDIA_MIXED_PATCHING = "media_mixed_patching"
IMAGES_AND_VIDEOS = "images_and_videos"  # both in one prompt, which the model itself cannot run (GLM-4V)
CROSS_ATTENTION_MASK = "cross_attention_mask"  # not the processor's mask (Mllama)
VISION_SETTINGS = "vision_settings"  # + ":" + the per-call setting that changes how media encode
# + ":" + the kwarg: a call with media left a setting that makes its encoder draw random noise (VibeVoice ASR's
# `sample`, True by default), so no cold run of the prompt repeats another and no reuse can be exact.
MEDIA_RANDOM = "media_random"

# --- the request ran, but cold or with less reuse
OUT_OF_MEMORY = "out_of_memory"
CROSS_ATTENTION_NEW_IMAGE = "cross_attention_new_image"  # new images end the sharing of a conversation (Mllama)
REMOTE_UNAVAILABLE = "remote_unavailable"  # the shared tier could not be asked; local tiers served

# --- an exactness guard failed (`errors.InconsistentStateError`): never a wrong answer, logged once at WARNING
# A stored prefix (or the key, or a state prefilled for it) disagreed with what the restore planned: the call ran cold.
INCONSISTENT_RESTORE = "inconsistent_restore"
# The states a finished request would store disagree with its sequence: its answer stands, nothing is stored.
INCONSISTENT_CAPTURE = "inconsistent_capture"

# --- an insert stored nothing (counted under fallbacks too)
ENTRY_BELOW_MIN_STORE_LEN = "entry_below_min_store_len"
NON_FINITE_STATES = "non_finite_states"
ENTRY_OVER_BUDGET = "entry_over_budget"

# --- the batching engine (`batching/`): a request that ran alone through `generate` instead of in the running batch
# + ":" + why: `model` (its profile cannot lay rows side by side), `media` or `mrope` (a media family, plain or
# M-RoPE, not shown exact batched: `batching/eligibility.py`), `setting` + "_" + the setting's name (one
# `batching/sampling.py` does not implement), or `cold` (its prefill through the store ran cold).
BATCH_ALONE = "batch_alone"
