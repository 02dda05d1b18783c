"""`hf-prefix-cache serve` decodes the requests in flight together (the default), exactly as one at a time.

Two servers of the real SmolLM2 run for the module: one with batching on (the default), its prompts'
uncached parts past 32 tokens prefilled in pieces of 32 (``--prefill-chunk 32``: a first turn's ~100
tokens in 4 pieces, a later turn's suffix whole), and one with ``--no-batch`` (one ``generate`` at a
time, as transformers serve), the reference. Requests sent at
once to the first must each answer as the same request sent alone to the second, token for token at
temperature 0, with the same ``cached_tokens``; a later arrival must start before an earlier request
ends; settings the engine lacks still answer, counted as ``batch_alone:<why>`` in ``/metrics``.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from support.serve_server import ServeProcess

openai = pytest.importorskip("openai")

EOS_HELD = {"2": -100}  # SmolLM2's end token held back (a per-row logit bias): answers run their full length


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[ServeProcess, ServeProcess]]:
    """(batching, one at a time) over the real SmolLM2."""
    from hf_prefix_cache.api.models import ModelUnavailableError, smollm2_folder

    try:
        folder = str(smollm2_folder())
    except ModelUnavailableError as exc:
        pytest.skip(f"SmolLM2 is not available here: {exc}")
    batching = ServeProcess(folder, "--served-model-name", "m", "--prefill-chunk", "32", name="batch")
    sequential = ServeProcess(folder, "--served-model-name", "m", "--no-batch", name="no-batch")
    try:
        yield batching.wait(), sequential.wait()
    finally:
        batching.stop()
        sequential.stop()


def _messages(tag: str, question: str) -> list[dict[str, str]]:
    from hf_prefix_cache.api.sample_text import HANDBOOK

    return [
        {"role": "system", "content": f"[{tag}] You answer questions about this handbook.\n{HANDBOOK[:300]}"},
        {"role": "user", "content": question},
    ]


class Stream:
    """One streamed chat: its text, when its first and last tokens came (client side), its usage."""

    def __init__(self, server: ServeProcess, messages: list[dict[str, str]], **kwargs: Any) -> None:
        self.server, self.messages, self.kwargs = server, messages, kwargs
        self.text = ""
        self.first_at = self.last_at = 0.0
        self.usage: Any = None
        self.started = threading.Event()

    def run(self) -> Stream:
        body = {"model": "m", "messages": self.messages, "temperature": 0, **self.kwargs}
        chunks = self.server.client().chat.completions.create(
            **body, stream=True, stream_options={"include_usage": True}
        )
        for chunk in chunks:
            if chunk.choices and chunk.choices[0].delta.content:
                self.last_at = time.monotonic()
                if not self.first_at:
                    self.first_at = self.last_at
                    self.started.set()
                self.text += chunk.choices[0].delta.content
            if chunk.usage is not None:
                self.usage = chunk.usage
        self.started.set()
        return self

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.run)
        thread.start()
        return thread


def _ask(server: ServeProcess, messages: list[dict[str, str]], **kwargs: Any) -> tuple[str, int, int]:
    """One chat at temperature 0, not streamed: (answer, prompt_tokens, cached_tokens)."""
    body = {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8, **kwargs}
    response = server.client().chat.completions.create(**body)
    usage = response.usage
    return response.choices[0].message.content or "", usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def test_later_arrivals_start_before_the_first_ends_and_every_answer_equals_the_one_alone(
    servers: tuple[ServeProcess, ServeProcess],
) -> None:
    """A long stream starts; three more arrive once its first token is out: each of them gets its first token
    before the first one's last, and all four answers equal the same requests sent one at a time to --no-batch."""
    batching, sequential = servers
    questions = ["Who approves travel?", "What about hotels?", "Is a taxi fine?", "Who signs the forms?"]
    lengths = [30, 8, 10, 12]
    streams = [
        Stream(batching, _messages("together", q), max_tokens=n, logit_bias=EOS_HELD)
        for q, n in zip(questions, lengths, strict=True)
    ]
    first = streams[0].start()
    assert streams[0].started.wait(120)
    threads = [stream.start() for stream in streams[1:]]
    for thread in [first, *threads]:
        thread.join(180)
    alone = [
        Stream(sequential, _messages("together", q), max_tokens=n, logit_bias=EOS_HELD).run()
        for q, n in zip(questions, lengths, strict=True)
    ]
    assert [s.text for s in streams] == [s.text for s in alone] and all(s.text for s in streams)
    assert [s.usage.completion_tokens for s in streams] == lengths
    for later in streams[1:]:
        assert 0 < later.first_at < streams[0].last_at  # it started while the first one was generating
    store = batching.store(check=True)
    assert store["integrity"] == "ok" and store["pinned_nodes"] == 0
    assert store["batching"]["steps"] > 0 and store["batching"]["row_steps"] > store["batching"]["steps"]
    assert store["linear_kernels"].startswith(
        ("linear layers: prepacked", "linear layers: onednn", "linear layers: torch")
    )


