"""Qwen3-VL video prompts as this release's processor writes them are keyed right and served exactly.

transformers 5.25 changed the prompt: `Qwen3VLProcessor.get_text_with_replacements` collapses the
chat template's outer ``<|vision_start|><|video_pad|><|vision_end|>`` into the frames' own wrappers
(each frame: timestamp, vision start, placeholders, vision end), so a video prompt has two ids fewer
than on 5.23 and 5.24. Whatever the release writes, the video's item must span exactly its
placeholders (first frame's first to last frame's last), a second turn with the same video must
reuse the first and equal a cold run, and another video under the same ids must reuse nothing
past the video's start (Qwen3.5, whose recurrent layers restore only at a snapshot: nothing).
Qwen-VL and Qwen3.5 (same processor, same adapter's video items) run on every release the suite
runs on (`scripts/test`: 5.25 and 5.23).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import transformers
from conftest import Hits, assert_same_as_cold
from packaging.version import Version
from transformers.video_utils import VideoMetadata

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.model.profile import profile_model
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.testing.compare import served
from hf_prefix_cache.testing.media.qwen3 import cached_qwen3
from hf_prefix_cache.testing.tiny_processors import qwen3_vl_text_processor
from hf_prefix_cache.testing.tiny_qwen_media import Media
from hf_prefix_cache.testing.tiny_vlm_parts import VIDEO_ID, VISION_END_ID, VISION_START_ID
from hf_prefix_cache.testing.tiny_vlms import cached_vlm

GRID = (2, 4, 4)  # two frames (four sampled, two per temporal patch) of 4 placeholders each
NEW = 4
SUPPRESS = list(range(100, 128))  # answers hold no media or framing ids
COLLAPSES = Version(transformers.__version__) >= Version("5.25")
#: Qwen3-VL, and Qwen3.5 (the same processor; hybrid text layers, whose media prompts the hook prefills itself).
MODELS = ["qwen3_vl", "qwen3_5"]


def _model(name: str) -> Any:
    return cached_vlm(name) if name == "qwen3_vl" else cached_qwen3(name)


def _prompt(before: str, after: str) -> torch.Tensor:
    """The ids the release's processor writes for ``before <video> after`` (the chat template's video form)."""
    processor = qwen3_vl_text_processor()
    metadata = VideoMetadata(total_num_frames=4, fps=2.0, frames_indices=[0, 1, 2, 3])
    video = processor.replace_video_token({"video_grid_thw": torch.tensor([GRID]), "video_metadata": [metadata]}, 0)
    wrapper = processor.vision_start_token + processor.video_token + processor.vision_end_token
    (text,), _ = processor.get_text_with_replacements([f"{before}{wrapper}{after}"], [], [video])
    return torch.tensor([processor.tokenizer(text)["input_ids"]])


def _kwargs(ids: torch.Tensor, seed: int) -> dict[str, Any]:
    return {**Media(videos=[(seed, GRID, 0.5)]).kwargs(ids, qwen3=True), "suppress_tokens": SUPPRESS}


@pytest.fixture(params=MODELS)
def store(request: pytest.FixtureRequest) -> Iterator[PrefixCache]:
    with served(_model(request.param)) as store:
        yield store


def test_the_release_writes_one_wrapper_per_frame_or_one_more_around_them() -> None:
    ids = _prompt("the cat ", " what is in the image")[0]
    frames = GRID[0]
    assert int((ids == VIDEO_ID).sum()) == frames * GRID[1] * GRID[2] // 4
    # 5.25: only the frames' own wrappers; before, the template's outer pair around them as well
    assert int((ids == VISION_START_ID).sum()) == int((ids == VISION_END_ID).sum()) == frames + (not COLLAPSES)


@pytest.mark.parametrize("name", ["qwen3_vl", "qwen3_5"])
def test_the_video_item_spans_exactly_its_placeholders(name: str) -> None:
    ids = _prompt("the cat ", " what is in the image")
    adapter = media_adapter_for(_model(name))
    assert adapter is not None
    layout = adapter.layout(ids[0].tolist(), _kwargs(ids, 5))
    assert layout is not None
    (item,) = layout.items
    where = (ids[0] == VIDEO_ID).nonzero().flatten()
    assert (item.kind, item.start, item.end) == ("video", int(where[0]), int(where[-1]) + 1)
    # The first frame's timestamp and vision start (and on 5.23 the outer vision start) stay text before it.
    assert VISION_START_ID in ids[0, : item.start].tolist() and ids[0, item.end] == VISION_END_ID


def test_a_second_turn_with_the_same_video_reuses_the_first(store: PrefixCache) -> None:
    hits, model = Hits(store), store.model
    first = _prompt("the cat ", " what is in the image")
    out = assert_same_as_cold(model, first, store, new=NEW, **_kwargs(first, 5))
    assert hits.last() == 0
    turn = torch.cat([out.sequences, _prompt("", " tell me more")[:, -3:]], dim=1)  # the answer, then more text
    assert_same_as_cold(model, turn, store, new=NEW, **_kwargs(turn, 5))
    assert hits.last() == out.sequences.shape[1] - 1


def test_another_video_under_the_same_ids_reuses_nothing_past_its_start(store: PrefixCache) -> None:
    hits, model = Hits(store), store.model
    ids = _prompt("the cat ", " what is in the image")
    assert_same_as_cold(model, ids, store, new=NEW, **_kwargs(ids, 5))
    hits.last()
    assert_same_as_cold(model, ids, store, new=NEW, **_kwargs(ids, 6))
    # Up to the video's first placeholder; Qwen3.5's recurrent layers restore only at a snapshot, and the first
    # request took none before the video.
    start = int((ids[0] == VIDEO_ID).nonzero()[0])
    assert hits.last() == (0 if profile_model(model).has_recurrence else start)
    assert_same_as_cold(model, ids, store, new=NEW, **_kwargs(ids, 5))  # the first video again: all but the last
    assert hits.last() == ids.shape[1] - 1
