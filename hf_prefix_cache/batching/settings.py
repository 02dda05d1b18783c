"""From `generate` keyword arguments, as transformers serve builds them for a request, to the engine's `Request`.

transformers serve (`cli/serving`: `_build_generation_kwargs` of the chat and completion handlers) turns
an OpenAI request into `generate` keyword arguments on top of the model's generation config:

``` text
OpenAI field                    generate kwarg                      Request / Sampling
max_tokens, max_completion_t.   max_new_tokens                      max_new_tokens
temperature (0: do_sample off)  temperature, do_sample              Sampling.temperature (0 when not sampling)
top_p                           top_p (top_k: the model's config)   Sampling.top_p, Sampling.top_k
seed                            seed (torch.manual_seed first)      Sampling.seed
logit_bias                      sequence_bias {(id,): bias}         Sampling.logit_bias
frequency_penalty f             repetition_penalty 1 + f            Sampling.repetition_penalty
stop                            stop_strings (+ tokenizer=)         Request.stop_strings, Request.tokenizer
(model's end ids)               eos_token_id                        Request.end_ids
presence_penalty                (not mapped: transformers serve ignores it)
```

`request_from_generate_kwargs` maps them to a `Request` the batch decodes with those settings applied
per row. Any other key (beams, ``no_repeat_ngram_size``, ``min_p``, a ``sequence_bias`` over several
tokens, ``cache_implementation``, ...) goes to `Request.generate_kwargs`, so the row runs alone through
`generate` (``batch_alone:setting_<name>``), never with a setting silently ignored. A key whose value is
None is dropped, as transformers serve drops it before `generate`; the sampling keys then take
`generate`'s global defaults (``top_k`` 50, ``temperature`` and ``top_p`` 1, no sampling), as the server
copies them from the model's config, where None means the model sets none. Settings of the model's own
`generation_config` that the kwargs do not name (a checkpoint's ``repetition_penalty``, say) are not seen
here: `generate` would apply them, the engine does not.

Example:
    >>> request = request_from_generate_kwargs(
    ...     [1, 2, 3], {"max_new_tokens": 8, "do_sample": True, "temperature": 0.7, "top_k": 50, "top_p": 0.9,
    ...     "seed": 4, "eos_token_id": 2, "repetition_penalty": 1.1, "num_beams": 2})
    >>> request.max_new_tokens, request.end_ids, request.sampling.top_k, request.generate_kwargs
    (8, frozenset({2}), 50, {'num_beams': 2})
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from hf_prefix_cache.batching.rows import Request
from hf_prefix_cache.batching.sampling import Sampling

#: The kwargs this module maps onto the row; any other goes to `Request.generate_kwargs` (the row runs alone).
MAPPED = frozenset(
    {
        "max_new_tokens",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "sequence_bias",
        "repetition_penalty",
        "min_new_tokens",
        "eos_token_id",
        "stop_strings",
        "tokenizer",
    }
)


def request_from_generate_kwargs(
    ids: Sequence[int],
    generation_kwargs: Mapping[str, Any],
    tokenizer: Any = None,
    eos_ids: Iterable[int] = (),
    salt: str | None = None,
    timeout_s: float | None = None,
) -> Request:
    """The engine's `Request` for a prompt and the `generate` kwargs transformers serve built for it.

    Args:
        ids: the prompt's token ids.
        generation_kwargs: `generate`'s keyword arguments (``max_new_tokens`` required); not changed.
        tokenizer: the model's tokenizer (needed when the kwargs have ``stop_strings``; a ``tokenizer`` in the
            kwargs serves when this is None).
        eos_ids: the end ids when the kwargs have no ``eos_token_id`` (the model's, as `generate` would use).
        salt: the store namespace's salt of the request.
        timeout_s: seconds after which the row ends (None: never).

    Returns:
        A `Request` whose unmapped settings, if any, are in `generate_kwargs` (it then runs alone).

    Raises:
        ValueError: no ``max_new_tokens``, or ``stop_strings`` without a tokenizer.
    """
    kwargs = {name: value for name, value in generation_kwargs.items() if value is not None}
    if "max_new_tokens" not in kwargs:
        raise ValueError("generation_kwargs need max_new_tokens (transformers serve always sets it)")
    rest = {name: value for name, value in kwargs.items() if name not in MAPPED}
    bias = _one_token_bias(kwargs.get("sequence_bias"))
    if bias is None:
        rest["sequence_bias"] = kwargs["sequence_bias"]  # biases over several tokens: generate applies them
    sampling = _sampling(kwargs, bias or {}, rest)
    eos = kwargs.get("eos_token_id", list(eos_ids))
    stops = kwargs.get("stop_strings", ())
    return Request(
        ids,
        max_new_tokens=int(kwargs["max_new_tokens"]),
        sampling=sampling,
        end_ids=frozenset([eos] if isinstance(eos, int) else [int(e) for e in eos]),
        stop_strings=(stops,) if isinstance(stops, str) else tuple(stops),
        tokenizer=tokenizer if tokenizer is not None else kwargs.get("tokenizer"),
        salt=salt,
        timeout_s=timeout_s,
        generate_kwargs=rest,
    )


def _sampling(kwargs: Mapping[str, Any], bias: dict[int, float], rest: dict[str, Any]) -> Sampling:
    """The row's `Sampling`; a value `generate` would refuse goes to `rest` (the row runs alone: generate says why)."""
    penalty = float(kwargs.get("repetition_penalty", 1.0))
    if not penalty > 0:
        rest["repetition_penalty"], penalty = penalty, 1.0
    common: dict[str, Any] = {
        "logit_bias": bias,
        "repetition_penalty": penalty,
        "min_new_tokens": int(kwargs.get("min_new_tokens", 0)),
    }
    if not kwargs.get("do_sample", False):  # generate ignores temperature, top_k and top_p when not sampling
        return Sampling(**common)
    # absent (or None): generate's global defaults (`GenerationConfig._get_default_generation_params`)
    temperature = float(kwargs.get("temperature", 1.0))
    top_k = int(kwargs.get("top_k", 50))
    top_p = float(kwargs.get("top_p", 1.0))
    if temperature <= 0 or top_k < 0 or top_p < 0:  # generate raises for these
        rest.update(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
        return Sampling(**common)
    return Sampling(
        temperature=temperature,
        top_k=top_k if top_k > 0 else None,
        top_p=top_p if top_p < 1.0 else None,
        seed=int(kwargs["seed"]) if "seed" in kwargs else None,
        **common,
    )


def _one_token_bias(sequence_bias: Any) -> dict[int, float] | None:
    """`sequence_bias` as `{token: bias}` when every biased sequence is one token (None: some are longer)."""
    if sequence_bias is None:
        return {}
    if not isinstance(sequence_bias, Mapping):
        return None
    if not all(isinstance(key, tuple) and len(key) == 1 for key in sequence_bias):
        return None
    return {int(key[0]): float(value) for key, value in sequence_bias.items()}