def test_turn_two_reuses_as_much_under_batching_as_one_at_a_time(servers: tuple[ServeProcess, ServeProcess]) -> None:
    """Two conversations at once, two turns each: answers and cached_tokens equal those of --no-batch."""

    def conversation(server: ServeProcess, tag: str) -> list[tuple[str, int, int]]:
        messages = _messages(tag, "Who approves travel?")
        first = _ask(server, messages)
        messages += [{"role": "assistant", "content": first[0]}, {"role": "user", "content": "And abroad?"}]
        return [first, _ask(server, messages)]

    tags = ["amber", "violet"]  # no first word in common: which turn 1 is stored first cannot change the other's reuse
    for server in servers:  # ... once the template's first tokens, common to every tag, are stored on both
        _ask(server, _messages("warm", "Hello?"), max_tokens=1)
    together: list[Any] = [None, None]
    threads = [threading.Thread(target=lambda i=i: together.__setitem__(i, conversation(servers[0], tags[i]))) for i in (0, 1)]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(180)
    alone = [conversation(servers[1], tag) for tag in tags]
    assert together == alone
    assert all(turns[1][2] >= turns[0][1] for turns in together)  # turn 2 reused turn 1's prompt at least
    assert servers[0].store()["batching"]["pieces"] >= 4  # a first turn's ~100 uncached tokens, 32 a piece


def test_a_cancelled_stream_keeps_its_prompt_for_the_next_identical_request(
    servers: tuple[ServeProcess, ServeProcess],
) -> None:
    """A stream closed after two chunks ends at the next step; its prompt is stored: the same request again reuses
    all of it (cached_tokens = prompt - 1) and answers as --no-batch does."""
    batching, sequential = servers
    messages = _messages("cancelled", "Tell me a long story about expenses.")
    stream = batching.client().chat.completions.create(
        model="m", messages=messages, max_tokens=1000, temperature=0, stream=True
    )
    chunks = iter(stream)
    next(chunks), next(chunks)
    stream.close()
    deadline = time.monotonic() + 60
    while batching.store()["batching"]["rows"]:
        assert time.monotonic() < deadline, "the cancelled row never left the batch"
        time.sleep(0.1)
    answer, prompt_len, cached = _ask(batching, messages)
    assert cached == prompt_len - 1
    assert answer == _ask(sequential, messages)[0]


def test_a_setting_the_engine_lacks_answers_alone_and_is_counted(servers: tuple[ServeProcess, ServeProcess]) -> None:
    """no_repeat_ngram_size (sent in transformers serve's ``generation_config`` field) has no batched form: the
    request runs alone, answers as --no-batch does, and /metrics and the stats count it under its name; a
    frequency_penalty (generate's repetition_penalty), which the engine applies per row, joins and is not counted."""
    batching, sequential = servers
    messages = _messages("ngram", "List the travel rules.")
    alone = {"extra_body": {"generation_config": json.dumps({"no_repeat_ngram_size": 2})}, "max_tokens": 12}
    plain = Stream(batching, _messages("ngram", "Who approves travel?"), max_tokens=16, logit_bias=EOS_HELD)
    thread = plain.start()  # a batched row beside it
    served = _ask(batching, messages, **alone)
    penalised = _ask(batching, _messages("penalty", "List the travel rules."), frequency_penalty=0.5)
    thread.join(120)
    assert served[:2] == _ask(sequential, messages, **alone)[:2]  # (what each reused: their orders differ)
    assert penalised[:2] == _ask(sequential, _messages("penalty", "List the travel rules."), frequency_penalty=0.5)[:2]
    fallbacks = batching.store()["stats"]["fallbacks"]
    reason = "batch_alone:setting_no_repeat_ngram_size"
    assert fallbacks[reason] >= 1
    assert "batch_alone:setting_repetition_penalty" not in fallbacks
    metrics = batching.get("/metrics")
    counted = [
        float(line.split()[-1])
        for line in metrics.splitlines()
        if line.startswith("hf_prefix_cache_fallbacks_total{") and f'reason="{reason}"' in line
    ]
    assert counted and counted[0] >= 1
    assert "hf_prefix_cache_serve_batch_steps_total{" in metrics and "hf_prefix_cache_serve_batch_rows{" in metrics
    assert plain.text == Stream(sequential, plain.messages, max_tokens=16, logit_bias=EOS_HELD).run().text


