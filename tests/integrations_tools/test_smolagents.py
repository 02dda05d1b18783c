"""integrations/smolagents: a ToolCallingAgent's steps reuse the steps before them, with the same transcript."""

from __future__ import annotations

from hf_prefix_cache import PrefixCache
from integrations_tools.examples import example, require, smollm2_dir

require("smolagents")


def test_every_step_after_the_first_reuses_the_previous_ones_and_the_transcript_equals_the_run_without_the_store() -> (
    None
):
    """Steps 2 and 3 restore at least the previous step's whole prompt; the answer and every step equal the cold run."""
    smollm2_dir()
    agent = example("smolagents/agent.py")
    agent_model = agent.load_agent_model(max_new_tokens=16)
    cold_answer, cold_steps = agent.run_agent(agent_model, max_steps=3)

    store = PrefixCache(agent_model.model, attach="all")
    requests = agent.measure_calls(agent_model, store)  # one request block per call of the agent's model
    answer, steps = agent.run_agent(agent_model, max_steps=3)
    store.detach()

    assert (answer, steps) == (cold_answer, cold_steps)
    assert [(r.calls, r.fallbacks) for r in requests] == [(1, {})] * len(requests)
    # Three action steps, then smolagents' final-answer call (a prompt of its own, so no reuse is expected there).
    assert len(requests) == 4, requests
    calls = requests[:3]
    assert calls[0].cached_tokens == 0 and calls[0].prompt_tokens > 900  # the system prompt with the tools, the task
    for before, after in zip(calls, calls[1:], strict=False):
        assert after.cached_tokens >= before.prompt_tokens, calls  # everything up to the previous step, at least
    stats = store.stats()
    assert stats.hit_tokens == sum(r.cached_tokens for r in requests)
    assert stats.prompt_tokens == sum(r.prompt_tokens for r in requests)
