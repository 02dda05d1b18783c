"""The call's checks: which `generate` calls can reuse safely (else the reason), and the prompt read to the host.

The rules every family shares: the refused arguments, the decoding settings
(`GenerationSettings`), the cache implementation and the outputs a hit could not reproduce, each
returning a reason from `reasons.py` or None; the prompt's one read of the device (`read_prompt`:
its ids as `TokenIds`, its mask's left padding). Each family's hook checks its own inputs (token
ids, audio features, encoder kwargs) with them; the decoder-only hook's own checks are here too:
`check_call` runs its step 1 in one pass, and `media_layout` keys a prompt's media items, or says
why they cannot be keyed.
"""

from __future__ import annotations

import functools
import inspect
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from numpy.typing import NDArray
from transformers import GenerationConfig

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import UnhashableMediaError
from hf_prefix_cache.hooks.media_expansion import expands_media
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.token_ids import TokenIds

logger = logging.getLogger("hf_prefix_cache")

#: Arguments no family serves, with the reason counted. `encoder_outputs` is refused by the
#: encoder-keyed families only: for decoder-only models it is a media or model kwarg like others.
REFUSED_ARGUMENTS: Mapping[str, str] = {
    "inputs_embeds": reasons.INPUTS_EMBEDS,
    "decoder_inputs_embeds": reasons.INPUTS_EMBEDS,
    "position_ids": reasons.EXPLICIT_POSITION_IDS,
    "decoder_position_ids": reasons.EXPLICIT_POSITION_IDS,
    "assistant_model": reasons.ASSISTED_DECODING,
    "custom_generate": reasons.CUSTOM_GENERATE,
    "negative_prompt_ids": reasons.NEGATIVE_PROMPT,
}
ENCODER_ARGUMENTS: Mapping[str, str] = {"encoder_outputs": reasons.ENCODER_OUTPUTS}

CACHE_IMPLEMENTATION = "cache_implementation"


@dataclass(frozen=True, slots=True)
class Modes:
    """The decoding modes a hook serves on a restored cache, beyond one sequence per prompt row.

    `expands`: beam search and several returned sequences (`generate` copies each prompt row;
    the hook restores the prefix into every copy). `assisted`: assisted and prompt-lookup
    decoding, whose rejected candidates `generate` crops off the working cache.
    """

    expands: bool = False
    assisted: bool = False


#: The settings every family reads: `GenerationSettings` reads each once, when the call's settings are made.
SETTINGS = (
    "num_beams",
    "num_return_sequences",
    "use_cache",
    "prompt_lookup_num_tokens",
    "assistant_early_exit",
    CACHE_IMPLEMENTATION,
    "output_attentions",
    "output_hidden_states",
    "return_dict_in_generate",
    "max_new_tokens",
    "max_length",
    "max_cache_len",
    "pad_token_id",
    "eos_token_id",
    # Whisper's own (`whisper.py`).
    "return_timestamps",
    "return_token_timestamps",
    "no_speech_threshold",
)
# Cache implementations `generate` builds a `StaticCache` for ("hybrid" too, when the call asks for it).
_STATIC_IMPLEMENTATIONS = ("static", "sliding_window")


