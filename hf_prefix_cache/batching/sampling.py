"""Per-row choice of the next token, with transformers' own logits processors in `generate`'s order.

A row's `Sampling` is what its request asked of the choice: a logit bias, a repetition penalty, how
many tokens must come before an end token may, and, when it samples, temperature, top_k, top_p and a
seed. `Chooser` applies them to the row's `[vocab]` logits alone with the processors `generate` builds
for the same settings (`SequenceBiasLogitsProcessor`, `RepetitionPenaltyLogitsProcessor`,
`TemperatureLogitsWarper`, `TopKLogitsWarper`, `TopPLogitsWarper`, in `_get_logits_processor`'s order;
the end ids held back as `MinNewTokensLengthLogitsProcessor` does), so a row's scores are the ones
`generate` computes from the same logits: greedy rows choose the same tokens.

A sampling row draws from a `torch.Generator` of its own, on the logits' device, seeded from its
request (`torch.manual_seed(seed)`, as transformers serve seeds before `generate`, seeds the global
generator with the same number): its sample never depends on the rows beside it, and a seeded row
draws what `generate` alone draws after `torch.manual_seed(seed)`, as long as the batch's logits are
bitwise the ones `generate` computes. They agree within 1e-4, not bitwise, so a token whose draw lies
on a boundary between two tokens may differ: the tests check a seeded row equals `generate` on the
tiny models and that it never depends on its neighbours. Settings this module does not implement are
kept by name in `Sampling.unsupported`: such a row runs alone through `generate`
(`batching/eligibility.py`), never with a setting silently ignored.

Example:
    >>> import torch
    >>> chooser = Chooser(Sampling(), end_ids=frozenset({2}))
    >>> chooser.choose(torch.tensor([0.0, 1.0, 3.0, 2.0]), generated=[])
    2
    >>> Chooser(Sampling(min_new_tokens=1), end_ids=frozenset({2})).choose(torch.tensor([0.0, 1.0, 3.0, 2.0]), [])
    3
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from hf_prefix_cache.errors import InconsistentStateError


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one row chooses its tokens (each setting as `generate` takes it).

    Attributes:
        temperature: 0 chooses greedily (the highest score, as `generate` with ``do_sample=False``).
        top_k: keep only the `top_k` highest scores before sampling (None: all).
        top_p: keep the smallest set of tokens whose probability reaches `top_p` (None or 1: all).
        seed: the seed of the row's own generator (None: drawn from torch's global generator).
        logit_bias: added to the logits of these token ids (OpenAI's ``logit_bias``, `generate`'s one-token
            ``sequence_bias``).
        repetition_penalty: `generate`'s ``repetition_penalty`` (1: none): the score of every token in the
            prompt or the answer so far is divided by it (multiplied where negative). transformers serve maps
            OpenAI's ``frequency_penalty`` f to ``1 + f``.
        min_new_tokens: an end token is never chosen before this many tokens were generated.
        unsupported: names of requested settings this module does not implement (the row runs alone).

    Example:
        >>> Sampling(temperature=0.7, top_p=0.9, seed=3).is_greedy
        False
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    logit_bias: dict[int, float] = field(default_factory=dict)
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1 (None: no top_k), got {self.top_k}")
        if self.top_p is not None and not 0 <= self.top_p <= 1:
            raise ValueError(f"top_p must be in [0, 1], got {self.top_p}")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")

    @property
    def is_greedy(self) -> bool:
        """Whether the row chooses its highest score (temperature 0)."""
        return self.temperature == 0


class Chooser:
    """One row's next-token choice under its `Sampling`, with its own generator (a row's sample is its own).

    Args:
        sampling: the row's settings.
        end_ids: the token ids that end the row (suppressed before `min_new_tokens`).
        prompt: the row's prompt ids (the repetition penalty counts them, as `generate`'s does).
    """

    def __init__(self, sampling: Sampling, end_ids: frozenset[int], prompt: Sequence[int] = ()) -> None:
        self.sampling = sampling
        self._end_ids = sorted(end_ids)
        self._prompt = list(prompt)
        self._seed: int | None = None
        self._generator: torch.Generator | None = None
        # generate's order (`_get_logits_processor`): bias, repetition penalty, min_new_tokens, then the warpers
        self._before: list[LogitsProcessor] = []
        if sampling.logit_bias:
            bias = {(int(token),): float(value) for token, value in sampling.logit_bias.items()}
            self._before.append(SequenceBiasLogitsProcessor(sequence_bias=bias))  # type: ignore[arg-type]
        if sampling.repetition_penalty != 1.0:
            self._before.append(RepetitionPenaltyLogitsProcessor(float(sampling.repetition_penalty)))
        self._warpers: list[LogitsProcessor] = []
        if not sampling.is_greedy:
            self._seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
            if sampling.temperature != 1.0:
                self._warpers.append(TemperatureLogitsWarper(sampling.temperature))
            if sampling.top_k is not None:
                self._warpers.append(TopKLogitsWarper(top_k=sampling.top_k))
            if sampling.top_p is not None and sampling.top_p < 1.0:
                self._warpers.append(TopPLogitsWarper(top_p=sampling.top_p))

    def choose(self, logits: torch.Tensor, generated: Sequence[int]) -> int:
        """The next token id from this row's `[vocab]` logits, after the `generated` tokens of its answer."""
        scores = logits.float()[None, :]  # [1, vocab]: the processors' shape
        ids = self._ids(scores.device, generated) if self._before or self._warpers else None
        for processor in self._before:
            scores = processor(ids, scores)
        if len(generated) < self.sampling.min_new_tokens and self._end_ids:
            scores = scores.clone()
            scores[:, self._end_ids] = float("-inf")
        if self._seed is None:
            return int(torch.argmax(scores, dim=-1).item())
        for warper in self._warpers:
            scores = warper(ids, scores)
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self._generator_on(probs.device)).item())

    def _ids(self, device: torch.device, generated: Sequence[int]) -> torch.LongTensor:
        """The row's ids so far, `[1, n]`, where a processor reads them (the repetition penalty); else none."""
        if self.sampling.repetition_penalty == 1.0:
            return torch.empty((1, 0), dtype=torch.long, device=device)  # type: ignore[return-value]
        return torch.tensor([[*self._prompt, *generated]], dtype=torch.long, device=device)  # type: ignore[return-value]

    def _generator_on(self, device: torch.device) -> torch.Generator:
        """The row's generator on `device` (where `generate` would draw: the global generator of that device)."""
        if self._generator is None or self._generator.device != device:
            if self._seed is None:
                raise InconsistentStateError("a greedy row was asked to draw a token at random")
            self._generator = torch.Generator(device=device).manual_seed(self._seed)
        return self._generator
