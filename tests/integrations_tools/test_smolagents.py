"""integrations/smolagents: a ToolCallingAgent's steps reuse the steps before them, with the same transcript."""

from __future__ import annotations

from hf_prefix_cache import PrefixCache, RequestEvent
from integrations_tools.examples import example, require, smollm2_dir

require("smolagents")


def test_every_step_after_the_first_reuses_the_previous_ones_and_the_transcript_equals_the_run_without_the_store() -> (
    None
):
    """Each step restores at least the previous step's whole prompt; answers and steps equal the cold run."""
    smollm2_dir()
    agent = example("smolagents/agent.py")
    agent_model = agent.load_agent_model(max_new_tokens=24)
    cold_answer, cold_steps = agent.run_agent(agent_model, max_steps=2)

    store = PrefixCache(agent_model.model, attach="all")
    events: list[RequestEvent] = []
    store.on_request(events.append)
    answer, steps = agent.run_agent(agent_model, max_steps=2)
    store.detach()

    assert (answer, steps) == (cold_answer, cold_steps)
    assert [event.fallback for event in events] == [None] * len(events)
    # Two action steps, then smolagents' final-answer call (a prompt of its own, so no reuse is expected there).
    assert len(events) == 3, events
    first, second = events[0], events[1]
    assert first.hit_len == 0
    assert second.hit_len >= first.prompt_len > 900, (first, second)  # the system prompt, task and step 1
    assert store.stats().hit_tokens >= second.hit_len
