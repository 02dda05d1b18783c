"""RunningBatch: the rows decoding together, each behind its own left padding in one working cache.

A row joins (`admit`) after its prompt is prefilled ALONE through the store, as a one-token `generate`
call with the store as its cache: that call restores the row's stored prefix, prefills the rest
(recurrent models in snapshot-sized chunks), stores the prompt and counts the request under the row's
salt exactly as the sequential path does, and returns the row's working cache and the prompt's last
logits, from which the row chooses its first token. The batch is then laid out again (`layout.py`; for
models with recurrent states through `model.batch_rows.restore_rows`, which the store's own padded batches
use): every row's cache behind its left padding, right-aligned, so each row's chosen-but-unfed token is
fed at the same column.

A row of a vision-language model (`Request.inputs`: its pixel values, grids, marks) is prefilled the same
way, its inputs passed to that call, so the store keys its media by content, reuses a stored image and
encodes only the images its hit lacks. Its decode steps are text only; what they need of its media is
kept once it joins (`media.py`): the key to store the finished row under, and, for M-RoPE models, the
shift of its next position off its cache length on each position axis.

Where the model allows it (`packed.py`), a row whose prefix is stored joins without a forward of its own:
`stage` restores its prefix, and the next `step` feeds its uncached prompt tokens in the same forward as the
rows' next tokens, then stores and counts its prompt as `generate` would.

`step` runs ONE forward over every row (ids `[B, 1]`, the 2D mask that hides each row's padding, each
row's own next position: `[4, B, 1]` for M-RoPE models), then each row chooses, streams and checks its
end. A row that ends leaves at once: its cache is copied out alone (`batch_rows.copy_row`) and its
finished sequence (prompt and every token but the last, never fed) stored under its salt (and its
media), as `generate` would store it; the rows left are laid out again without the padding columns they
all share.

``` text
row a (pad 0):  [ a0 a1 a2 a3 a4 ] <- a's next token
row b (pad 2):  [ .  .  b0 b1 b2 ] <- b's next token      mask [[1 1 1 1 1 1], [0 0 1 1 1 1]]
```

Example:
    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from hf_prefix_cache import PrefixCache
    >>> from hf_prefix_cache.batching.rows import Request, Row
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
    ...     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)).eval()
    >>> batch = RunningBatch(PrefixCache(model))
    >>> rows = [Row(Request(list(range(4, 4 + n)), max_new_tokens=3)) for n in (12, 7)]
    >>> [batch.admit(row) for row in rows]
    [True, True]
    >>> while batch.rows:
    ...     batch.step()
    >>> [len(row.tokens) for row in rows], [row.end_reason.value for row in rows]
    ([3, 3], ['length', 'length'])
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from hf_prefix_cache.api.prefix_cache import store_of
from hf_prefix_cache.batching import layout, packed
from hf_prefix_cache.batching.growing import GrowingCache
from hf_prefix_cache.batching.media import RowMedia, row_media, step_positions
from hf_prefix_cache.batching.rows import EndReason, Row
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.keys.prefix_key import PrefixKey
from hf_prefix_cache.model import batch_rows
from hf_prefix_cache.model.working_cache import WorkingCache
from hf_prefix_cache.store.contract import Served

if TYPE_CHECKING:
    from hf_prefix_cache.api.prefix_cache import PrefixCache
    from hf_prefix_cache.store.lookup import Lookup

logger = logging.getLogger("hf_prefix_cache")

#: Leading positions the rows must hold alike before a step attends them once for all (`packed.cascade`).
SHARED_MIN = 64
#: Prompt tokens a row must share with a row staged before it, past what the store holds, to wait a step for that
#: row's prompt to be stored (fewer are computed again: on two CPU threads 32 tokens cost about what the wait does).
DEFER_MIN = 32


class Staging(enum.Enum):
    """What `RunningBatch.stage` did with a row."""

    STAGED = "staged"  # it joins in the next step's own forward
    OWN_PREFILL = "own_prefill"  # the packed step cannot take it: `admit` it
    NEXT_STEP = "next_step"  # a row staged before it would give it more: stage it after the next step


class RunningBatch:
    """The rows in flight on one model and its store; every method runs in the one thread that owns the batch.

    Args:
        prefix_cache: the store of the model (its `model` is the model the rows run on).
    """

    def __init__(self, prefix_cache: PrefixCache) -> None:
        store = store_of(prefix_cache)
        self._front = prefix_cache
        self.model = store.model
        self.profile = store.profile
        self.rows: list[Row] = []
        self._cache: WorkingCache | None = None
        self._length = 0  # columns every row's cache spans (its padding included)
        self._media: dict[int, RowMedia] = {}  # by `id(row)`: the media facts of each row of a model with media
        # Rows staged to join in the next step's own forward (`packed.py`), each with its restored, pinned prefix.
        self._joining: list[tuple[Row, Lookup]] = []
        # Leading positions every row holds alike (checked equal, key for key), attended once a step (`packed.py`'s
        # cascade), and the rows checked over them; reset when the batch empties.
        self._shared = 0
        self._checked: set[Row] = set()
        profile = self.profile
        fits = profile.defers_keys and profile.media is None and profile.accepts_position_ids
        self._packed_attention = packed.attention_of(self.model) if fits and profile.accepts_logits_to_keep else None
        self._configs = packed.configs_of(self.model) if self._packed_attention is not None else []

    def held(self) -> int:
        """Rows decoding and rows staged to join in the next step."""
        return len(self.rows) + len(self._joining)

    def staged(self) -> int:
        """Rows staged to join in the next step's own forward."""
        return len(self._joining)

    @property
    def length(self) -> int:
        """Columns of the batch's cache: the longest row's fed tokens (the others are padded to it)."""
        return self._length

    # ------------------------------------------------------------------ joining
    def admit(self, row: Row) -> bool:
        """Prefill `row` alone through the store, choose its first token, and join it (unless that token ended it).

        Returns False, with nothing of the row changed but its scope, when the store ran the prefill cold (its
        state is then not a working cache the batch can take): the caller runs the row alone.
        """
        request = row.request
        device = self.model.device
        ids = torch.tensor([list(request.ids)], device=device)
        inputs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in request.inputs.items()}
        row.scope = self._front.request(request.salt)
        with row.scope, torch.no_grad():
            output = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                cache=self._front,
                max_new_tokens=1,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
                **inputs,
            )
            media = row_media(store_of(self._front), self.profile, ids, inputs)  # its key takes the row's salt
        cache = output["cache"] if "cache" in output else output["past_key_values"]
        if not isinstance(cache, WorkingCache) or cache.kv_length() != len(request.ids):
            return False
        if self.profile.media is not None:
            if media is None:
                return False
            self._media[id(row)] = media
        self.join(row, output.logits[0][0], cache)
        return True

    def stage(self, row: Row) -> Staging:
        """Restore `row`'s stored prefix (pinned) to join the batch in the next `step`'s own forward (`packed.py`),
        its uncached prompt tokens fed there with the rows' next tokens.

        `Staging.OWN_PREFILL` (nothing kept, nothing counted) where it cannot: a model or row the packed step does
        not take, nothing stored, or a store that refuses the restore. `Staging.NEXT_STEP` where a row staged before
        it shares at least `DEFER_MIN` more of its prompt than the store holds: after that row's step stored its
        prompt, `row` restores it, as it would one request at a time (fewer are computed again rather than wait).
        """
        request = row.request
        cache = self._cache
        if self._packed_attention is None or request.inputs or not (cache is None or _in_place(cache)):
            return Staging.OWN_PREFILL
        scope = self._front.request(request.salt)
        try:
            with scope:
                lookup = self._front.lookup(list(request.ids))
        except (ValueError, InconsistentStateError) as exc:  # `generate`'s path falls back as it does
            logger.info("batching: a row joins by a prefill of its own (%s)", exc)
            return Staging.OWN_PREFILL
        if not 0 < lookup.cached_len < len(request.ids):
            lookup.release()
            return Staging.OWN_PREFILL
        shared = max(
            (_common(request.ids, r.request.ids) for r, _ in self._joining if r.request.salt == request.salt),
            default=0,
        )
        if shared - lookup.cached_len >= DEFER_MIN:
            lookup.release()
            return Staging.NEXT_STEP
        row.scope = scope
        self._joining.append((row, lookup))
        return Staging.STAGED

    def join(self, row: Row, logits: torch.Tensor, cache: WorkingCache) -> None:
        """Row `row`, its prompt prefilled (and stored) into `cache` alone, `logits` the prompt's last, chooses its
        first token and joins the batch behind its padding, unless that token ended it (`admit`'s second half; a
        prompt prefilled in pieces, `prefill.py`, joins here)."""
        reason = self._choose(row, logits)
        if reason is not None:
            self._media.pop(id(row), None)
            row.finish(reason)  # its prompt was stored by the prefill; nothing more was fed
            return
        n, length = len(row.request.ids), self._length
        self._cache = layout.joined(self.profile, self._cache, [r.pad for r in self.rows], cache, n, length)
        width = max(length, n)
        for other in self.rows:
            other.pad += width - length
        row.pad = width - n
        self.rows.append(row)
        self._length = width

    # ------------------------------------------------------------------ decoding
    def step(self) -> None:
        """One forward over every row (and the staged rows' prompts), then each row's choice; rows that ended leave
        (stored)."""
        if self._joining and (self._cache is None or _in_place(self._cache)):
            self._packed_step(self._shared_len())
            return
        for row, lookup in self._joining:  # laid out otherwise since they were staged: each joins by its own prefill
            lookup.release()
            if not self.admit(row):
                row.finish(EndReason.ERROR, InconsistentStateError("a staged row's prefill ran cold"))
        self._joining = []
        shared = self._shared_len()
        if shared:
            self._packed_step(shared)
            return
        cache, rows, length = self._cache, self.rows, self._length
        if cache is None or not rows:
            return
        device = self.model.device
        pads = torch.tensor([row.pad for row in rows], device=device)
        mask = (torch.arange(length + 1, device=device)[None, :] >= pads[:, None]).long()
        shifts = [self._media[id(row)].shift if id(row) in self._media else None for row in rows]
        kwargs: dict[str, Any] = {
            self.profile.cache_kwarg: cache,
            "attention_mask": mask,
            "position_ids": step_positions(length - pads, shifts),
            "use_cache": True,
        }
        if self.profile.accepts_logits_to_keep:
            kwargs["logits_to_keep"] = 1
        ids = torch.tensor([[row.pending] for row in rows], device=device)
        with torch.no_grad():
            logits = self.model(input_ids=ids, **kwargs).logits[:, -1, :]
        self._length = length + 1
        ended = [(row, reason) for i, row in enumerate(rows) if (reason := self._choose(row, logits[i])) is not None]
        if ended:
            self.end(ended)

    def _shared_len(self) -> int:
        """Leading positions every row holds alike, where the packed step attends them once (`packed.cascade`); 0
        where it would not (fewer than `SHARED_MIN`, one row, or a model or layout the packed step does not take).

        The rows' fed ids give the length; a row not checked yet is compared with a checked one (or the first)
        key for key and value for value over it in every layer, so only the order of attention's sums changes.
        """
        rows, cache = self.rows, self._cache
        if len(rows) < 2 or self._packed_attention is None or not isinstance(cache, GrowingCache):
            return 0
        unchecked = [row for row in rows if row not in self._checked]
        if unchecked:
            anchor = next((row for row in rows if row in self._checked), rows[0])
            ids = anchor.fed_ids
            shared = min((_common(ids, row.fed_ids) for row in unchecked if row is not anchor), default=len(ids))
            if self._checked:
                shared = min(shared, self._shared)
            a = rows.index(anchor)
            alike = cache.lays_out_in_place() and all(
                cache.same_positions(a, anchor.pad, rows.index(row), row.pad, shared)
                for row in unchecked
                if row is not anchor
            )
            self._shared = shared if alike else 0
            self._checked = set(rows)
        return self._shared if self._shared >= SHARED_MIN else 0

    def _packed_step(self, shared: int = 0) -> None:
        """The step with staged rows (`packed.py`): each laid out behind its restored prefix, its uncached prompt
        tokens fed after the decoding rows' next tokens in one forward; its prompt stored and counted as `generate`
        counts one, then every row chooses. `shared`: leading positions the decoding rows hold alike."""
        joining, self._joining = self._joining, []
        decoding, length = list(self.rows), self._length
        cache = self._cache if isinstance(self._cache, GrowingCache) else GrowingCache(self.profile)
        self.rows = decoding + [row for row, _ in joining]  # from here a failure (then `fail`) ends them all
        try:
            for row, lookup in joining:
                new = len(row.request.ids) - lookup.cached_len
                cache.add_row(lookup.cache, lookup.cached_len, gap=new - 1, rows=len(decoding) + len(joining))
            width = max([length, *(len(row.request.ids) - 1 for row, _ in joining)])
            for row in decoding:
                row.pad += width - length
            joiners, offset = [], len(decoding)
            for row, lookup in joining:
                row.pad = width + 1 - len(row.request.ids)
                joiners.append(packed.Joiner(offset, len(row.request.ids) - lookup.cached_len, row.pad))
                offset += joiners[-1].new
            self._cache, self._length = cache, width
            device = self.model.device
            pads = torch.tensor([r.pad for r in decoding], device=device)
            plan = packed.Packing(len(decoding), pads, joiners, self._packed_attention or "sdpa", shared)
            ids = [row.pending for row in decoding] + [
                t for row, lk in joining for t in row.request.ids[lk.cached_len :]
            ]
            positions = [width - row.pad for row in decoding] + [
                p for row, lk in joining for p in range(lk.cached_len, len(row.request.ids))
            ]
            kwargs: dict[str, Any] = {
                self.profile.cache_kwarg: cache,
                "position_ids": torch.tensor([positions], device=device),
                "use_cache": True,
                "logits_to_keep": torch.tensor(plan.last_indices(), device=device),
            }
            cache.packing = plan
            try:
                with torch.no_grad(), packed.packing(self._configs, plan):
                    logits = self.model(input_ids=torch.tensor([ids], device=device), **kwargs).logits[0]
            finally:
                cache.packing = None
            self._length = width + 1
            for row, lookup in joining:
                self._store_prompt(row, lookup.cached_len)
        finally:
            for _, lookup in joining:
                lookup.release()
        rows = self.rows
        ended = [(row, reason) for i, row in enumerate(rows) if (reason := self._choose(row, logits[i])) is not None]
        if ended:
            self.end(ended)

    def _store_prompt(self, row: Row, cached_len: int) -> None:
        """Store the prompt of `row` (just fed in a packed step) under its salt, counted as one served call."""
        ids, index = row.request.ids, self.rows.index(row)
        if row.scope is None or not isinstance(self._cache, GrowingCache):
            raise InconsistentStateError("a packed row was not staged")
        view = self._cache.row_view(index, row.pad, row.pad + len(ids))
        store = store_of(self._front)
        try:
            with row.scope:
                store.record(Served(len(ids), cached_len))
                # `row`: the view's tensors are the batch's buffers, which rows reuse: its new positions are copied out
                # and the store never adopts the view as the run of the prompt's path (as it may a lone cache's).
                key = PrefixKey(store.namespace(), list(ids))
                store.insert_sequence(key, view, row=0, computed_from=cached_len)
        except (ValueError, InconsistentStateError) as exc:  # its answer stands; only its reuse is lost
            logger.warning("batching: a prompt fed in a packed step was not stored: %s", exc)
        logger.info("prefix cache: reused %d of %d prompt tokens (joined in a packed step)", cached_len, len(ids))

    def drop_joining(self, reason: EndReason, error: BaseException | None = None) -> None:
        """End the rows staged to join (their prefixes unpinned, nothing fed)."""
        joining, self._joining = self._joining, []
        for row, lookup in joining:
            lookup.release()
            row.finish(reason, error)

    def end_flagged(self, now: float | None = None) -> None:
        """End the rows cancelled or past their deadline (what they computed is stored)."""
        now = time.monotonic() if now is None else now
        flagged = [
            (row, EndReason.CANCELLED if row.cancelled else EndReason.TIMEOUT)
            for row in self.rows
            if row.cancelled or row.expired(now)
        ]
        if flagged:
            self.end(flagged)

    def end(self, ended: Sequence[tuple[Row, EndReason]]) -> None:
        """Store each of `ended`'s rows (copied out alone, under its salt), tell its caller, and drop it."""
        leaving = {id(row): reason for row, reason in ended}
        staying = [i for i, row in enumerate(self.rows) if id(row) not in leaving]
        for i, row in enumerate(self.rows):
            if id(row) in leaving:
                self._store(row, self._copy(i))
                row.finish(leaving[id(row)])
        rows, cache, length = self.rows, self._cache, self._length
        self._checked -= {row for row in rows if id(row) in leaving}
        if not staying or cache is None:
            self.rows, self._cache, self._length = [], None, 0
            self._shared, self._checked = 0, set()
            return
        width = max(length - rows[i].pad for i in staying)  # the padding columns all rows left share are dropped
        self._cache, order = layout.kept(self.profile, cache, [row.pad for row in rows], length, staying, width)
        self.rows, self._length = [rows[i] for i in order], width
        for row in self.rows:
            row.pad -= length - width

    def fail(self, error: BaseException) -> None:
        """End every row with `error` (the model raised): nothing of theirs is stored past their prompts."""
        rows, self.rows, self._cache, self._length = self.rows, [], None, 0
        self._shared, self._checked = 0, set()
        self._media.clear()
        for row in rows:
            row.finish(EndReason.ERROR, error)
        self.drop_joining(EndReason.ERROR, error)

    # ------------------------------------------------------------------ helpers
    def _choose(self, row: Row, logits: torch.Tensor) -> EndReason | None:
        """Row `row` chooses and streams its next token from its `[vocab]` logits; why it ends now, if it does."""
        if row.request.keep_logits:
            row.logits.append(logits.detach().float().cpu().clone())
        row.emit(row.chooser.choose(logits, row.tokens))
        return row.ended_by()

    def _copy(self, i: int) -> WorkingCache:
        """Row `i`'s cache alone: its columns after its padding (copies)."""
        if self._cache is None:
            raise InconsistentStateError("a row of an empty batch was asked for")
        return batch_rows.copy_row(self._cache, i, self.rows[i].pad, self._length)

    def _store(self, row: Row, cache: WorkingCache) -> None:
        """Store `row`'s finished sequence (`cache` holds it alone) under its salt, as `generate` stores one."""
        if row.scope is None:
            raise InconsistentStateError("a row left the batch without having been admitted")
        media = self._media.pop(id(row), None)
        try:
            with row.scope:
                if media is None:
                    self._front.insert(row.fed_ids, cache)
                else:  # keyed by its media as `generate` keys it (`insert` keys token ids only)
                    store_of(self._front).insert_sequence(media.key(row.fed_ids), cache)
        except (ValueError, InconsistentStateError) as exc:  # its answer stands; only its reuse is lost
            logger.warning("batching: a finished row was not stored: %s", exc)


def _in_place(cache: WorkingCache) -> bool:
    """Whether `cache` is a batch's whose rows join and leave in place (where the packed step lays rows out)."""
    return isinstance(cache, GrowingCache) and cache.lays_out_in_place()


def _common(a: Sequence[int], b: Sequence[int]) -> int:
    """Leading ids `a` and `b` share."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
