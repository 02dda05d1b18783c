"""One chat turn through a store, streamed, with a report of what the cache did; no UI library.

`ChatEngine` holds a model, its processor (or tokenizer) and one `PrefixCache` shared by every
conversation; each conversation passes its own session name, so its latest entry stays pinned.
A turn builds the prompt with the processor's chat template, runs `generate` on a thread with a
`TextIteratorStreamer` inside a ``store.request()`` block (what the turn reused, whatever other
conversations run at once), and yields the growing answer, then a `TurnReport`: tokens reused (per
modality), time to first token through the store and cold, bytes per tier and the hit rate; with
`compare_cold` it also runs the whole answer cold and says whether the tokens are identical.
Decoding is greedy, so the cold answer must be the same.
"""

from __future__ import annotations

import threading
import time
import wave
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import TextIteratorStreamer

from hf_prefix_cache.api.prefix_cache import PrefixCache

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")
AUDIO_SUFFIXES = (".wav", ".mp3", ".flac", ".ogg", ".m4a")


@dataclass(frozen=True, slots=True)
class TurnReport:
    """What the cache did for one turn.

    Attributes:
        prompt_len: prompt tokens of the turn.
        reused_len: tokens restored from the store (0 when the turn ran cold).
        reused_by_modality: `reused_len` split into text / image / audio tokens.
        ttft_cached_s: seconds to the first new token through the store.
        ttft_cold_s: seconds to the first new token without it (a one-token cold run); None when
            the turn was not timed cold (``time_cold=False``).
        tier_nbytes: bytes stored per tier after the turn.
        hit_rate: the store's share of prompt tokens reused so far, over all conversations.
        fallback: why the turn reused nothing, where the store named a reason (a cold run's).
        cold_answer: the full cold answer (only with `compare_cold`).
        same_as_cold: whether its tokens equal the cached answer's (only with `compare_cold`).
        notes: inputs the model could not take (e.g. an image for a text-only model).
    """

    prompt_len: int
    reused_len: int
    reused_by_modality: dict[str, int]
    ttft_cached_s: float
    ttft_cold_s: float | None
    tier_nbytes: dict[str, int]
    hit_rate: float
    fallback: str | None = None
    cold_answer: str | None = None
    same_as_cold: bool | None = None
    notes: tuple[str, ...] = ()


@dataclass(slots=True)
class Conversation:
    """A conversation's messages in the processor's chat format and its session name."""

    session: str
    messages: list[dict[str, Any]] = field(default_factory=list)
    reports: list[TurnReport] = field(default_factory=list)


def read_wav(path: str, rate: int) -> np.ndarray:
    """A WAV file (8, 16 or 32-bit PCM) as mono float32 in [-1, 1] at `rate` Hz (linear resampling).

    Raises:
        ValueError: the file is not PCM WAV of a supported sample width.
    """
    with wave.open(str(path), "rb") as f:
        width, channels, source_rate = f.getsampwidth(), f.getnchannels(), f.getframerate()
        raw = f.readframes(f.getnframes())
    dtypes = {1: np.uint8, 2: np.int16, 4: np.int32}
    if width not in dtypes:
        raise ValueError(f"{path}: {8 * width}-bit WAV is not supported; use 8, 16 or 32-bit PCM")
    samples = np.frombuffer(raw, dtype=dtypes[width]).astype(np.float32)
    samples = (samples - 128.0) / 128.0 if width == 1 else samples / float(2 ** (8 * width - 1))
    samples = samples.reshape(-1, channels).mean(axis=1)
    if source_rate != rate and len(samples) > 1:
        n = max(1, round(len(samples) * rate / source_rate))
        samples = np.interp(np.linspace(0, len(samples) - 1, n), np.arange(len(samples)), samples)
    out: np.ndarray = samples.astype(np.float32)
    return out


class _TimedStreamer(TextIteratorStreamer):
    """A `TextIteratorStreamer` noting when the first generated token arrives."""

    def __init__(self, tokenizer: Any, **kwargs: Any) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True, **kwargs)
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        if self.first_token_at is None and not self.next_tokens_are_prompt:
            self.first_token_at = time.perf_counter()
        super().put(value)  # type: ignore[no-untyped-call]


