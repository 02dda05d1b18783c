"""Mllama (cross-attention VLM) through the store equals cold runs, and skips the vision tower for cached images.

A tiny random Mllama (vision: 28x28 tiles of 14x14 patches, at most 2 tiles, 5 vision tokens
per tile; text: 3 layers, layer 1 cross-attention) with its tanh gates opened, so images change
the text states. Media come from the real `MllamaImageProcessorPil` and the processor's
cross-attention mask functions, as `MllamaProcessor` builds them. Every request runs cold and
through the store: equal tokens, logits within 1e-4; hits and vision-tower images are counted.

In transformers 5.23 text before the first image attends to every image of the prompt, so
entries are shared only between prompts with the same images (see `multimodal/mllama.py`).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import LOGIT_TOL, generate, max_logit_diff
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.testing.media.harness import served
from hf_prefix_cache.testing.media.mllama import IMAGE, IMAGE_ID, MAX_TILES, SUPPRESS, media, picture, text, tiny_mllama

NEW = 5


class Runner:
    """Runs prompts cold and through one store; remembers hits, vision-tower images and logit diffs."""

    def __init__(self, store: PrefixCache) -> None:
        self.store = store
        self.model = store.model
        self.encoded = 0
        self.diffs: list[float] = []
        self._hits = 0

    def check(self, ids: torch.Tensor, images: list[Image.Image], **extra: Any) -> Any:
        kwargs = {**(media(ids, images) if images else {}), "suppress_tokens": SUPPRESS, **extra}
        cold = generate(self.model, ids, NEW, **kwargs)
        seen: list[int] = []

        def record(_module: Any, args: tuple[Any, ...], kw: dict[str, Any], _out: Any) -> None:
            pixels = args[0] if args else kw["pixel_values"]
            seen.append(int(pixels.shape[1]))

        handle = self.model.model.vision_model.register_forward_hook(record, with_kwargs=True)
        try:
            warm = generate(self.model, ids, NEW, past_key_values=self.store, **kwargs)
        finally:
            handle.remove()
        self.encoded = sum(seen)
        assert torch.equal(cold.sequences, warm.sequences), f"tokens differ:\n{cold.sequences}\n{warm.sequences}"
        diff = max_logit_diff(cold, warm)
        assert diff < LOGIT_TOL, f"logits differ by {diff}"
        self.diffs.append(diff)
        self.store.check_integrity()
        return warm

    def hit(self) -> int:
        """Prompt tokens served from the store since the last call."""
        now = self.store.stats().hit_tokens
        hit, self._hits = now - self._hits, now
        return hit


@pytest.fixture
def runner() -> Iterator[Runner]:
    store = PrefixCache(tiny_mllama())
    yield Runner(store)
    store.detach()


def _turn(previous: Any, *parts: torch.Tensor) -> torch.Tensor:
    return torch.cat([previous.sequences, *parts], dim=1)


def test_text_before_the_first_image_depends_on_the_image() -> None:
    """transformers 5.23 lets text rows with an all-zero cross-attention mask attend to every image.

    This is why entries are scoped by the prompt's images; if it stops holding, more reuse is possible.
    """
    model = tiny_mllama()
    ids = torch.cat([text(5, 1), IMAGE, text(4, 2)], dim=1)
    with torch.no_grad():
        a = model(input_ids=ids, **media(ids, [picture(1)])).logits[0, :5]
        b = model(input_ids=ids, **media(ids, [picture(2)])).logits[0, :5]
    assert (a - b).abs().max().item() > 1e-3


def test_exact_repeat_restores_cross_attention_without_the_vision_tower(runner: Runner) -> None:
    """The same prompt and image again reuses all but the last token and never runs the vision tower."""
    ids = torch.cat([text(5, 1), IMAGE, text(8, 2)], dim=1)
    runner.check(ids, [picture(0)])
    assert runner.hit() == 0 and runner.encoded == 1
    runner.check(ids, [picture(0)])
    assert runner.hit() == ids.shape[1] - 1 and runner.encoded == 0
    assert not runner.store.stats().fallbacks


def test_follow_up_text_turn_reuses_the_whole_conversation(runner: Runner) -> None:
    """A text-only follow-up (the image passed again, as a processor does) reuses turn 1 and its answer."""
    ids = torch.cat([text(5, 1), IMAGE, text(8, 2)], dim=1)
    first = runner.check(ids, [picture(0)])
    runner.hit()
    second = _turn(first, text(6, 3))
    runner.check(second, [picture(0)])
    assert runner.hit() == first.sequences.shape[1] - 1 and runner.encoded == 0
    assert not runner.store.stats().fallbacks


def test_second_image_in_the_suffix_is_a_named_miss(runner: Runner) -> None:
    """Adding an image changes every earlier token's states: nothing is reused, the event is named, the
    new entry serves the next turn without the vision tower."""
    prefix = torch.cat([text(5, 1), IMAGE, text(6, 2)], dim=1)
    runner.check(prefix, [picture(0)])
    runner.hit()
    second = torch.cat([prefix, text(4, 3), IMAGE, text(3, 4)], dim=1)
    answer = runner.check(second, [picture(0), picture(1)])
    assert runner.hit() == 0 and runner.encoded == 2
    assert runner.store.stats().fallbacks == {"cross_attention_new_image": 1}
    runner.check(_turn(answer, text(3, 5)), [picture(0), picture(1)])
    assert runner.hit() == answer.sequences.shape[1] - 1 and runner.encoded == 0


def test_changed_first_image_with_identical_tokens_reuses_nothing(runner: Runner) -> None:
    """Same token ids, another picture: even the text before the placeholder is recomputed (it sees the image)."""
    ids = torch.cat([text(5, 1), IMAGE, text(8, 2)], dim=1)
    runner.check(ids, [picture(0)])
    runner.hit()
    runner.check(ids, [picture(4)])
    assert runner.hit() == 0 and runner.encoded == 1
    runner.check(ids, [picture(0)])  # the first picture's entry is still there
    assert runner.hit() == ids.shape[1] - 1 and runner.encoded == 0


def test_three_turn_chat_with_a_new_image_in_turn_three(runner: Runner) -> None:
    """Turn 2 reuses turn 1; turn 3 adds an image (a named miss); turn 4 reuses turn 3."""
    first = runner.check(torch.cat([text(4, 1), IMAGE, text(6, 2)], dim=1), [picture(0)])
    runner.hit()
    second = runner.check(_turn(first, text(5, 3)), [picture(0)])
    assert runner.hit() == first.sequences.shape[1] - 1 and runner.encoded == 0
    third = runner.check(_turn(second, text(3, 4), IMAGE, text(4, 5)), [picture(0), picture(1)])
    assert runner.hit() == 0 and runner.encoded == 2
    runner.check(_turn(third, text(4, 6)), [picture(0), picture(1)])
    assert runner.hit() == third.sequences.shape[1] - 1 and runner.encoded == 0
    assert runner.store.stats().fallbacks == {"cross_attention_new_image": 1}


def test_same_images_other_text_between_encodes_only_the_suffix_image(runner: Runner) -> None:
    """With the same images, a prompt diverging between them restores the first image's keys/values
    and passes only the second image's pixels."""
    head = torch.cat([text(4, 1), IMAGE, text(5, 2)], dim=1)
    runner.check(torch.cat([head, text(3, 3), IMAGE, text(4, 4)], dim=1), [picture(0), picture(1)])
    runner.hit()
    runner.check(torch.cat([head, text(3, 7), IMAGE, text(4, 8)], dim=1), [picture(0), picture(1)])
    assert runner.hit() == head.shape[1] and runner.encoded == 1


