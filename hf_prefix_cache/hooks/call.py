"""Call: one decoder-only `generate` call as a value: its arguments, its rows (each keyed once) and its mode.

`read_call` runs the checks of `checks.py`, then decides the mode by one table (`MODE_TABLE`) over
the profile's declared capabilities and the call's settings (or the reason to run cold), then keys
each row (`PrefixKey`: its tokens after its left padding, media placeholders as symbols).
"""

from __future__ import annotations

import enum
import inspect
import logging
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.hooks.checks import GenerationSettings, check_call
from hf_prefix_cache.hooks.media import prompt_layout, prompt_namespace
from hf_prefix_cache.hooks.pipeline import Cold, guard_failed
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.store.contract import Store
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds, eos_ids

logger = logging.getLogger("hf_prefix_cache")


class Mode(enum.Enum):
    """How a call's rows restore their stored prefixes and are stored (the restore and store steps that run)."""

    SHARED = "shared prefix"  # one prompt (identical rows): one restore, copied to every row and its expansion
    STATIC = "static copy"  # one prompt on a static cache: restored, copied into its buffers and out again
    OWN_ROWS = "own rows"  # distinct or left-padded rows of per-token keys: each restores to one shared column (its
    # cache copied into a static one where the call asks for one)
    STATE_ROWS = "state rows"  # rows with recurrent states (a batch, padding, expansion): prefilled alone, joined


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt row: its tokens after its left padding `pad`, and its key (built once, by `read_call`)."""

    tokens: TokenIds
    pad: int
    key: PrefixKey


@dataclass(frozen=True, slots=True)
class Call:
    """One `generate` call as the steps see it: what it passed, its rows and its mode.

    `expand`: rows `generate` makes of each prompt row (`beams`: reordered every step); `assisted`:
    assisted or prompt-lookup decoding; `drop_impl`: the call's `cache_implementation` is dropped (the
    working cache serves it); `static_len`: the static cache's size (0: none); `layout`: the prompt's
    media items; `base_namespace`: the model's namespace before the prompt's media extended it;
    `scope`: the media every position sees; `eos`: the ids that end a row.
    """

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    input_ids: Any
    prompt_len: int
    session: Session | None
    rows: tuple[Row, ...]
    mode: Mode
    expand: int = 1
    beams: bool = False
    assisted: bool = False
    drop_impl: bool = False
    static_len: int = 0
    layout: MediaLayout | None = None
    base_namespace: str = ""
    scope: tuple[Any, ...] = ()
    eos: frozenset[int] = frozenset()

    @property
    def pads(self) -> tuple[int, ...]:
        """Each row's left padding."""
        return tuple(row.pad for row in self.rows)


# The facts of a call the mode table reads (each true or not): `padded`, a row has left padding; `several`, more than
# one row; `distinct`, rows that differ; `expanded`, beams or several returned sequences; `static`, a static cache.
# Beside them, the profile's capabilities (`capabilities`): `has_state`, recurrent states; `padding_served`, rows
# may restore behind their left padding (`serves_padding`).


class ModeRule(NamedTuple):
    """A row of the mode table: when every fact of `when` holds (and none of `unless`), the mode or the cold reason."""

    when: frozenset[str]
    unless: frozenset[str]
    outcome: Mode | str


def _rule(when: str, outcome: Mode | str, unless: str = "") -> ModeRule:
    return ModeRule(frozenset(when.split()), frozenset(unless.split()), outcome)


#: The one table of modes, first match wins: a call's mode, or the reason it runs cold. The refusals of
#: `checks.check_call` (the model, arguments, settings, prompt) come before it; the prompt's media keying after.
MODE_TABLE: tuple[ModeRule, ...] = (
    # Left-padded rows restore behind their padding only where positions follow the mask (`serves_padding`).
    _rule("padded", reasons.PADDING, unless="padding_served"),
    # Recurrent states have one snapshot per stored length: each row is prefilled alone, then the rows are joined.
    _rule("has_state several", Mode.STATE_ROWS),
    _rule("has_state expanded", Mode.STATE_ROWS),
    _rule("has_state padded", Mode.STATE_ROWS),
    # Per-token keys: each row restores its own prefix, to the column every row reaches (then copied into a static
    # cache where the call asks for one).
    _rule("padded", Mode.OWN_ROWS),
    _rule("distinct", Mode.OWN_ROWS),
    _rule("static", Mode.STATIC),
    _rule("", Mode.SHARED),
)


def capabilities(profile: ModelProfile) -> frozenset[str]:
    """What the mode table reads of a model (`MODE_TABLE`): its declared capabilities, once per hook."""
    return frozenset(
        name for name, holds in (("has_state", profile.has_state), ("padding_served", serves_padding(profile))) if holds
    )


def decide_mode(facts: frozenset[str]) -> Mode | str:
    """The mode of a call with `facts` (its own and its model's capabilities) by `MODE_TABLE`, or the reason it runs
    cold.

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


def serves_padding(profile: ModelProfile) -> bool:
    """Whether left-padded rows can restore behind their padding: positions follow the mask (the model takes
    `position_ids`) and the cached padding columns are masked (`generate` slices the prompt); per-token keys only,
    no media (keyed for one row), no indexers keeping positions (Qwen4-Exp: a restore rebuilds them as 0..L-1).
    Rows with recurrent states are prefilled alone (`recurrent_rows.py`): masked padding leaves a state as it was,
    and positions follow the mask where the model takes them (a model of states alone has none)."""
    if profile.joins_rows:
        return profile.accepts_position_ids or not profile.has_kv
    return (
        profile.accepts_position_ids
        and profile.prompt_sliced
        and profile.expands
        and profile.media is None
        and not profile.keeps_positions
    )


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
    """Steps 1 and 2, check and key: the call as a value, or why it cannot reuse safely (a failed guard on the
    prompt's media symbols among them)."""
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
    """The positions of the static cache, sized as generate sizes it: the longest sequence but its last token (or
    the config's own size)."""
    new = settings.max_new_tokens
    longest = prompt_len + new if new is not None else settings.max_length
    return int(max(longest - 1, settings.max_cache_len or 0))