class ChatEngine:
    """Streams chat turns of any number of conversations through one shared store.

    Args:
        model: a transformers generative model (text or vision-language).
        processor: its processor (for media) or tokenizer, with a chat template.
        store: the store to share; default `PrefixCache(model)`.
        max_new_tokens: answer length limit per turn.

    Example:
        >>> engine = ChatEngine(model, tokenizer)                                # doctest: +SKIP
        >>> chat = engine.new_conversation("alice")                              # doctest: +SKIP
        >>> for answer, report in engine.turn(chat, "Hello!"):                   # doctest: +SKIP
        ...     pass
        >>> report.reused_len, report.ttft_cached_s, report.ttft_cold_s          # doctest: +SKIP
    """

    def __init__(self, model: Any, processor: Any, store: PrefixCache | None = None, max_new_tokens: int = 64) -> None:
        self.model = model
        self.processor = processor
        self.tokenizer = getattr(processor, "tokenizer", processor)
        self.store = store if store is not None else PrefixCache(model)
        self.max_new_tokens = max_new_tokens
        self.takes_images = getattr(processor, "image_processor", None) is not None
        self.takes_audio = getattr(processor, "feature_extractor", None) is not None

    def new_conversation(self, session: str) -> Conversation:
        return Conversation(session)

    def user_message(self, text: str, files: Sequence[str] = ()) -> tuple[dict[str, Any], list[str]]:
        """The user message for `text` and uploaded `files`, and notes on files the model cannot take."""
        from PIL import Image

        content: list[dict[str, Any]] = []
        notes: list[str] = []
        for path in files:
            name = str(path).lower()
            if name.endswith(IMAGE_SUFFIXES):
                if self.takes_images:
                    with Image.open(path) as img:
                        content.append({"type": "image", "image": img.convert("RGB")})
                else:
                    notes.append(f"{type(self.model).__name__} takes no images: {path.rsplit('/', 1)[-1]} ignored")
            elif name.endswith(AUDIO_SUFFIXES):
                if self.takes_audio and name.endswith(".wav"):
                    rate = int(getattr(self.processor.feature_extractor, "sampling_rate", 16000))
                    content.append({"type": "audio", "audio": read_wav(path, rate)})
                elif self.takes_audio:
                    notes.append(f"only WAV audio is decoded here: {path.rsplit('/', 1)[-1]} ignored")
                else:
                    notes.append(f"{type(self.model).__name__} takes no audio: {path.rsplit('/', 1)[-1]} ignored")
            else:
                notes.append(f"unknown file type: {path.rsplit('/', 1)[-1]} ignored")
        if text:
            content.append({"type": "text", "text": text})
        return {"role": "user", "content": content}, notes

    def _inputs(self, messages: list[dict[str, Any]]) -> dict[str, Any]:
        if not (self.takes_images or self.takes_audio):
            # Text-only chat templates expect string contents.
            messages = [
                {"role": m["role"], "content": "".join(c.get("text", "") for c in m["content"])} for m in messages
            ]
        inputs = self.processor.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
        )
        device = getattr(self.model, "device", None)
        return {
            k: (v.to(device) if isinstance(v, torch.Tensor) and device is not None else v) for k, v in inputs.items()
        }

    def turn(
        self,
        conversation: Conversation,
        text: str,
        files: Sequence[str] = (),
        compare_cold: bool = False,
        time_cold: bool = True,
    ) -> Iterator[tuple[str, TurnReport | None]]:
        """Add the user's message, stream the answer, then yield it once more with its report.

        `time_cold` runs the prompt once without the store first (prefill and one token) for the
        report's cold time to first token; a terminal chat leaves it off, so answers start at once.

        Yields:
            `(answer so far, None)` while streaming, then `(answer, TurnReport)`.
        """
        message, notes = self.user_message(text, files)
        conversation.messages.append(message)
        inputs = self._inputs(conversation.messages)
        ids = inputs["input_ids"]
        settings = {"max_new_tokens": self.max_new_tokens, "do_sample": False}
        ttft_cold: float | None = None
        if time_cold:  # prefill plus one token, without the store
            start = time.perf_counter()
            with torch.inference_mode():
                self.model.generate(**inputs, **{**settings, "max_new_tokens": 1})
            ttft_cold = time.perf_counter() - start

        streamer = _TimedStreamer(self.tokenizer)
        result: dict[str, Any] = {}
        request = self.store.request()  # entered on the thread that generates

        def work() -> None:
            try:
                with torch.inference_mode(), request:
                    result["out"] = self.model.generate(
                        **inputs,
                        **settings,
                        streamer=streamer,
                        cache=self.store.session(conversation.session),
                    )
            except BaseException as exc:  # surfaced on the caller's thread below
                result["error"] = exc
                streamer.end()  # type: ignore[no-untyped-call]

        thread = threading.Thread(target=work, name=f"generate-{conversation.session}", daemon=True)
        start = time.perf_counter()
        thread.start()
        answer = ""
        for chunk in streamer:
            answer += chunk
            yield answer, None
        thread.join()
        if "error" in result:
            conversation.messages.pop()
            raise result["error"]
        ttft_cached = (streamer.first_token_at or time.perf_counter()) - start
        out = result["out"]
        new_ids = out[0, ids.shape[1] :]
        answer = self.tokenizer.decode(new_ids, skip_special_tokens=True)
        cold_answer = same = None
        if compare_cold:
            with torch.inference_mode():
                cold = self.model.generate(**inputs, **settings)
            same = torch.equal(cold, out)
            cold_answer = self.tokenizer.decode(cold[0, ids.shape[1] :], skip_special_tokens=True)
        conversation.messages.append({"role": "assistant", "content": [{"type": "text", "text": answer}]})
        stats = self.store.stats()
        report = TurnReport(
            prompt_len=int(ids.shape[1]),
            reused_len=request.cached_tokens,
            reused_by_modality=request.cached_tokens_by_modality,
            ttft_cached_s=ttft_cached,
            ttft_cold_s=ttft_cold,
            tier_nbytes={"device": stats.device_nbytes, "host": stats.host_nbytes, "disk": stats.disk_nbytes},
            hit_rate=stats.hit_rate,
            fallback=next(iter(request.fallbacks), None) if request.cached_tokens == 0 else None,
            cold_answer=cold_answer,
            same_as_cold=same,
            notes=tuple(notes),
        )
        conversation.reports.append(report)
        yield answer, report

    def close(self, conversation: Conversation) -> None:
        """Release the conversation's pinned entry (it stays stored)."""
        self.store.session(conversation.session).close()
