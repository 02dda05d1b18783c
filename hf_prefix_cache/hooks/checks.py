"""The call's checks and keys: steps 1 and 2 of a decoder-only call, read into a `Call` (`call.py`).

`GenerationSettings` reads a call's settings once and `ids_problem` checks its ids (the
encoder-decoder hooks too); `read_prompt` reads the prompt from the device once; `check_call`
runs step 1 with them and `refusals.py`; `read_call` then decides the mode (`decide_mode`) and
keys each row. A plain hit runs all of this in this one module.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from numpy.typing import NDArray

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks import refusals
from hf_prefix_cache.hooks.call import MODE_TABLE, Call, Mode, Row
from hf_prefix_cache.hooks.media import prompt_layout, prompt_namespace
from hf_prefix_cache.hooks.pipeline import Cold, guard_failed, read_to_host, token_rows
from hf_prefix_cache.hooks.refusals import CACHE_IMPLEMENTATION, SETTINGS, Settings
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal import MEDIA_KWARGS
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.store.contract import Store
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds, eos_ids

# Cache implementations `generate` builds a `StaticCache` for ("hybrid" too, when the call asks for it).
_STATIC_IMPLEMENTATIONS = ("static", "sliding_window")


class GenerationSettings(Settings):
    """A call's generation settings as `generate` will see them (kwarg, passed config, model's), each read once.

    >>> from types import SimpleNamespace
    >>> from transformers import GenerationConfig
    >>> model = SimpleNamespace(generation_config=GenerationConfig(num_beams=2))
    >>> settings = GenerationSettings(model, None, {"num_return_sequences": 3})
    >>> settings.num_beams, settings.expand, settings.is_plain
    (2, 3, False)
    """

    __slots__ = (*SETTINGS, "expand", "assisted", "static", "is_plain", "_passed", "_kwargs")

    #: How many rows `generate` makes of each prompt row: beams or returned sequences, whichever is more.
    expand: int
    #: Prompt-lookup or early-exit assisted decoding (an assistant model is an argument of `generate`, not a setting).
    assisted: bool
    #: The `StaticCache` implementation `generate` will build (a model's default ``"hybrid"`` it drops), or None.
    static: str | None
    #: One sequence per row on `generate`'s own cache, no extra outputs: no rule of `refusals.settings_problem`
    #: refuses such settings (a new rule must keep this true), so a check may skip them.
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


class Prompt(NamedTuple):
    """A prompt read to the host: each row's tokens after its left padding, that padding, and why to run cold."""

    rows: list[TokenIds]
    pads: tuple[int, ...]
    reason: str | None


def read_prompt(input_ids: torch.Tensor, mask: Any, config: Any) -> Prompt:
    """The prompt's rows on the host after their left padding (a mask of zeros then ones), and why its mask (any
    other) or pad tokens without one (transformers would infer it) would change what the key covers (or None).

    >>> read_prompt(torch.tensor([[5, 6], [7, 8]]), torch.tensor([[0, 1], [1, 1]]), None)
    Prompt(rows=[(6,), (7, 8)], pads=(1, 0), reason=None)
    >>> read_prompt(torch.tensor([[5, 6]]), torch.tensor([[1, 0]]), None).reason
    'padding'
    """
    num_rows, width = input_ids.shape[0], input_ids.shape[-1]
    none = (0,) * num_rows
    if mask is not None and (not isinstance(mask, torch.Tensor) or mask.shape != input_ids.shape):
        return Prompt(token_rows(input_ids), none, reasons.ATTENTION_MASK_SHAPE)
    if mask is None:
        host = read_to_host(input_ids)
        pad = getattr(config, "pad_token_id", None)  # transformers infers a mask only from a pad token it knows
        padded = pad is not None and _has_pad(host, pad, config)
        return Prompt(token_rows(host), none, reasons.PADDING if padded else None)
    if mask.is_floating_point() or mask.is_complex():
        mask = torch.where(mask == 0, 0, torch.where(mask == 1, 1, 2))  # 2: any other value (a rare mask's dtype)
    # The mask's rows below the ids' rows, as int64: one concatenation, one read.
    host = read_to_host(torch.cat([input_ids.to(torch.int64), mask.to(input_ids.device, torch.int64)]))
    rows, size = token_rows(host[:num_rows]), 8 * num_rows * width
    if width and _ones(size).startswith(host.data.cast("B")[size:]):  # a mask of ones: one memcmp, in place
        return Prompt(rows, none, None)
    marks = host[num_rows:]
    # Zeros then ones: each row equals its count of zeros in zeros, then ones (any other value, or a zero after a
    # one, differs).
    pads = (marks == 0).sum(1)
    row_pads = tuple(pads.tolist())
    if not (marks == (np.arange(width) >= pads[:, None])).all() or max(row_pads) >= width:
        return Prompt(rows, none, reasons.PADDING)  # not left padding, or a row with no token at all
    return Prompt([row[p:] for row, p in zip(rows, row_pads, strict=True)], row_pads, None)  # type: ignore[misc]


