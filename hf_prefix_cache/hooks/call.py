"""Call: one decoder-only `generate` call as a value: its arguments, its rows (each keyed once) and its mode.

`checks.read_call` makes a `Call`: it runs the checks, decides the mode by the one table here
(`MODE_TABLE`) over the model's capabilities and the call's settings (or the reason to run cold),
then keys each row (its tokens after its left padding, media placeholders as symbols).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, NamedTuple

from hf_prefix_cache import reasons
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model.profile import ModelProfile
from hf_prefix_cache.multimodal.media import MediaLayout
from hf_prefix_cache.store.sessions import Session
from hf_prefix_cache.token_ids import TokenIds


class Mode(enum.Enum):
    """How a call's rows restore their stored prefixes and are stored (the restore and store steps that run)."""

    SHARED = "shared prefix"  # one prompt (identical rows): one restore, copied to every row and its expansion
    STATIC = "static copy"  # one prompt on a static cache: restored, copied into its buffers and out again
    OWN_ROWS = "own rows"  # distinct or left-padded rows of per-token keys: each restores to one shared column
    STATE_ROWS = "state rows"  # rows with recurrent states (a batch, padding, expansion): prefilled alone, joined


@dataclass(frozen=True, slots=True)
class Row:
    """One prompt row: its tokens after its left padding `pad`, and its key (built once, by `checks.read_call`)."""

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


class ModeRule(NamedTuple):
    """A row of the mode table: when every fact of `when` holds (and none of `unless`), the mode or the cold reason.

    A call's facts: `padded` (a row has left padding), `several` (rows), `distinct` (rows that differ),
    `expanded` (beams or several sequences), `static` (a static cache); its model's (`capabilities`):
    `has_state` (recurrent states), `padding_served` (rows restore behind their padding).
    """

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


def serves_padding(profile: ModelProfile) -> bool:
    """Whether left-padded rows can restore behind their padding: positions follow the mask (the model takes
    `position_ids`, or has no keys: rows with states are prefilled alone, and masked padding leaves a state as
    it was) and the cached padding columns are masked (`generate` slices the prompt); per-token keys only, no
    media (keyed for one row), no indexers keeping positions (Qwen4-Exp: a restore rebuilds them as 0..L-1)."""
    if profile.joins_rows:
        return profile.accepts_position_ids or not profile.has_kv
    return (
        profile.accepts_position_ids
        and profile.prompt_sliced
        and profile.expands
        and profile.media is None
        and not profile.keeps_positions
    )
