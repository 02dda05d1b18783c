"""Looped decoders: cache layers a model appends for its repeated passes over a span of its layers.

Inkling 2 Loop runs layers ``[loop_layer_index_start, loop_layer_index_end)`` `loop_num_passes` times;
each pass after the first keeps its keys, values and conv states in copies of those layers' cache
layers, which its forward appends to a cache that holds exactly `num_hidden_layers` layers. The
working cache holds them from the start (transformers' layout names only `num_hidden_layers`), so
every pass's states are captured, restored and snapshotted as any layer's, and the model appends nothing.

Example:
    >>> looped = {"loop_layer_index_start": 1, "loop_layer_index_end": 2, "loop_num_passes": 3}
    >>> types, kwargs = with_loop_passes(type("C", (), looped)(), ["a", "b", "c"], [{}, {"w": 1}, {}])
    >>> types
    ['a', 'b', 'c', 'b', 'b']
"""

from __future__ import annotations

from typing import Any


def with_loop_passes(
    config: Any, layer_types: list[str], per_layer_kwargs: list[dict[str, Any]]
) -> tuple[list[str], list[dict[str, Any]]]:
    """`layer_types` and their kwargs followed by the looped span's once per pass after the first (as many as
    the model appends: its span clipped to its layers); unchanged for a model that does not loop."""
    names = ("loop_layer_index_start", "loop_layer_index_end", "loop_num_passes")
    values = [value for name in names if isinstance(value := getattr(config, name, None), int)]
    if len(values) != len(names) or any(isinstance(v, bool) for v in values):
        return layer_types, per_layer_kwargs
    start, end, passes = values
    if passes < 2:
        return layer_types, per_layer_kwargs
    extra = passes - 1
    return (
        layer_types + layer_types[start:end] * extra,
        per_layer_kwargs + [dict(kwargs) for kwargs in per_layer_kwargs[start:end] * extra],
    )