@functools.lru_cache(maxsize=4)
def _ones(nbytes: int) -> bytes:
    """`nbytes` bytes of int64 ones (native order), to compare a mask with (kept for a few prompt sizes)."""
    return _ONE * (nbytes // 8)


_ONE = np.ones(1, np.int64).tobytes()


def _has_pad(host: NDArray[np.int64], pad: Any, config: Any) -> bool:
    """`infers_padding` on ids already on the host (`host`), for the pad token `pad` of `config`."""
    eos = config.eos_token_id
    if pad in (eos if isinstance(eos, list) else [eos]):
        return False
    if isinstance(pad, int) and -(2**63) <= pad < 2**63:
        return bool((host == pad).any())
    return any(pad in row for row in token_rows(host))


# ------------------------------------------------------------------ the decoder-only hook's step 1
# The names each check of the call's names looks for: a call that gives none of them skips that check (a set test),
# which would find nothing.
_REFUSED_NAMES = frozenset(refusals.REFUSED_ARGUMENTS)
_MEDIA_NAMES = frozenset(MEDIA_KWARGS)
_PLAIN_KWARGS = refusals.GENERATION_FIELDS | refusals.KEYED_OR_HARMLESS  # `refusals.model_kwarg` passes over these


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
    """Step 1 of a decoder-only call: its settings and prompt, and the first reason it cannot reuse safely.

    In the order reasons are counted: the model, an assistant's drafting (`is_drafting`), refused
    arguments, the ids (`ids_problem`), media kwargs, model kwargs the key does not cover, settings,
    the mask and pad tokens (`read_prompt`). A rule looking for names runs only when the call gives
    one, the settings' only when they are not plain (`GenerationSettings.is_plain`).
    """
    if profile.unsupported is not None:
        return _refused(profile.unsupported)
    if is_drafting(arguments.get("generation_config"), kwargs):
        return _refused(reasons.ASSISTANT_DRAFTING)
    if not (_REFUSED_NAMES.isdisjoint(kwargs) and _REFUSED_NAMES.isdisjoint(arguments)):
        problem = refusals.refused_argument({**kwargs, **arguments}, modes=refusals.serving_modes(profile))
        if problem is not None:
            return _refused(problem)
    problem = ids_problem(input_ids, profile)
    if problem is None and not _MEDIA_NAMES.isdisjoint(kwargs):
        problem = refusals.media_problem(profile, model, input_ids, kwargs)
    if problem is None and not kwargs.keys() <= _PLAIN_KWARGS:
        passed = refusals.model_kwarg(profile, signature, kwargs)
        if passed is not None:
            # It reaches the model's forward and may change states the key does not cover (GPT-2's token_type_ids).
            problem = reasons.with_detail(reasons.MODEL_KWARG, passed)
    if problem is not None:
        return _refused(problem)
    settings = GenerationSettings(model, arguments.get("generation_config"), kwargs)
    if not settings.is_plain:
        problem = refusals.settings_problem(profile, model, kwargs, settings)
        if problem is not None:
            return _refused(problem)
    # The one read of the device before the prefill: ids, mask and pad tokens.
    prompt = read_prompt(input_ids, kwargs.get("attention_mask"), settings)
    return Checked(settings, prompt.rows, prompt.pads, prompt.reason)


def _refused(reason: str) -> Checked:
    return Checked(None, [], (), reason)


def ids_problem(ids: Any, profile: ModelProfile | None = None, one_row: bool = False) -> str | None:
    """Why `ids` are not a 2-D tensor of integer token ids in some rows (one, if `one_row`), or not a prompt the
    decoder-only model of `profile` can serve (given one): several rows of states kept for one, no token, or more
    than an indexer keeps exact. None if they are.

    >>> ids_problem(torch.tensor([[5, 6], [7, 8]])), ids_problem(torch.tensor([[5, 6], [7, 8]]), one_row=True)
    (None, 'batch_size')
    """
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return reasons.NO_INPUT_IDS
    several = ids.shape[0] != 1
    # Window states and states beside media are restored for one row only.
    if several and (one_row or not len(ids) or (profile is not None and profile.has_state and not profile.joins_rows)):
        return reasons.BATCH_SIZE
    if profile is None:
        return None
    if ids.shape[1] == 0:
        return reasons.EMPTY_PROMPT
    if profile.exact_prompt_len is not None and ids.shape[1] > profile.exact_prompt_len:
        return reasons.with_detail(reasons.INDEXER_TOP_K, profile.exact_prompt_len)
    media = profile.media
    if several and media is not None and (media.has_positions or media.whole_prompt_only):
        # Positions and prompt-wide namespaces are computed for one row.
        return reasons.MROPE_BATCH if media.has_positions else reasons.PREFIX_LM_BATCH
    return None


def is_drafting(generation_config: Any, kwargs: Mapping[str, Any]) -> bool:
    """Whether a call is an assistant model's drafting inside an assisted `generate` (its config `is_assistant`).

    >>> from transformers import GenerationConfig
    >>> is_drafting(GenerationConfig(is_assistant=True), {}), is_drafting(None, {})
    (True, False)
    """
    if kwargs.get("is_assistant"):
        return True
    return bool(getattr(generation_config, "is_assistant", False))


def decide_mode(facts: frozenset[str]) -> Mode | str:
    """The mode of a call with `facts` (its own and its model's) by `MODE_TABLE`, or the reason it runs cold.

    >>> decide_mode(frozenset({"padded", "has_state", "padding_served"}))
    <Mode.STATE_ROWS: 'state rows'>
    >>> decide_mode(frozenset({"static", "several", "distinct", "padding_served"}))
    <Mode.OWN_ROWS: 'own rows'>
    >>> decide_mode(frozenset({"static", "padded"}))
    'padding'
    """
    for when, unless, outcome in MODE_TABLE:
        if when <= facts and unless.isdisjoint(facts):
            return outcome
    return Mode.SHARED  # not reached: the table's last rule always applies


class Read(NamedTuple):
    """What `read_call` found: the call, or None and why it runs cold; the prompt's length, as a cold run counts it."""

    call: Call | None
    reason: str | Cold
    prompt_len: int


def read_call(
    store: Store,
    model: Any,
    profile: ModelProfile,
    signature: inspect.Signature,
    capabilities: frozenset[str],
    arguments: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    session: Session | None,
) -> Read:
    """Steps 1 and 2, check and key: the call as a value, or why it cannot reuse safely."""
    input_ids = arguments.get("inputs")
    if input_ids is None:
        # Passed by name, or positionally to a generate naming it (Nemotron 3.5 Transcribe's).
        input_ids = arguments.get("input_ids")
    prompt_len = int(input_ids.shape[-1]) if isinstance(input_ids, torch.Tensor) else 0
    checked = check_call(profile, model, signature, input_ids, arguments, kwargs)
    settings = checked.settings
    if settings is None or checked.reason is not None:
        return Read(None, checked.reason or reasons.NO_INPUT_IDS, prompt_len)
    tokens, pads = checked.rows, checked.pads
    facts = set(capabilities)
    if len(tokens) > 1:
        facts.add("several")
        if any(row != tokens[0] for row in tokens[1:]):
            facts.add("distinct")
    if any(pads):
        facts.add("padded")
    if settings.expand > 1:
        facts.add("expanded")
    if settings.static is not None:
        facts.add("static")
    mode = decide_mode(frozenset(facts))
    if isinstance(mode, str):
        return Read(None, mode, prompt_len)
    try:
        layout: MediaLayout | None = None
        namespace = base_namespace = store.namespace()
        scope: tuple[Any, ...] = ()
        if profile.media is not None:
            layout, reason = prompt_layout(profile, tokens, kwargs)
            if reason is not None:
                return Read(None, reason, prompt_len)
            namespace, scope = prompt_namespace(profile, base_namespace, tokens[0], layout, kwargs)
        spans = layout.spans if layout is not None else ()
        item_spans = spans if profile.item_layers else ()
        rows: list[Row] = []
        for row, pad in zip(tokens, pads, strict=True):
            # Placeholders become media symbols: a stored prefix matches only if tokens and media do.
            symbols = layout.symbols(row) if layout is not None else row
            # Identical rows share one key.
            same = rows and row == tokens[0]
            rows.append(Row(row, pad, rows[0].key if same else PrefixKey(namespace, symbols, spans, item_spans)))
    except InconsistentStateError as exc:  # the prompt's media symbols failed a guard
        return Read(None, guard_failed(exc), prompt_len)
    return Read(
        Call(
            args,
            kwargs,
            input_ids,
            prompt_len,
            session,
            tuple(rows),
            mode,
            settings.expand,
            (settings.num_beams or 1) > 1,
            settings.assisted or arguments.get("assistant_model") is not None,
            # "dynamic" (or Gemma's default "hybrid"): the working cache is one; cold runs keep the setting.
            bool(settings.cache_implementation),
            _static_len(settings, prompt_len) if settings.static is not None else 0,
            layout,
            base_namespace,
            scope,
            eos_ids(settings.eos_token_id),
        ),
        "",
        prompt_len,
    )


def _static_len(settings: GenerationSettings, prompt_len: int) -> int:
    """The static cache's positions as generate sizes it: the longest sequence but its last token, or the config's."""
    new = settings.max_new_tokens
    longest = prompt_len + new if new is not None else settings.max_length
    return int(max(longest - 1, settings.max_cache_len or 0))