class GenerationSettings:
    """A call's generation settings as `generate` will see them: kwarg, then the passed config, then the model's.

    Each setting of `SETTINGS` is a plain attribute, read once when the settings are made (a call
    does not change them), and so are the facts the checks derive from them: `expand`, `assisted`,
    `static` and `is_plain`. A family that reads another setting adds its name to `SETTINGS`.

    >>> from types import SimpleNamespace
    >>> from transformers import GenerationConfig
    >>> model = SimpleNamespace(generation_config=GenerationConfig(num_beams=2))
    >>> settings = GenerationSettings(model, None, {"num_return_sequences": 3})
    >>> settings.num_beams, settings.expand, settings.is_plain
    (2, 3, False)
    """

    __slots__ = (*SETTINGS, "expand", "assisted", "static", "is_plain", "_passed", "_kwargs")

    # The settings (as a config or kwarg holds them; None where none sets them).
    num_beams: Any
    num_return_sequences: Any
    use_cache: Any
    prompt_lookup_num_tokens: Any
    assistant_early_exit: Any
    cache_implementation: Any
    output_attentions: Any
    output_hidden_states: Any
    return_dict_in_generate: Any
    max_new_tokens: Any
    max_length: Any
    max_cache_len: Any
    pad_token_id: Any
    eos_token_id: Any
    return_timestamps: Any
    return_token_timestamps: Any
    no_speech_threshold: Any
    #: How many rows `generate` makes of each prompt row: beams or returned sequences, whichever is more.
    expand: int
    #: Prompt-lookup or early-exit assisted decoding (an assistant model is an argument of `generate`, not a setting).
    assisted: bool
    #: The `StaticCache` implementation `generate` will build, or None: ``"static"``, or a deprecated name it builds
    #: the same cache for (``"sliding_window"``; ``"hybrid"`` when the call asks for it, since `generate` drops a
    #: model's default ``"hybrid"`` and decodes on a dynamic cache).
    static: str | None
    #: One sequence per row on `generate`'s own cache, no extra outputs: none of the rules below
    #: (`decoding_problem`, `cache_implementation_problem`, `output_problem`) can refuse such settings,
    #: so a check may skip them. A new rule must keep this true.
    is_plain: bool

    def __init__(self, model: Any, generation_config: Any, kwargs: Mapping[str, Any]) -> None:
        default = model.generation_config
        configs = (generation_config, default) if generation_config is not None else (default,)
        self._passed = generation_config
        self._kwargs = kwargs
        for name in SETTINGS:
            # A kwarg given (even None), else the first config that sets it (not None).
            value = kwargs.get(name)
            if value is None and name not in kwargs:
                for config in configs:
                    value = getattr(config, name, None)
                    if value is not None:
                        break
            setattr(self, name, value)
        self.expand = max(self.num_beams or 1, self.num_return_sequences or 1)
        self.assisted = self.prompt_lookup_num_tokens is not None or self.assistant_early_exit is not None
        impl = self.cache_implementation
        self.static = None
        if impl in _STATIC_IMPLEMENTATIONS or (impl == "hybrid" and self.explicit(CACHE_IMPLEMENTATION) == impl):
            self.static = str(impl)
        self.is_plain = (
            self.expand == 1
            and not self.assisted
            and self.use_cache is not False
            and impl is None
            and not self.output_attentions
            and not self.output_hidden_states
        )

    def explicit(self, name: str) -> Any:
        """The setting if this call asked for it (kwarg or passed config), ignoring the model's defaults."""
        if name in self._kwargs:
            return self._kwargs[name]
        return getattr(self._passed, name, None)


def refused_argument(given: Mapping[str, Any], encoder_keyed: bool = False, modes: Modes = Modes()) -> str | None:
    """The reason for the first refused argument given (not None) in `given`, or None.

    An assistant model is served where `modes.assisted` says so.
    """
    for name, reason in REFUSED_ARGUMENTS.items():
        if name == "assistant_model" and modes.assisted:
            continue
        if given.get(name) is not None:
            return reason
    if encoder_keyed:
        for name, reason in ENCODER_ARGUMENTS.items():
            if given.get(name) is not None:
                return reason
    return None


def decoding_problem(config: GenerationSettings, modes: Modes = Modes()) -> str | None:
    """Why these decoding settings cannot run on a restored cache (beams, several sequences, no cache,
    assisted decoding) with the hook's `modes`, or None."""
    if (config.num_beams or 1) > 1 and not modes.expands:
        return reasons.BEAM_SEARCH
    if (config.num_return_sequences or 1) > 1 and not modes.expands:
        return reasons.NUM_RETURN_SEQUENCES
    if config.use_cache is False:
        return reasons.USE_CACHE_FALSE
    if config.assisted and not modes.assisted:
        return reasons.ASSISTED_DECODING
    return None


def expand_size(config: GenerationSettings) -> int:
    """How many rows `generate` makes of each prompt row: beams or returned sequences, whichever is more."""
    return config.expand


