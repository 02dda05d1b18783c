"""ModelProfile: what a model's cache looks like and how its prompt may be fed.

Read once when a store is attached. Decides whether the model can be served at all (and if
not, names the reason every request will fall back with) and which adapter handles each
cache layer (from the registry, `layers.adapter_for`). What the model's layers can do together
is worked out here once, from the capabilities each adapter class declares, into plain fields
a request reads. Knows nothing about the store, nor any concrete adapter class.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, get_layer_types_and_kwargs

from hf_prefix_cache import _compat, reasons
from hf_prefix_cache.errors import InconsistentStateError
from hf_prefix_cache.model.indexer_ties import indexer_modules
from hf_prefix_cache.model.layers import LayerAdapter, adapter_for
from hf_prefix_cache.model.loop_passes import with_loop_passes
from hf_prefix_cache.model.module_states import MODULE_STATE_MODEL_TYPES, has_module_states
from hf_prefix_cache.model.own_caches import OwnCache, own_cache_for
from hf_prefix_cache.multimodal import MediaAdapter, media_adapter_for

# Models whose scan ignores a cached state when fed several tokens (transformers 5.23: their
# full-sequence `mamba_selective_scan` gets no initial state; Jamba was 8.8e-5 off on a tiny
# model, growing with the state's weight). The hook continues their scan itself (`scan.py`);
# only if that cannot be installed are tokens fed one per forward once a state exists.
# RecurrentGemma's multi-token forward starts its convolution from zeros (`module_states.py`): it has no scan
# to continue, so a resumed prompt is fed one token per forward.
_SINGLE_TOKEN_STEP_MODEL_TYPES = frozenset({"mamba", "falcon_mamba", "jamba", "recurrent_gemma"})
# Causal-LM classes of BERT-style families whose attention is bidirectional unless `config.is_decoder`
# is True (transformers 5.23: their __init__ warns about it, or sets it on a copied config).
# Without it a later token changes every earlier position's states, so no prefix is reusable.
BIDIRECTIONAL_UNLESS_DECODER = frozenset(
    {
        "bart", "bert", "bert-generation", "big_bird", "bigbird_pegasus", "blenderbot", "blenderbot-small",
        "camembert", "data2vec-text", "electra", "ernie", "marian", "mbart", "megatron-bert", "mvp", "pegasus",
        "plbart", "prophetnet", "reformer", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
        "trocr", "xlm-roberta", "xlm-roberta-xl", "xmod",
    }
)  # fmt: skip
# Types whose rows with states are not joined (`ModelProfile.joins_rows`): batches, beams and samples run cold. Their
# states are kept by bridges to the model's own cache or modules (main's `own_caches.py`, `module_states.py`), and a
# left-padded batch through the row-by-row path was off its cold run (MiniMax 3.6e-3, RecurrentGemma and RWKV by
# more than 1): their layers do not leave a state as it was over masked padding.
_ROWS_NOT_JOINED = frozenset({"minimax", "recurrent_gemma", "rwkv"})
# Types whose indexed layers keep no indexer keys: their indexers rank the layer's own keys (Kolibri 1.1), so those
# layers are stored as full attention. Their indexers are not watched for ties (`indexer_ties.py`): a prompt runs
# cold past the indexers' budget (`_indexer_exact_len`). Their "reuse" layers read another layer's keys and never
# update their own cache layer: transformers makes those `DummyLayer`s (from `kv_sharing_modes`), which hold nothing.
_KEYS_INDEXED_MODEL_TYPES = frozenset({"kolibri1_1"})
# Types the support matrix (scripts/support_matrix.py) found failing or inexact through the store, run cold:
_COLD_MODEL_TYPES = {
    # full-causal masks over sliding-window cache layers: chunking changes output
    "moshi": reasons.WINDOW_MASK_MISMATCH,
    "cpmant": reasons.CACHE_LONGER_THAN_PROMPT,  # the cache holds its own prompt positions before the tokens
    "prophetnet": reasons.NGRAM_CACHE_LAYOUT,  # some layers hold no positions
    # XLM's forward drops the ids its cache holds and builds its masks from its own lengths (5.24 names
    # that parameter `cache`; a restored prefix raised a mask-size error; 5.23's took no Cache at all)
    "xlm": reasons.SLICES_ITS_OWN_INPUT,
    # Found WRONG by the support matrix once transformers 5.25's configs could be built tiny (#45), and run cold (keyed
    # by the decoder's config type, which the profile reads):
    "musicgen_decoder": reasons.OWN_GENERATE,  # a restore met 4 positions where 28 were fed (codebook delay pattern)
    "musicgen_melody_decoder": reasons.OWN_GENERATE,
    "diffusion_gemma_text": reasons.OWN_GENERATE,  # block diffusion: a cached first request gave another 4th token
    "dory": reasons.LOOPED_LAYERS,
    "glm5_next_text": reasons.INDEXER_LAYOUT,  # indexer keys of 33 channels for an index_head_dim of 16
}


@dataclass(frozen=True, slots=True)
class ModelProfile:
    """How one model is served; `unsupported` names why it never reuses, or is None.

    `item_layers` are the cross-attention layers (Mllama), which hold keys/values of media
    items rather than of tokens; the store keeps them per item (see `segments.Segment.items`).
    `encoder_family` names an encoder-decoder family served keyed by its encoder input
    (``"whisper"``, ``"seq2seq"``); None for decoder-only models. Its `adapters` are the
    decoder's self-attention layers.

    The fields after `own_cache` are not passed: they are worked out once from the adapters'
    declared capabilities (`layers/base.py`) when the profile is made, so a request reads them as plain values.
    """

    cache_kwarg: str  # the name the forward (and so `generate`) takes the cache under (`_compat.cache_argument`)
    adapters: tuple[LayerAdapter, ...]
    layer_specs: tuple[tuple[type, dict[str, Any]], ...]
    single_token_steps: bool
    accepts_position_ids: bool
    accepts_logits_to_keep: bool
    unsupported: str | None
    prompt_sliced: bool = True  # `generate` feeds only the ids past the cache (else the hook skips them)
    media: MediaAdapter | None = None
    item_layers: tuple[int, ...] = ()
    #: Whether rows with states may be prefilled alone and joined (False for `_ROWS_NOT_JOINED`; see `joins_rows`).
    joinable_states: bool = True
    encoder_family: str | None = None
    #: Prompts longer than this run cold (None: no limit): a sparse-attention indexer selects keys by score
    #: only past its top-k, and the selection among ties then depends on the call's shape (`reasons.INDEXER_TOP_K`);
    #: only for indexers the tie watch does not find.
    exact_prompt_len: int | None = None
    #: The model's indexers are checked for ties at their top-k boundary while they run on a working cache
    #: (`indexer_ties.TieWatch`): a hook installs the watch, and prompts of any length are served.
    watch_indexers: bool = False
    #: Whether assisted decoding on a restored prefix stays within tolerance of a cold run (`hooks/checks.py`).
    #: False for gated delta-rule mixers (Qwen3-Next, Qwen3.5, ...): assisted decoding computes its candidates'
    #: states one token at a time and a prefix's in chunks, and on the tiny Qwen3-Next a restored run lands 4.5e-4
    #: from the cold one (the cold assisted run is itself 2.9e-4 from the plain one).
    assists_exactly: bool = True
    #: How a model's own cache is met (`own_caches.py`): MiniMax's `MiniMaxCache`, RWKV's `state` list. The working
    #: cache gets its bridge (and is made an instance of the own class). None for other models.
    own_cache: OwnCache | None = None

    # Worked out from `adapters` (and `item_layers`, `media`, `joinable_states`) by `__post_init__`.
    #: Some layer keeps per-token keys.
    has_kv: bool = field(init=False)
    #: Some layer keeps a state.
    has_state: bool = field(init=False)
    #: A state summarising every token so far (not only a window): interval snapshots pay.
    has_recurrence: bool = field(init=False)
    kv_layers: tuple[int, ...] = field(init=False)
    state_layers: tuple[int, ...] = field(init=False)
    #: Whether one restored prompt may become several rows (beams, several returned sequences).
    #: Every layer keeps per-token keys of every position (no recurrent or window state, no media
    #: item blocks), so the rows can be copies of one prefix and trimmed back to the prompt after.
    expands: bool = field(init=False)
    #: Whether rows with recurrent states can each be prefilled alone and joined into one batch (batches, left
    #: padding, beams, several returned sequences; `hooks/recurrent_rows.py`).
    #: Every state is a recurrent or conv state whose first dimension is the batch (`has_state_refs`; window
    #: states and other snapshot-only layers are not joined), with no media and no media item
    #: blocks: each row's prompt is keyed and prefilled as a one-row call's, then the rows' keys and
    #: states are laid side by side. No layers with indexer keys
    #: (Qwen4-Exp): their indexers keep positions a padded row does not share, and their top-k ties
    #: are watched per call, not per row (a padded Qwen4-Exp batch was 5e-2 off its cold run).
    joins_rows: bool = field(init=False)
    #: Whether a static cache can take a restored prefix (`model/static.py`): every cache layer keeps plain
    #: per-token keys whose static form is one buffer (full attention, or a sliding window's last positions), with
    #: no state and no media item blocks.
    serves_static: bool = field(init=False)
    #: Whether transformers' `crop` (assisted decoding's rollback of rejected candidates) keeps every
    #: layer exact and capturable.
    is_croppable: bool = field(init=False)
    #: Whether keys still landing can be restored layer by layer at first use (`WorkingCache.restore(landing=...)`):
    #: every cached layer is plain full attention, read only through `update` (in layer order) and the `Cache`
    #: methods, all of which land first; no media item blocks.
    defers_keys: bool = field(init=False)
    #: Some layer keeps positions of its own (Qwen4-Exp's indexers), which a restore rebuilds as 0..L-1: not a
    #: left-padded row's.
    keeps_positions: bool = field(init=False)
    #: The layers a fresh working cache sets up (`LayerAdapter.prepare`).
    prepared_layers: tuple[int, ...] = field(init=False)
    #: The layer that answers how many positions the cache holds (`WorkingCache.get_seq_length`): the first with
    #: keys where layer 0 keeps only a state (since 5.25 such a layer answers its own token counter, which
    #: module-kept and bridged states never advance), else layer 0.
    length_layer: int = field(init=False)

    def __post_init__(self) -> None:
        adapters = self.adapters
        has_state = any(a.has_state for a in adapters)
        expands = not has_state and not self.item_layers
        has_kv = any(a.has_kv for a in adapters)
        cached = [a for a in adapters if a.has_kv or a.has_state]
        derived = {
            "has_kv": has_kv,
            "has_state": has_state,
            "has_recurrence": any(a.has_recurrence for a in adapters),
            "kv_layers": tuple(i for i, a in enumerate(adapters) if a.has_kv),
            "state_layers": tuple(i for i, a in enumerate(adapters) if a.has_state),
            "expands": expands,
            "joins_rows": (
                has_state
                and self.joinable_states
                and self.media is None
                and not self.item_layers
                and all(a.has_state_refs for a in adapters if a.has_state)
                and not any(a.has_indexer_keys for a in adapters)
            ),
            "serves_static": expands and has_kv and all(a.has_static_form for a in adapters if a.has_kv),
            "is_croppable": all(a.is_croppable for a in adapters),
            "defers_keys": bool(cached) and not self.item_layers and all(a.defers_keys for a in cached),
            "keeps_positions": any(a.keeps_positions for a in adapters),
            "prepared_layers": tuple(i for i, a in enumerate(adapters) if a.needs_prepare),
            "length_layer": (
                next(i for i, a in enumerate(adapters) if a.has_kv)
                if has_kv and adapters and adapters[0].has_state and not adapters[0].has_kv
                else 0
            ),
        }
        for name, value in derived.items():
            object.__setattr__(self, name, value)


def profile_model(
    model: Any, sliding_window_mode: str = "every_position", encoder_family: str | None = None
) -> ModelProfile:
    """Inspect `model` (a transformers generative model) once.

    `sliding_window_mode` picks how sliding-window layers are stored (see `layers/sliding.py`).
    `encoder_family` names the encoder-decoder family whose hook serves `model` (the
    hooks registry, `hooks.patching.family_of`, knows it); any other
    encoder-decoder model is not served.
    """
    # A PEFT wrapper's forward takes (*args, **kwargs) and hands them to the model it wraps.
    inner = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    params = set(inspect.signature(inner.forward).parameters)
    config = model.config
    model_type = getattr(config.get_text_config(decoder=True), "model_type", None) or config.model_type
    own = own_cache_for(model_type)
    # A model's own name for its cache (RWKV's `state`), where no name transformers' caches go by is taken.
    own_kwarg = own.cache_kwarg if own is not None else None
    declared = own_kwarg or _compat.cache_argument(params, type(inner).__name__)
    cache_kwarg = declared or _compat.CACHE_KWARGS[0 if _compat.CACHE_RENAMED else 1]
    media = media_adapter_for(model)
    unsupported = _unsupported_reason(model, config, model_type, media, encoder_family)
    if unsupported is None and declared is None:
        unsupported = reasons.NO_CACHE_ARGUMENT  # the model keeps no cache (generate rejects one)
    adapters: list[LayerAdapter] = []
    specs: list[tuple[type, dict[str, Any]]] = []
    layers: list[Any] = []  # one of each layer, as `specs` builds it
    if unsupported is None:
        # The layers `DynamicCache(config=...)` would build, as classes and kwargs, to build them fast per request.
        try:
            layer_types, per_layer_kwargs = get_layer_types_and_kwargs(config.get_text_config(decoder=True))
            if own is not None and own.layer_specs is not None:
                layer_types, per_layer_kwargs = own.layer_specs(config.get_text_config(decoder=True))
            layer_types, per_layer_kwargs = with_loop_passes(
                config.get_text_config(decoder=True), layer_types, per_layer_kwargs
            )
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            # A config transformers cannot read a cache layout from (BLT in 5.23): its own
            # `generate` fails the same way; construction must not.
            layer_types, per_layer_kwargs = [], []
            unsupported = reasons.with_detail(reasons.UNREADABLE_CACHE_LAYOUT, type(exc).__name__)
        # Indexed (sparse-attention) layers: their indexer keys' width (Qwen4-Exp: `indexer_head_dim`).
        index_dim = _index_dim(config.get_text_config(decoder=True))
        # Qwen4-Exp: the first indexed layer keeps the indexers' positions too.
        keep_positions = index_dim is not None and _keeps_indexer_positions(config)
        keys_indexed = model_type in _KEYS_INDEXED_MODEL_TYPES
        if encoder_family is not None and unsupported is None:
            layer_types, per_layer_kwargs = _decoder_layers(config, layer_types, per_layer_kwargs)
        for layer_type, kwargs in zip(layer_types, per_layer_kwargs, strict=True):
            cls = DYNAMIC_LAYER_TYPE_MAPPING.get(layer_type)
            layer = cls(**kwargs) if cls is not None else None
            adapter = (
                adapter_for(
                    layer,
                    sliding_window_mode,
                    index_dim,
                    keeps_indexer_positions=keep_positions,
                    indexes_keys=keys_indexed,
                )
                if layer is not None
                else None
            )
            if adapter is None:
                unsupported = reasons.with_detail(
                    reasons.UNSUPPORTED_LAYER, cls.__name__ if cls is not None else layer_type
                )
                adapters, specs, layers = [], [], []
                break
            assert cls is not None
            adapters.append(adapter)
            specs.append((cls, dict(kwargs)))
            layers.append(layer)
            keep_positions = keep_positions and not adapter.has_indexer_keys  # the first one only
        if unsupported is None and not adapters:
            unsupported = reasons.NO_CACHE_LAYERS
    item_layers = media.item_layers() if media is not None and unsupported is None else ()
    for i in item_layers:
        # Cross-attention layers are plain DynamicLayers holding vision tokens, never sliced by text length.
        item_adapter = adapter_for(layers[i], holds_items=True)
        if item_adapter is None:
            unsupported, adapters, specs, item_layers = (
                reasons.with_detail(reasons.CROSS_ATTENTION_LAYER, specs[i][0].__name__),
                [],
                [],
                (),
            )
            break
        adapters[i] = item_adapter
    keys_indexed = model_type in _KEYS_INDEXED_MODEL_TYPES
    indexed = keys_indexed or any(a.has_indexer_keys for a in adapters)
    # Layers whose entries an indexer ranks, each entry covering this many tokens (DeepSeek-V4's CSA layers).
    entry_tokens = max((a.entry_tokens or 0 for a in adapters), default=0)
    # Indexers whose every top-k can be checked for ties (`indexer_ties.py`) reuse prompts of any length.
    watch_indexers = indexed and not keys_indexed and bool(indexer_modules(inner))
    return ModelProfile(
        cache_kwarg=cache_kwarg,
        adapters=tuple(adapters),
        layer_specs=tuple(specs),
        single_token_steps=model_type in _SINGLE_TOKEN_STEP_MODEL_TYPES,
        accepts_position_ids="position_ids" in params,
        accepts_logits_to_keep="logits_to_keep" in params,
        unsupported=unsupported,
        prompt_sliced=_compat.generate_slices_prompt(cache_kwarg, [cls for cls, _ in specs]),
        media=media,
        item_layers=item_layers,
        joinable_states=model_type not in _ROWS_NOT_JOINED,
        encoder_family=encoder_family,
        exact_prompt_len=(
            _indexer_exact_len(config) if indexed and not watch_indexers else _ranked_entries_len(config, entry_tokens)
        ),
        watch_indexers=watch_indexers,
        assists_exactly=not any("DeltaNet" in type(module).__name__ for module in model.modules()),
        own_cache=own if unsupported is None else None,
    )


def _keeps_indexer_positions(config: Any) -> bool:
    """Qwen4-Exp (an `indexer_budget` of tokens): its first indexed layer keeps the indexers' positions too."""
    return isinstance(getattr(config.get_text_config(decoder=True), "indexer_budget", None), int)