def test_adjacent_images_are_separate_items(runner: Runner) -> None:
    """Two adjacent `<|image|>` tokens (one mask group) are two items; a repeat restores both."""
    ids = torch.cat([text(3, 1), IMAGE, IMAGE, text(6, 2)], dim=1)
    runner.check(ids, [picture(0), picture(1)])
    runner.hit()
    runner.check(ids, [picture(0), picture(1)])
    assert runner.hit() == ids.shape[1] - 1 and runner.encoded == 0
    runner.check(ids, [picture(1), picture(0)])  # the same pictures swapped are other media
    assert runner.hit() == 0 and runner.encoded == 2


def test_text_only_prompts_are_served(runner: Runner) -> None:
    """Without images the cross-attention layers are skipped and stay empty; text prompts reuse as usual."""
    ids = text(12, 9)
    runner.check(ids, [])
    runner.hit()
    runner.check(ids, [])
    assert runner.hit() == ids.shape[1] - 1 and runner.encoded == 0


def test_stored_bytes_count_each_image_once(runner: Runner) -> None:
    """An entry's bytes are its tokens' self-attention keys/values plus one vision block per image."""
    model = runner.model
    text_config = model.config.text_config
    head_dim = text_config.hidden_size // text_config.num_attention_heads
    per_vision_token = 2 * text_config.num_key_value_heads * head_dim * 4  # keys and values, float32
    per_token = (text_config.num_hidden_layers - 1) * per_vision_token
    per_image = MAX_TILES * model.model.vision_model.num_patches * per_vision_token
    ids = torch.cat([text(3, 1), IMAGE, text(4, 2), IMAGE, text(4, 3)], dim=1)
    runner.check(ids, [picture(0), picture(1)])
    stored = ids.shape[1] + NEW - 1
    assert runner.store.stats().nbytes == stored * per_token + 2 * per_image