def cache_implementation_problem(config: GenerationSettings, served: frozenset[str]) -> str | None:
    """Why the call's cache implementation rules the store out, or None.

    transformers refuses a passed cache beside any `cache_implementation`, the model's default
    included (hub configs name one). Those in `served` the hook drops from the call (the working
    cache is one); a model-default ``"hybrid"`` (Gemma) yields to a passed cache; anything else is
    another cache and runs cold.
    """
    impl = config.cache_implementation
    if impl is None or impl in served or (impl == "hybrid" and config.explicit(CACHE_IMPLEMENTATION) is None):
        return None
    return reasons.with_detail(reasons.CACHE_IMPLEMENTATION, impl)


def output_problem(config: GenerationSettings) -> str | None:
    """Attentions or hidden states asked for: a hit skips the positions (or the encoder) they would cover."""
    if config.output_attentions:
        return reasons.OUTPUT_ATTENTIONS
    if config.output_hidden_states:
        return reasons.OUTPUT_HIDDEN_STATES
    return None


def ids_problem(ids: Any) -> str | None:
    """Why `ids` are not one row of integer token ids, or None."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return reasons.NO_INPUT_IDS
    if ids.shape[0] != 1:
        return reasons.BATCH_SIZE
    return None


def mask_problem(mask: Any, ids: torch.Tensor) -> str | None:
    """Why an attention mask for `ids` would change what the key covers (a shape mismatch, padding), or None."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor) or mask.shape != ids.shape:
        return reasons.ATTENTION_MASK_SHAPE
    if not bool((mask == 1).all()):
        return reasons.PADDING
    return None


class Prompt(NamedTuple):
    """A prompt read to the host: each row's tokens after its left padding, that padding, and why to run cold."""

    rows: list[TokenIds]
    pads: tuple[int, ...]
    reason: str | None


def read_prompt(input_ids: torch.Tensor, mask: Any, config: Any) -> Prompt:
    """The prompt's rows on the host with their left padding, and why its mask or pad tokens would change
    what the key covers (or None).

    A mask of zeros then ones in every row is left padding: each row's tokens start after its zeros
    (`pads`). Any other mask with zeros (right or inner padding, other values) is `padding`, and so are
    pad tokens without a mask (transformers would infer a mask from them). One read of the device: the
    ids and the mask travel together (one concatenation) and are checked on the host copy.

    >>> read_prompt(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0, 1], [1, 1]]), None)
    Prompt(rows=[(6,), (7, 8)], pads=(1, 0), reason=None)
    >>> read_prompt(torch.tensor([[5, 6]]), torch.tensor([[1, 0]]), None).reason
    'padding'
    """
    num_rows, width = input_ids.shape[0], input_ids.shape[-1]
    none = (0,) * num_rows
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        return Prompt(rows_of(read_to_host(input_ids).tobytes(), num_rows), none, reasons.ATTENTION_MASK_SHAPE)
    if mask is None:
        host = read_to_host(input_ids)
        pad = getattr(config, "pad_token_id", None)  # transformers infers a mask only from a pad token it knows
        return Prompt(
            rows_of(host.tobytes(), num_rows),
            none,
            reasons.PADDING if pad is not None and _has_pad(host, pad, config) else None,
        )
    if mask.is_floating_point() or mask.is_complex():
        mask = torch.where(mask == 0, 0, torch.where(mask == 1, 1, 2))  # 2: any other value (a rare mask's dtype)
    # The mask's rows below the ids' rows, as int64: one concatenation, one read.
    host = read_to_host(torch.cat([input_ids.to(torch.int64), mask.to(input_ids.device, torch.int64)]))
    data, size = host[:num_rows].tobytes(), 8 * num_rows * width
    if width and _ones(size).startswith(host.data.cast("B")[size:]):  # a mask of ones: one memcmp, in place
        return Prompt(rows_of(data, num_rows), none, None)
    marks = host[num_rows:]
    # Zeros then ones: each row equals its count of zeros in zeros, then ones (any other value, or a zero after a
    # one, differs).
    pads = (marks == 0).sum(1)
    row_pads = tuple(pads.tolist())
    if not (marks == (np.arange(width) >= pads[:, None])).all() or max(row_pads) >= width:
        return Prompt(rows_of(data, num_rows), none, reasons.PADDING)  # not left padding, or a row with no token at all
    full = rows_of(data, num_rows)
    return Prompt([row[p:] for row, p in zip(full, row_pads, strict=True)], row_pads, None)  # type: ignore[misc]