def test_stop_strings_join_the_batch_and_end_where_one_at_a_time_ends(
    servers: tuple[ServeProcess, ServeProcess],
) -> None:
    """OpenAI `stop` (generate's stop_strings) is matched per row in the batch: the answer equals --no-batch's, cut at
    the same place, and nothing is counted as run alone for it."""
    batching, sequential = servers
    messages = _messages("stops", "Who approves travel?")
    full = _ask(sequential, messages, max_tokens=24)[0]
    words = full.split()
    stop = [f" {words[3]}", "zzqx"] if len(words) > 4 else ["\n"]  # one met inside the answer, one never
    plain = Stream(batching, _messages("stops", "What about hotels?"), max_tokens=16, logit_bias=EOS_HELD)
    thread = plain.start()  # a batched row beside it
    served = _ask(batching, messages, max_tokens=24, stop=stop)
    thread.join(120)
    assert served[0] == _ask(sequential, messages, max_tokens=24, stop=stop)[0]
    assert len(served[0]) < len(full)
    assert "batch_alone:setting_stop_strings" not in batching.store()["stats"]["fallbacks"]


def test_tenants_stay_apart_when_their_rows_decode_together(servers: tuple[ServeProcess, ServeProcess]) -> None:
    """The same prompt under two cache_salts at once: neither reuses the other's; each salt's second request reuses
    its own first."""
    batching, _ = servers
    messages = _messages("tenants", "Who approves travel?")
    firsts: dict[str, Any] = {}
    threads = [
        threading.Thread(target=lambda s=s: firsts.__setitem__(s, _ask(batching, messages, extra_body={"cache_salt": s})))
        for s in ("salt-a", "salt-b")
    ]  # fmt: skip
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert firsts["salt-a"][2] == firsts["salt-b"][2] == 0 and firsts["salt-a"][0] == firsts["salt-b"][0]
    again = _ask(batching, messages, extra_body={"cache_salt": "salt-a"})
    assert again[2] == again[1] - 1 and again[0] == firsts["salt-a"][0]


def test_the_options_cross_to_the_model_process_in_its_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve``'s flags become the loader's `BatchOptions` (threads: the admitted requests of every API server, plus
    one); ``--no-batch`` none; ``HF_PREFIX_CACHE_BATCH=0`` in the model's process turns batching off there too."""
    from hf_prefix_cache.frontends.serve import options_from
    from hf_prefix_cache.frontends.serve.batched import BatchOptions, from_env
    from hf_prefix_cache.frontends.serve_args import BATCH_ENV, build_parser

    args = build_parser().parse_args(["none", "--max-batch-rows", "4", "--max-queued", "8", "--api-server-count", "2"])
    loader = options_from(args).loader()
    assert loader.batch == BatchOptions(max_rows=4, max_runner_threads=17)
    chunked = build_parser().parse_args(["none", "--prefill-chunk", "0"])
    assert options_from(chunked).loader().batch == BatchOptions(prefill_chunk=0)
    unpacked = build_parser().parse_args(["none", "--no-pack-joins"])
    assert options_from(unpacked).loader().batch == BatchOptions(pack_joins=False)
    with pytest.raises(SystemExit, match="prefill-chunk"):
        options_from(build_parser().parse_args(["none", "--prefill-chunk", "-1"]))
    assert options_from(build_parser().parse_args(["none", "--no-batch"])).loader().batch is None
    monkeypatch.setenv(BATCH_ENV, "0")
    assert from_env(loader.batch) is None
    monkeypatch.setenv(BATCH_ENV, "1")
    assert from_env(None) == BatchOptions()