@pytest.mark.parametrize(
    "change",
    ["missing", "extra_row", "fewer_tiles"],
)
def test_other_cross_attention_masks_run_cold(runner: Runner, change: str) -> None:
    """A mask that is not the processor's (absent, an extra attending row, fewer tiles) runs cold, named."""
    ids = torch.cat([text(5, 1), IMAGE, text(8, 2)], dim=1)
    runner.check(ids, [picture(0)])
    kwargs = media(ids, [picture(0)])
    mask = kwargs.pop("cross_attention_mask").clone()
    if change == "extra_row":
        mask[0, 2] = 1
    elif change == "fewer_tiles":
        mask[..., 1] = 0
    extra = {} if change == "missing" else {"cross_attention_mask": mask}
    out_kwargs = {**kwargs, **extra, "suppress_tokens": SUPPRESS}
    before = runner.store.stats().hit_tokens
    cold = generate(runner.model, ids, NEW, **out_kwargs)
    warm = generate(runner.model, ids, NEW, past_key_values=runner.store, **out_kwargs)
    assert torch.equal(cold.sequences, warm.sequences) and max_logit_diff(cold, warm) == 0.0
    assert runner.store.stats().hit_tokens == before
    assert runner.store.stats().fallbacks == {"cross_attention_mask": 1}


def test_precomputed_cross_attention_states_run_cold(runner: Runner) -> None:
    """`cross_attention_states` (vision states computed elsewhere) are not keyed: the call runs cold, named."""
    model = runner.model
    ids = torch.cat([text(5, 1), IMAGE, text(8, 2)], dim=1)
    kwargs = media(ids, [picture(0)])
    with torch.no_grad():
        vision = model.model.vision_model(
            kwargs["pixel_values"], kwargs["aspect_ratio_ids"], kwargs["aspect_ratio_mask"]
        ).last_hidden_state
        states = model.model.multi_modal_projector(vision).reshape(-1, vision.shape[-2], 64)
    call = {"cross_attention_states": states, "cross_attention_mask": kwargs["cross_attention_mask"]}
    # One token: generate itself passes these states again on decode steps, which fails cold too.
    cold = generate(model, ids, 1, **call)
    warm = generate(model, ids, 1, past_key_values=runner.store, **call)
    assert torch.equal(cold.sequences, warm.sequences)
    assert runner.store.stats().fallbacks == {"media_inputs:cross_attention_states": 1}


