"""VibeVoice ASR's audio clips (a generic-table row) are served exactly on its deterministic path.

Its audio encoder adds random noise to the acoustic latents unless a call passes
``sample=False``; such calls are served (a turn adding a clip and a changed clip are the family
suite's cases, its `vibevoice` row), and a call with clips that leaves `sample` at its default
runs cold (`media_random:sample`). Every request runs cold and through the store: equal tokens,
logits within 1e-4, all clips passed every time as the processor would.
"""

from __future__ import annotations

import torch
from conftest import Hits

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.multimodal import media_adapter_for
from hf_prefix_cache.multimodal.generic import GenericMedia
from hf_prefix_cache.testing.media.harness import NEW, SPECIAL_IDS, check
from hf_prefix_cache.testing.media.vibevoice import Clip, media_kwargs, placeholders, tiny_vibevoice_asr
from hf_prefix_cache.testing.tiny_vlm_media import text
from media.conftest import store_fixture

store = store_fixture(tiny_vibevoice_asr, no_fallbacks=False)


def test_the_generic_adapter_serves_it() -> None:
    assert isinstance(media_adapter_for(tiny_vibevoice_asr()), GenericMedia)


def test_a_clip_encodes_alike_alone_and_padded_beside_a_longer_one() -> None:
    """The tokenizers encode each row on its own; a shorter clip's valid features ignore its padding."""
    model, short, long = tiny_vibevoice_asr(), Clip(2), Clip(1)
    with torch.no_grad():
        together = model.model.get_audio_features(**media_kwargs([long, short])).pooler_output
        alone = [model.model.get_audio_features(**media_kwargs([c])).pooler_output for c in (long, short)]
    torch.testing.assert_close(torch.cat(alone), together, rtol=0, atol=1e-5)


def test_the_default_noisy_encoding_runs_cold(store: PrefixCache) -> None:
    """Clips without ``sample=False`` run cold, counted; the same noise (one seed) gives the cold run's output."""
    model, clip = tiny_vibevoice_asr(), Clip(1)
    ids = torch.cat([text(5, 1), placeholders(clip), text(6, 2)], dim=1)
    check(model, ids, store, media_kwargs([clip]))  # the deterministic path, stored
    hits = Hits(store)
    kwargs = {**media_kwargs([clip], sample=None), "suppress_tokens": SPECIAL_IDS}
    torch.manual_seed(5)
    cold = model.generate(ids, max_new_tokens=NEW, do_sample=False, **kwargs)
    torch.manual_seed(5)
    warm = model.generate(ids, max_new_tokens=NEW, do_sample=False, past_key_values=store, **kwargs)
    assert torch.equal(cold, warm)
    assert hits.last() == 0
    assert store.stats().fallbacks == {"media_random:sample": 1}