def read_to_host(ids: torch.Tensor) -> NDArray[np.int64]:
    """Integer `ids` as int64 on the host, in one read (`.cpu()`; the array shares a CPU tensor's memory)."""
    host = ids.to(torch.int64).cpu()
    # The unpatched `numpy`: `keys/weights.py` records `.numpy()` aliases, which only parameters need.
    array: NDArray[np.int64] = torch._C.TensorBase.numpy(host)
    return array


def rows_of(data: bytes, num_rows: int) -> list[TokenIds]:
    """`num_rows` rows of int64 ids, one after the other in `data` (a host array's `tobytes()`), as `TokenIds`:
    no Python int is made.

    >>> rows_of(np.array([[5, 6], [7, 8]]).tobytes(), 2)[1][1:]
    (8,)
    """
    if num_rows == 1:
        return [TokenIds.from_bytes(data)]
    width = len(data) // num_rows
    return [TokenIds.from_bytes(data[i * width : (i + 1) * width]) for i in range(num_rows)]


@functools.lru_cache(maxsize=4)
def _ones(nbytes: int) -> bytes:
    """`nbytes` bytes of int64 ones (native order), to compare a mask with (kept for a few prompt sizes)."""
    return _ONE * (nbytes // 8)


_ONE = np.ones(1, np.int64).tobytes()


def token_rows(ids: torch.Tensor) -> list[TokenIds]:
    """The rows of integer `ids` as `TokenIds`, read to the host once.

    >>> token_rows(torch.tensor([[5, 6], [7, 8]]))[1][1:]
    (8,)
    """
    return rows_of(read_to_host(ids).tobytes(), ids.shape[0])


def _has_pad(host: NDArray[np.int64], pad: Any, config: Any) -> bool:
    """`infers_padding` on ids already on the host (`host`), for the pad token `pad` of `config`."""
    eos = config.eos_token_id
    if pad in (eos if isinstance(eos, list) else [eos]):
        return False
    if isinstance(pad, int) and -(2**63) <= pad < 2**63:
        return bool((host == pad).any())
    return any(pad in row for row in rows_of(host.tobytes(), len(host)))


def infers_padding(input_ids: torch.Tensor, config: Any) -> bool:
    """Whether transformers would infer an attention mask with zeros from pad tokens in the prompt."""
    pad, eos = config.pad_token_id, config.eos_token_id
    if pad is None:
        return False
    eos_ids = eos if isinstance(eos, list) else [eos]
    return pad not in eos_ids and bool((input_ids == pad).any())


# ------------------------------------------------------------------ the decoder-only hook's step 1
# Generation settings (they steer decoding, not the prompt's states).
_GENERATION_FIELDS = frozenset(GenerationConfig().to_dict())  # type: ignore[no-untyped-call]
# Other generate kwargs the key covers (ids, an all-ones mask) or that leave states alone.
_KEYED_OR_HARMLESS = frozenset(
    {"input_ids", "attention_mask", "logits_to_keep", "tokenizer", "assistant_tokenizer", "use_model_defaults"}
)
# Cache implementations served on the working cache (dropped from the call); a static one (`GenerationSettings.static`)
# where the model's layers have a plain static form (`model/static.py`), for one prompt row decoded one sequence at a
# time.
_SERVED_IMPLEMENTATIONS = frozenset({"dynamic"})

# The names each check of the call's names looks for: a call that gives none of them skips that check (a set test),
# which would find nothing.
_REFUSED_NAMES = frozenset(REFUSED_ARGUMENTS)
_MEDIA_NAMES = frozenset(MEDIA_KWARGS)
_PLAIN_KWARGS = _GENERATION_FIELDS | _KEYED_OR_HARMLESS  # `_model_kwarg` passes over these


class Checked(NamedTuple):
    """What step 1 found: the call's settings and prompt (each row after its left padding, that padding) and why
    it runs cold (None: it may reuse). A call refused before its prompt is read has no settings and no rows."""

    settings: GenerationSettings | None
    rows: list[TokenIds]
    pads: tuple[int, ...]
    reason: str | None


def check_call(
    profile: ModelProfile,
    model: Any,
    signature: inspect.Signature,
    input_ids: Any,
    arguments: dict[str, Any],
    kwargs: dict[str, Any],
) -> Checked:
    """Step 1 of a decoder-only call in one pass: its settings and prompt, and the first reason it cannot reuse
    safely (None: it may reuse).

    The checks, in the order their reasons are counted:

    1. the model (`profile.unsupported`);
    2. arguments no family serves (`refused_argument`);
    3. the ids: one 2-D integer tensor of rows this model serves together (`_ids_problem`);
    4. media kwargs (`_media_problem`);
    5. model kwargs the key does not cover (`_model_kwarg`);
    6. decoding, cache-implementation and output settings (`_settings_problem`);
    7. the mask and pad tokens, read to the host with the ids (`read_prompt`).

    Checks 2, 4 and 5 run only when the call gives a name they look for, and 6 only when the settings
    are not plain (`GenerationSettings.is_plain`): a plain call (ids, a mask, generation settings)
    reads its settings, its ids and its prompt, and nothing else.
    """
    if profile.unsupported is not None:
        return _refused(profile.unsupported)
    if not (_REFUSED_NAMES.isdisjoint(kwargs) and _REFUSED_NAMES.isdisjoint(arguments)):
        problem = refused_argument({**kwargs, **arguments}, modes=serving_modes(profile))
        if problem is not None:
            return _refused(problem)
    problem = _ids_problem(profile, input_ids)
    if problem is None and not _MEDIA_NAMES.isdisjoint(kwargs):
        problem = _media_problem(profile, model, input_ids, kwargs)
    if problem is None and not kwargs.keys() <= _PLAIN_KWARGS:
        passed = _model_kwarg(profile, signature, kwargs)
        if passed is not None:
            # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
            problem = reasons.with_detail(reasons.MODEL_KWARG, passed)
    if problem is not None:
        return _refused(problem)
    settings = GenerationSettings(model, arguments.get("generation_config"), kwargs)
    if not settings.is_plain:
        problem = _settings_problem(profile, model, kwargs, settings)
        if problem is not None:
            return _refused(problem)
    # The one read of the device before the prefill: ids, mask and pad tokens.
    prompt = read_prompt(input_ids, kwargs.get("attention_mask"), settings)
    return Checked(settings, prompt.rows, prompt.pads, prompt.reason)


def _refused(reason: str) -> Checked:
    return Checked(None, [], (), reason)


def serving_modes(profile: ModelProfile) -> Modes:
    """The decoding modes this model is served in: expanded rows where its layers keep every position or its
    rows' recurrent states can be joined (`recurrent_rows.py`), assisted decoding where transformers' `crop`
    keeps them exact (and `generate` slices the prompt): for recurrent states (from transformers 5.25), only where
    the states are the cache's own (not a model's own cache class or module-kept states, which `crop` cannot
    roll back), a multi-token forward continues them, and the mixer's chunked and one-token states agree
    (`ModelProfile.assists_exactly`)."""
    expands = profile.expands or profile.joins_rows
    own_states = profile.own_cache is None and not profile.single_token_steps and profile.assists_exactly
    assisted = profile.is_croppable and profile.prompt_sliced and (own_states or not profile.has_recurrence)
    return Modes(expands=expands, assisted=assisted)


def _ids_problem(profile: ModelProfile, input_ids: Any) -> str | None:
    """Ids that are not one 2-D integer tensor, or rows this model cannot serve in a batch."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.is_floating_point():
        return reasons.NO_INPUT_IDS
    if input_ids.shape[0] != 1 and profile.has_state and not profile.joins_rows:
        # Window states and states beside media are restored for one row only.
        return reasons.BATCH_SIZE
    if input_ids.shape[1] == 0:
        return reasons.EMPTY_PROMPT
    if profile.exact_prompt_len is not None and input_ids.shape[1] > profile.exact_prompt_len:
        return reasons.with_detail(reasons.INDEXER_TOP_K, profile.exact_prompt_len)
    media = profile.media
    if input_ids.shape[0] != 1 and media is not None and (media.has_positions or media.whole_prompt_only):
        # Positions and prompt-wide namespaces are computed for one row.
        return reasons.MROPE_BATCH if media.has_positions else reasons.PREFIX_LM_BATCH
    return None


def _media_problem(profile: ModelProfile, model: Any, input_ids: torch.Tensor, kwargs: dict[str, Any]) -> str | None:
    """Media kwargs this model's adapter does not handle, or cannot serve in this call."""
    media = profile.media
    media_names = [name for name in MEDIA_KWARGS if kwargs.get(name) is not None]
    if media is None and media_names == ["token_type_ids"]:
        media_names = []  # a text model's segment ids (GPT-2): a model kwarg like any other, refused below
    if not media_names:
        return None
    if media is None:
        return reasons.with_detail(reasons.MEDIA_INPUTS, getattr(model.config, "model_type", None))
    unknown = [name for name in media_names if name not in media.handled]
    if unknown:
        return reasons.with_detail(reasons.MEDIA_INPUTS, unknown[0])
    if input_ids.shape[0] != 1:
        return reasons.MEDIA_BATCH
    if profile.has_state and not media.embeds_suffix:
        return reasons.MEDIA_RECURRENT
    return None


def _model_kwarg(profile: ModelProfile, signature: inspect.Signature, kwargs: dict[str, Any]) -> str | None:
    """The first kwarg that `generate` would hand the model and the key does not cover, or None."""
    media = profile.media
    handled = media.handled | set(media.settings) if media is not None else frozenset()
    for name, value in kwargs.items():
        if value is None or name in _KEYED_OR_HARMLESS or name in handled or name in _GENERATION_FIELDS:
            continue
        if name in signature.parameters:
            continue
        return name
    return None


def _settings_problem(
    profile: ModelProfile, model: Any, kwargs: dict[str, Any], settings: GenerationSettings
) -> str | None:
    """Decoding, cache-implementation and output settings a hit could not reproduce."""
    served = _SERVED_IMPLEMENTATIONS
    if settings.static is not None and profile.serves_static and settings.expand == 1 and not settings.assisted:
        served = served | {settings.static}  # one sequence per prompt row: the static path copies one row's prefix
    problem = decoding_problem(settings, serving_modes(profile)) or cache_implementation_problem(settings, served)
    if problem is not None:
        return problem
    if settings.expand > 1 and _has_media(profile, kwargs) and not expands_media(model):
        # generate copies such media item by item ([A, B] -> [A, A, B, B]), not whole per row (`media_expansion.py`).
        return reasons.MEDIA_BATCH
    if settings.return_dict_in_generate and (problem := output_problem(settings)) is not None:
        return problem
    return None


def _has_media(profile: ModelProfile, kwargs: dict[str, Any]) -> bool:
    return profile.media is not None and any(kwargs.get(name) is not None for name in profile.media.handled)


def media_layout(
    profile: ModelProfile, rows: Sequence[Sequence[int]], kwargs: dict[str, Any]
) -> tuple[MediaLayout | None, str | None]:
    """The prompt's media items (None for a model without media handling), or why to run cold."""
    media = profile.media
    if media is None:
        return None, None
    reason = media.why_cold(rows[0], kwargs)
    if reason is not None:
        return None, reason
    try:
        layout = media.layout(rows[0], kwargs)
    except UnhashableMediaError as err:
        logger.debug("media not hashable: %s", err)
        return None, reasons.UNHASHABLE_MEDIA
    if layout is None:
        return None, reasons.MEDIA_PLACEHOLDERS
    if profile.has_state and layout.items and layout.items[-1].end >= len(rows[0]):
        # The prefill stops before the last token and generate feeds it alone, with no media.
        return None, reasons.MEDIA_PROMPT_END
    return layout, None