def test_lookup_refuses_image_placeholders(runner: Runner) -> None:
    """The token-only `lookup` cannot key images, so it refuses prompts holding `<|image|>`."""
    with pytest.raises(ValueError, match="media_placeholders"):
        runner.store.lookup(torch.cat([text(3, 1), IMAGE], dim=1))


def test_image_states_move_through_host_and_disk(tmp_path: Path) -> None:
    """Entries pushed to the host tier and to disk keep their images' keys/values: a fresh store on the
    folder serves the follow-up turn exactly, without the vision tower."""
    model = tiny_mllama()
    ids = torch.cat([text(5, 1), IMAGE, text(6, 2), IMAGE, text(3, 3)], dim=1)
    images = [picture(0), picture(1)]
    with served(model, max_bytes=1, max_host_bytes="1MB", disk_dir=tmp_path, save_on_exit=False, clean=False) as store:
        runner = Runner(store)
        first = runner.check(ids, images)
        assert store.stats().device_nbytes == 0 and store.stats().host_nbytes > 0
        runner.hit()
        runner.check(ids, images)  # served from a temporary device copy of the host entry
        assert runner.hit() == ids.shape[1] - 1 and runner.encoded == 0
        assert store.save() >= 1 and store.stats().disk_nbytes > 0
    with served(model, disk_dir=tmp_path, save_on_exit=False, clean=False) as store:
        runner = Runner(store)
        runner.check(_turn(first, text(4, 4)), images)
        assert runner.hit() == first.sequences.shape[1] - 1 and runner.encoded == 0
        assert store.stats().reloads >= 1 and not store.stats().fallbacks


# --------------------------------------------------------------------------- random conversations

_pieces = st.one_of(st.lists(st.integers(4, 7), min_size=1, max_size=4), st.integers(0, 2))
_requests = st.lists(st.tuples(st.lists(_pieces, min_size=1, max_size=4), st.booleans()), min_size=1, max_size=4)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conversation=_requests)
def test_random_conversations_reuse_exactly_what_the_rules_allow(conversation: list[Any]) -> None:
    """Random text-and-image chats equal cold runs, and reuse the longest prefix stored with the same images.

    The reference: a prompt's images (in order) pick its scope; it reuses the longest common
    prefix (an image token keyed by its picture) with a sequence stored in that scope, at most
    all but its last token. A prompt adding images to a stored conversation may only count
    `cross_attention_new_image`.
    """
    store = PrefixCache(tiny_mllama())
    runner = Runner(store)
    stored: list[tuple[tuple[int, ...], list[Any]]] = []
    previous: tuple[list[int], list[int], list[Any]] | None = None  # ids, images, symbols
    try:
        for new_pieces, continues in conversation:
            ids, images, symbols = ([], [], []) if not continues or previous is None else previous
            ids, images, symbols = list(ids), list(images), list(symbols)
            for piece in new_pieces:
                if isinstance(piece, int):
                    ids.append(IMAGE_ID)
                    images.append(piece)
                    symbols.append(("image", piece))
                else:
                    ids += piece
                    symbols += piece
            scope = tuple(images)
            expected = 0
            for other_scope, seq in stored:
                n = 0
                while other_scope == scope and n < min(len(seq), len(symbols)) and seq[n] == symbols[n]:
                    n += 1
                expected = max(expected, n)
            prompt = torch.tensor([ids])
            out = runner.check(prompt, [picture(i) for i in images])
            assert runner.hit() == min(expected, len(ids) - 1)
            answer = out.sequences[0, len(ids) :].tolist()
            stored.append((scope, symbols + answer[:-1]))
            previous = (ids + answer, images, symbols + answer)
        assert set(store.stats().fallbacks) <= {"cross_attention_new_image"}, store.stats().fallbacks
    finally:
        store.detach()
