"""What the hook reads back from the device: the prompt with its mask, checked on the host, and the stored
rows as `generate` returned them, each in one read."""

from __future__ import annotations

import pytest
import torch

from hf_prefix_cache import reasons
from hf_prefix_cache.hooks.checks import read_prompt
from hf_prefix_cache.hooks.pipeline import sequence_keys
from hf_prefix_cache.keys.prefix_key import PrefixKey


def test_the_prompt_comes_back_without_its_mask_flags_and_its_left_padding() -> None:
    """Rows come back after their left padding, with its length; any other zero in a mask is padding."""
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    assert read_prompt(ids, torch.ones_like(ids), None) == ([[5, 6, 7], [8, 9, 10]], (0, 0), None)
    mask = torch.ones_like(ids)
    mask[1, 0] = 0
    assert read_prompt(ids, mask, None) == ([[5, 6, 7], [9, 10]], (0, 1), None)
    assert read_prompt(ids, mask.flip(-1), None).reason == reasons.PADDING  # right padding
    inner = torch.tensor([[1, 0, 1], [1, 1, 1]])
    assert read_prompt(ids, inner, None).reason == reasons.PADDING
    assert read_prompt(ids, torch.tensor([[0, 0, 0], [1, 1, 1]]), None).reason == reasons.PADDING  # an empty row
    assert read_prompt(ids, torch.ones(1, 3, dtype=torch.long), None).reason == reasons.ATTENTION_MASK_SHAPE


def _left_pads(row: list[float]) -> int | None:
    """A mask row's left padding (its zeros, all before its ones), or None when it is anything else."""
    zeros = row.count(0)
    return zeros if row == [0] * zeros + [1] * (len(row) - zeros) else None


@pytest.mark.parametrize("dtype", [torch.long, torch.int32, torch.float32, torch.bool])
def test_any_mask_is_left_padding_exactly_when_its_rows_are_zeros_then_ones(dtype: torch.dtype) -> None:
    """Over random masks (values 0, 0.5, 1, 2, -1; rows of left padding, empty rows), each row's padding is
    read as a per-row reading of the mask would: zeros then ones, and at least one token."""
    gen = torch.Generator().manual_seed(0)
    values = torch.tensor([0, 1, 2, -1, 0.5]) if dtype.is_floating_point else torch.tensor([0, 1, 2, -1])
    if dtype == torch.bool:
        values = torch.tensor([0, 1])
    for _ in range(300):
        rows, width = (int(n) for n in torch.randint(1, 5, (2,), generator=gen))
        if torch.rand((), generator=gen) < 0.5:  # left padding in every row (some rows may be all padding)
            pads = torch.randint(0, width + 1, (rows, 1), generator=gen)
            mask = (torch.arange(width) >= pads).to(dtype)
        else:
            mask = values[torch.randint(0, len(values), (rows, width), generator=gen)].to(dtype)
        ids = torch.randint(3, 100, (rows, width), generator=gen)
        spec = [_left_pads([float(v) for v in row]) for row in mask.tolist()]
        prompt = read_prompt(ids, mask, None)
        if any(p is None or p >= width for p in spec):
            assert prompt == (ids.tolist(), (0,) * rows, reasons.PADDING), mask
        else:
            expected = [row[p:] for row, p in zip(ids.tolist(), spec, strict=True)]
            assert prompt == (expected, tuple(spec), None), mask


def test_stored_rows_are_what_generate_returned() -> None:
    """Each stored row holds the ids `generate` returned (its prompt part included, even where a model's generate
    rewrote it), up to the length the cache covers."""
    sequences = torch.tensor([[5, 6, 7, 40, 41]])

    def _rows_on_host(sequences: torch.Tensor, length: int | None) -> list:
        return [key.symbols for key in sequence_keys(PrefixKey("ns", ()), sequences, length)]

    assert _rows_on_host(sequences, 4) == [[5, 6, 7, 40]]
    changed = torch.tensor([[5, 99, 7, 40, 41]])  # a model whose generate rewrote its prompt
    assert _rows_on_host(changed, 4) == [[5, 99, 7, 40]]
    assert _rows_on_host(sequences, 2) == [[5, 6]]  # the cache covers less than the prompt
    assert _rows_on_host(sequences, None) == [[5, 6, 7, 40]]
    assert _rows_on_host(torch.tensor([[5, 6, 7], [8, 9, 10]]), None) == [[5, 6], [8, 9]]


def test_the_hook_hands_the_tree_token_bytes_read_with_the_ids(monkeypatch: pytest.MonkeyPatch) -> None:
    """Prompts and stored rows reach the tree as TokenIds whose bytes are those of the ids read, so every
    text node compares at C speed (a silent fall back to per-int comparisons would only be slow, so it is
    checked here), and a branching second request reuses exactly the shared prefix."""
    from array import array

    from hf_prefix_cache import PrefixCache
    from hf_prefix_cache.testing.compare import Hits, assert_same_as_cold
    from hf_prefix_cache.testing.tiny_models import build
    from hf_prefix_cache.token_ids import TokenIds

    ids = torch.tensor([[3, 2**31 - 5, 7, 9]], dtype=torch.int32)  # read as int64 whatever the dtype
    rows, _, reason = read_prompt(ids, None, None)
    assert reason is None and isinstance(rows[0], TokenIds)
    assert rows[0].packed == array("q", [3, 2**31 - 5, 7, 9]).tobytes()

    model = build("llama")
    store = PrefixCache(model)
    hits = Hits(store)
    first = torch.randint(5, 90, (1, 40), generator=torch.Generator().manual_seed(1))
    assert_same_as_cold(model, first, store)
    branch = torch.cat([first[:, :25], torch.randint(5, 90, (1, 10))], 1)
    branch[0, 25] = 95  # differs from the stored row at position 25
    # No step of the hit turns a row of ids into a tuple of Python ints (32k of them cost ~0.5 ms).
    built: list[int] = []
    ids_of = TokenIds.ids.fget
    assert ids_of is not None
    monkeypatch.setattr(TokenIds, "ids", property(lambda row: built.append(len(row)) or ids_of(row)))
    assert_same_as_cold(model, branch, store)
    assert built == []
    monkeypatch.undo()
    assert hits.last() == 25
    nodes = list(store._store._tree.iter_nodes())
    assert len(nodes) == 3 and all(node.packed is not None for node in nodes)
    store.check_integrity()  # bytes equal to every node's key
