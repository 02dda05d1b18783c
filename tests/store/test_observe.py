"""Observability: hits per modality, the prefill estimate, request callbacks, Prometheus metrics and HTML."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from conftest import Hits, assert_same_as_cold, cached_model, distinct_prompt, generate

from hf_prefix_cache import PrefixCache
from hf_prefix_cache.store.observe import RequestEvent
from hf_prefix_cache.testing.media.families import Family
from hf_prefix_cache.testing.tiny_vlm_media import text


def _hand_flops(model: Any, r: int) -> int:
    """Prefill FLOPs of r tokens from first principles: 2 per non-embedding parameter per token, 4 per attention pair."""
    c = model.config
    embeddings = {id(model.get_input_embeddings().weight), id(model.get_output_embeddings().weight)}
    params = sum(p.numel() for p in model.model.parameters() if id(p) not in embeddings)
    width = c.num_hidden_layers * c.num_attention_heads * (c.hidden_size // c.num_attention_heads)
    return 2 * params * r + 4 * width * r * (r + 1) // 2


def test_text_hits_count_as_text_and_the_saved_prefill_matches_a_hand_count() -> None:
    """A repeated text prompt counts its hit tokens as text, and the saved FLOPs equal 2*P*r + 2*A*r*(r+1)."""
    model = cached_model("llama")
    store = PrefixCache(model)
    events: list[RequestEvent] = []
    store.on_request(events.append)
    try:
        ids = distinct_prompt(1, 40)
        assert_same_as_cold(model, ids, store)
        assert_same_as_cold(model, ids, store)
        stats = store.stats()
        assert stats.hit_tokens == 39
        assert stats.hit_tokens_by_modality == {"text": 39}
        assert stats.saved_prefill_flops == _hand_flops(model, 39) > 0
        assert [(e.prompt_len, e.hit_len, e.fallback) for e in events] == [(40, 0, None), (40, 39, None)]
        assert events[1].hit_tokens_by_modality == {"text": 39}
        assert events[1].saved_prefill_flops == stats.saved_prefill_flops
    finally:
        store.detach()


def test_the_stats_are_the_sums_of_what_each_request_reported() -> None:
    """Over hits of several lengths and a batch, the stats' saved FLOPs and text hits are the sums of the events'."""
    model = cached_model("llama")
    store = PrefixCache(model)
    events: list[RequestEvent] = []
    store.on_request(events.append)
    try:
        a, b = distinct_prompt(11, 24), distinct_prompt(12, 40)
        longer = torch.cat([a, distinct_prompt(13, 9)], dim=1)
        for ids in (a, b, longer, b, torch.cat([longer, longer])):
            assert_same_as_cold(model, ids, store, new=2)
        stats = store.stats()
        hits = [e for e in events if e.hit_len]
        assert [(e.hit_len, e.num_rows) for e in hits] == [(24, 1), (39, 1), (32, 2)]
        assert stats.saved_prefill_flops == sum(e.saved_prefill_flops for e in events)
        assert stats.saved_prefill_flops == sum(_hand_flops(model, e.hit_len) * e.num_rows for e in hits)
        assert stats.hit_tokens_by_modality == {"text": sum(e.hit_len * e.num_rows for e in hits)} == {"text": 127}
        store.reset_stats()
        assert (store.stats().saved_prefill_flops, store.stats().hit_tokens_by_modality) == (0, {})
    finally:
        store.detach()


def test_image_hits_count_as_image_tokens() -> None:
    """A LLaVA turn reusing a stored image splits its hit into 16 image tokens and the rest as text."""
    fam = Family("llava")
    store = PrefixCache(fam.model)
    hits = Hits(store)
    try:
        img = fam.image(1)
        first = torch.cat([text(5, 1), fam.placeholders(img), text(6, 2)], dim=1)
        fam.check(first, [img], store)
        second = torch.cat([first, text(4, 3)], dim=1)
        fam.check(second, [img], store)
        hit = hits.last()
        assert hit >= first.shape[1]
        assert store.stats().hit_tokens_by_modality == {"image": 16, "text": hit - 16}
    finally:
        store.detach()


def test_fallbacks_reach_callbacks_with_their_reason_and_a_failing_callback_is_only_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A beam-search request reaches callbacks as a fallback; a raising callback is logged and generate still returns."""
    model = cached_model("llama")
    store = PrefixCache(model)
    events: list[RequestEvent] = []

    def broken(_event: RequestEvent) -> None:
        raise RuntimeError("exporter down")

    store.on_request(broken)
    store.on_request(events.append)
    try:
        ids = distinct_prompt(2, 20)
        with caplog.at_level(logging.ERROR, logger="hf_prefix_cache"):
            out = generate(model, ids, 3, past_key_values=store, output_hidden_states=True)
        assert out.sequences.shape[1] == 23
        assert [(e.fallback, e.hit_len, e.prompt_len) for e in events] == [("output_hidden_states", 0, 20)]
        assert "on_request callback failed" in caplog.text
    finally:
        store.detach()


def test_prometheus_metrics_report_the_stats() -> None:
    """The collector exposes hits per modality, fallbacks and bytes per tier as the stats say."""
    prometheus_client = pytest.importorskip("prometheus_client")
    from hf_prefix_cache.frontends.prometheus import register_metrics

    model = cached_model("llama")
    store = PrefixCache(model)
    registry = prometheus_client.CollectorRegistry()
    register_metrics(store, registry)
    try:
        ids = distinct_prompt(3, 30)
        generate(model, ids, 3, past_key_values=store)
        generate(model, ids, 3, past_key_values=store)
        generate(model, ids, 3, past_key_values=store, output_hidden_states=True)
        stats = store.stats()
        value = registry.get_sample_value
        assert value("hf_prefix_cache_requests_total") == 3
        assert value("hf_prefix_cache_hit_tokens_total", {"modality": "text"}) == 29
        assert value("hf_prefix_cache_fallbacks_total", {"reason": "output_hidden_states"}) == 1
        assert value("hf_prefix_cache_bytes", {"tier": "device"}) == stats.device_nbytes > 0
        assert value("hf_prefix_cache_saved_prefill_flops_total") == stats.saved_prefill_flops
        text_out = prometheus_client.generate_latest(registry).decode()
        assert 'hf_prefix_cache_hit_tokens_total{modality="text"} 29.0' in text_out
    finally:
        store.detach()


def test_html_shows_tiers_hit_rate_modalities_and_fallbacks() -> None:
    """The store's and the stats' HTML name every tier, the hit rate, the modalities and each fallback reason."""
    model = cached_model("llama")
    store = PrefixCache(model)
    try:
        ids = distinct_prompt(4, 30)
        generate(model, ids, 3, past_key_values=store)
        generate(model, ids, 3, past_key_values=store)
        generate(model, ids, 3, past_key_values=store, output_hidden_states=True)
        page = store._repr_html_()
        for needle in (
            "LlamaForCausalLM",
            "device",
            "host",
            "disk",
            "29 of 90",
            "text",
            "output_hidden_states",
            "<table",
        ):
            assert needle in page, needle
        assert store.stats()._repr_html_() in page
    finally:
        store.detach()
