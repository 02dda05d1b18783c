"""Per-row choice of the next token: greedy at temperature 0, else seeded sampling with the row's own generator.

A row's `Sampling` is what its request asked of the choice: temperature, top_k, top_p, a seed, a logit
bias, and how many tokens must come before an end token may. `Chooser` applies it to the row's logits
alone, with a `torch.Generator` of the row's own (seeded from its request), so a row's sample never
depends on the rows beside it in the batch. Settings this module does not implement are kept by name in
`Sampling.unsupported`: such a row runs alone through `generate` (`batching/eligibility.py`), never with
a setting silently ignored.

Example:
    >>> import torch
    >>> chooser = Chooser(Sampling(), end_ids=frozenset({2}))
    >>> chooser.choose(torch.tensor([0.0, 1.0, 3.0, 2.0]), num_generated=0)
    2
    >>> Chooser(Sampling(min_new_tokens=1), end_ids=frozenset({2})).choose(torch.tensor([0.0, 1.0, 3.0, 2.0]), 0)
    3
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, slots=True)
class Sampling:
    """How one row chooses its tokens.

    Attributes:
        temperature: 0 chooses greedily (the highest logit, as `generate` with ``do_sample=False``).
        top_k: keep only the `top_k` highest logits before sampling (None: all).
        top_p: keep the smallest set of tokens whose probability reaches `top_p` (None or 1: all).
        seed: the seed of the row's own generator (None: drawn from torch's global generator).
        logit_bias: added to the logits of these token ids before the choice (OpenAI's ``logit_bias``).
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
    min_new_tokens: int = 0
    unsupported: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {self.min_new_tokens}")

    @property
    def is_greedy(self) -> bool:
        """Whether the row chooses its highest logit (temperature 0)."""
        return self.temperature == 0


class Chooser:
    """One row's next-token choice under its `Sampling`, with its own generator (a row's sample is its own).

    Args:
        sampling: the row's settings.
        end_ids: the token ids that end the row (suppressed before `min_new_tokens`).
    """

    def __init__(self, sampling: Sampling, end_ids: frozenset[int]) -> None:
        self.sampling = sampling
        self._end_ids = sorted(end_ids)
        self._generator: torch.Generator | None = None
        if not sampling.is_greedy:
            seed = sampling.seed if sampling.seed is not None else int(torch.randint(0, 2**62, ()).item())
            self._generator = torch.Generator().manual_seed(seed)

    def choose(self, logits: torch.Tensor, num_generated: int) -> int:
        """The next token id from this row's `[vocab]` logits, `num_generated` tokens into its answer."""
        scores = logits.float()
        sampling = self.sampling
        if sampling.logit_bias or (num_generated < sampling.min_new_tokens and self._end_ids):
            scores = scores.clone()
            for token, bias in sampling.logit_bias.items():
                scores[token] += bias
            if num_generated < sampling.min_new_tokens:
                scores[self._end_ids] = float("-inf")
        if self._generator is None:
            return int(torch.argmax(scores).item())
        scores = scores / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < scores.shape[-1]:
            kth = torch.topk(scores, sampling.top_k).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        if sampling.top_p is not None and sampling.top_p < 1:
            scores = _top_p(scores, sampling.top_p)
        probs = torch.softmax(scores, dim=-1).cpu()
        return int(torch.multinomial(probs, 1, generator=self._generator).item())


def _top_p(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """`scores` with the tokens outside the smallest set whose probability reaches `top_p` masked (the top one kept)."""
    ordered, order = torch.sort(scores, descending=True)
    probs = torch.softmax(ordered, dim=-1)
    drop = probs.cumsum(-1) - probs >= top_p  # the mass of the tokens before this one already reaches top_p
    drop[0] = False
    return scores.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