def _index_dim(text_config: Any) -> int | None:
    for name in ("index_head_dim", "indexer_head_dim"):
        value = getattr(text_config, name, None)
        if isinstance(value, int):
            return value
    return None


def _indexer_exact_len(config: Any) -> int:
    """The longest prompt whose every query keeps all its keys through the indexer's top-k.

    Each query sees at most the prompt's length in keys (GLM-5-Next: in pools of `index_kpool` keys, of which
    it keeps `index_topk // index_kpool`); while that is within the top-k, the selection is every key whatever
    the scores, so a suffix's prefill attends exactly as the whole prompt's does. Kolibri 1.1's queries keep
    their sink and local tokens besides the top-k, and select nothing while they see no more keys than all three.
    """
    text = config.get_text_config(decoder=True)
    top_k = getattr(text, "index_topk", None)
    if not isinstance(top_k, int) or top_k <= 0:
        return 0  # a top-k we cannot read: no prompt is known to keep every key, so every one runs cold
    pool = getattr(text, "index_kpool", None)
    pool = pool if isinstance(pool, int) and pool > 0 else 1
    kept = [getattr(text, name, None) for name in ("index_num_local_tokens", "index_num_sink_tokens")]
    return (top_k // pool) * pool + sum(n for n in kept if isinstance(n, int) and n > 0)


def _ranked_entries_len(config: Any, entry_tokens: int) -> int | None:
    """The longest prompt whose every query keeps all its compressed entries through the indexer's top-k.

    DeepSeek-V4's CSA indexer ranks entries of `entry_tokens` tokens each; a query at position `t` sees
    `(t + 1) // entry_tokens` of them, all kept while that is within `index_topk`. None: no such layer.
    """
    if entry_tokens <= 0:
        return None
    top_k = getattr(config.get_text_config(decoder=True), "index_topk", None)
    return top_k * entry_tokens if isinstance(top_k, int) and top_k > 0 else 0


def _decoder_layers(config: Any, layer_types: list[str], per_layer_kwargs: list[dict[str, Any]]) -> Any:
    """The decoder's layer types: T5 and Florence-2's text config count the encoder's layers as `num_hidden_layers`."""
    # The model's own config (Florence-2: its text config), not get_text_config's renamed copy of it.
    text = getattr(config, "text_config", None) or config
    num_layers = next(
        (n for n in (getattr(text, a, None) for a in ("num_decoder_layers", "decoder_layers")) if isinstance(n, int)),
        len(layer_types),
    )
    if num_layers == len(layer_types):
        return layer_types, per_layer_kwargs
    # These decoders have one kind of layer throughout; repeat it.
    if len(set(layer_types)) != 1:
        raise InconsistentStateError(f"mixed layer types {set(layer_types)} with {num_layers} decoder layers")
    return [layer_types[0]] * num_layers, [dict(per_layer_kwargs[0]) for _ in range(num_layers)]


def _unsupported_reason(
    model: Any, config: Any, model_type: str | None, media: MediaAdapter | None, encoder_family: str | None
) -> str | None:
    if getattr(config, "is_encoder_decoder", False) and encoder_family is None:
        return reasons.ENCODER_DECODER
    if getattr(model, "thinker", None) is not None:
        # Thinker + talker (Qwen2.5-Omni): the wrapper's generate drives the thinker in its own way.
        return reasons.THINKER_TALKER
    decoder_only = not getattr(config, "is_encoder_decoder", False)
    if decoder_only and model_type in BIDIRECTIONAL_UNLESS_DECODER and not getattr(config, "is_decoder", False):
        return reasons.BIDIRECTIONAL_ATTENTION
    if model_type in MODULE_STATE_MODEL_TYPES and not has_module_states(model):
        return reasons.MODULE_STATE  # recurrence kept in module attributes the bridge does not know
    if model_type in _COLD_MODEL_TYPES:
        return _COLD_MODEL_TYPES[model_type]
    supports_dynamic = getattr(type(model), "_supports_default_dynamic_cache", None)
    if supports_dynamic is not None and not supports_dynamic() and own_cache_for(model_type) is None:
        return reasons.OWN_CACHE_CLASS
    # M-RoPE models keep rope_deltas on the instance; reuse needs explicit positions, which only some adapters give.
    inner = getattr(model, "model", None)
    has_rope_index = hasattr(model, "get_rope_index") or (inner is not None and hasattr(inner, "get_rope_index"))
    if has_rope_index and (media is None or not media.has_positions):
        return reasons.MROPE_POSITIONS
    return None
