"""Property-based: request bodies drawn from the OpenAI shapes (right and wrong), sent with the real `openai` client.

Hypothesis draws chat requests whose every field may be of the right type, the wrong type or out of
range; the server must answer each with a 200 or a 4xx (never a 5xx, never a dropped
connection), stay up, and keep its store intact. One tiny-chat-model server serves the module.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from support.serve_server import ServeProcess, tiny_chat_folder

openai = pytest.importorskip("openai")
hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

NAME = "tiny"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServeProcess]:
    from hf_prefix_cache.api.models import ModelUnavailableError

    try:
        folder = tiny_chat_folder(Path(tmp_path_factory.mktemp("tiny-llama")))
    except ModelUnavailableError as exc:
        pytest.skip(f"the tiny chat model needs SmolLM2's tokenizer: {exc}")
    process = ServeProcess(folder, "--served-model-name", NAME)
    try:
        yield process.wait()
    finally:
        process.stop()


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=12),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=4), st.integers(), max_size=2),
)
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": st.text(max_size=20)})
image_part = st.fixed_dictionaries(
    {
        "type": st.just("image_url"),
        "image_url": st.fixed_dictionaries({"url": st.sampled_from(["data:image/png;base64,AAAA", "x", ""])}),
    }
)
content = st.one_of(st.text(max_size=40), st.lists(st.one_of(text_part, image_part), max_size=2), junk)
message = st.one_of(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "wizard"]), "content": content}),
    junk,
)
maybe = {
    "max_tokens": st.one_of(st.integers(min_value=-3, max_value=6), st.integers(min_value=3000, max_value=2**70), junk),
    "temperature": st.one_of(st.floats(min_value=-1, max_value=3, allow_nan=False), junk),
    "top_p": st.one_of(st.floats(min_value=-0.5, max_value=1.5, allow_nan=False), junk),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.text(max_size=3), max_size=6), junk),
    "seed": st.one_of(st.integers(min_value=-2, max_value=2**33), junk),
    "cache_salt": st.one_of(st.text(min_size=0, max_size=300), junk),
    "n": st.one_of(st.integers(min_value=0, max_value=3), junk),
}
bodies = st.fixed_dictionaries(
    {"messages": st.one_of(st.lists(message, max_size=3), junk)},
    optional=maybe,  # type: ignore[arg-type]
)


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=bodies)
def test_any_chat_body_gets_a_200_or_a_4xx(server: ServeProcess, body: dict[str, Any]) -> None:
    """The openai client sends the drawn body; the answer is a completion or a 4xx with an error message."""
    client = server.client(timeout=60)
    messages = body.pop("messages")
    extra = {k: body.pop(k) for k in list(body) if k not in ("max_tokens", "temperature", "top_p", "stop", "seed", "n")}
    body.setdefault("max_tokens", 3)
    try:
        done = client.chat.completions.create(model=NAME, messages=messages, extra_body=extra or None, **body)
    except openai.APIStatusError as exc:
        assert 400 <= exc.status_code < 500, (exc.status_code, exc.response.text[:300])
        assert exc.response.json()["error"]["message"]
        return
    assert done.choices[0].message.content is not None


def test_the_store_is_intact_after_the_fuzzing(server: ServeProcess) -> None:
    """After whatever was sent, the store passes its integrity check and holds no pin."""
    store = server.store(check=True)
    assert store["integrity"] == "ok" and store["pinned_nodes"] == 0
