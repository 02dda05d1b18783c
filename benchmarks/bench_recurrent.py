"""Recurrent and sliding-window models at real shapes: store/cold time, disk persistence, bytes per token.

Models (random weights at real configs, float32, CPU, eager attention, greedy, no early stop):

* ``mamba``: Mamba-130m (hidden 768, 24 layers, state 16, expand 2, vocab 50280);
* ``mamba2``: Mamba2-130m (hidden 768, 24 layers, 24 heads of 64, state 128, 1 group, vocab 50288);
* ``jamba``: Jamba at hidden 1024 (8 layers: attention at layer 4, 4 experts top-2 on odd layers,
  intermediate 2048, state 16, expand 2, 8 heads / 2 KV heads, vocab 65536);
* ``bamba``: Bamba at hidden 1024 (8 layers: attention at layer 4, 32 heads of 64, state 128,
  intermediate 2816, vocab 65536);
* ``gemma3``: Gemma-3-1B text attention shapes (26 layers, 5 sliding of window 512 per global
  one, 4 heads / 1 KV head of 256, hidden 1152); only the MLP (intermediate 512) and vocabulary
  (4096) are cut, which changes no cache byte.

Parts (``--parts``, default all):

* ``sweep``: stored ``--prompt-len`` prompts (one per repetition), then prompts diverging from
  them at several points and continuations of them by several lengths, each run cold (no
  store) and through the store in alternating order, ``max_new_tokens=1``, the fastest of
  ``--reps`` runs; prints store/cold (target: <= 1.03 everywhere, < 1 where reuse is
  possible) and the largest logit difference from the cold run.
* ``disk``: each recurrent model under a device budget of ``--device-budget`` with a disk
  tier: snapshots stored, hit tokens of a repeat in the same store and in a new store (after
  `save()`, as at a process exit) reading the same folder.
* ``bytes``: stored bytes per token against the model's own cache for the same tokens.

Timings on a shared machine are noisy: ratios are measured side by side in one run, and the
load average is printed. Run: ``PYTHONPATH=. python benchmarks/bench_recurrent.py``
(``--quick`` for a smoke run).
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch
from _common import CACHE, print_end, print_environment, start_run, timed
from transformers import (
    BambaConfig,
    BambaForCausalLM,
    DynamicCache,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    JambaConfig,
    JambaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

from hf_prefix_cache import PrefixCache


def build(name: str, quick: bool) -> Any:
    """A random-weight model at the real shape named `name` (fewer layers with `quick`)."""
    torch.manual_seed(0)
    common: dict[str, Any] = {"eos_token_id": None, "pad_token_id": None, "tie_word_embeddings": False}
    if name == "mamba":
        config: Any = MambaConfig(
            vocab_size=50280, hidden_size=768, num_hidden_layers=4 if quick else 24, state_size=16, **common
        )
        model: Any = MambaForCausalLM(config)
    elif name == "mamba2":
        config = Mamba2Config(
            vocab_size=50288,
            hidden_size=768,
            num_hidden_layers=4 if quick else 24,
            num_heads=24,
            head_dim=64,
            state_size=128,
            n_groups=1,
            expand=2,
            chunk_size=256,
            **common,
        )
        model = Mamba2ForCausalLM(config)
    elif name == "jamba":
        config = JambaConfig(
            vocab_size=65536,
            hidden_size=1024,
            intermediate_size=2048,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            attn_layer_period=8,
            attn_layer_offset=4,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=4,
            num_experts_per_tok=2,
            mamba_d_state=16,
            mamba_expand=2,
            mamba_dt_rank=64,
            use_mamba_kernels=False,
            **common,
        )
        model = JambaForCausalLM(config)
    elif name == "bamba":
        config = BambaConfig(
            vocab_size=65536,
            hidden_size=1024,
            intermediate_size=2816,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=2,
            attn_layer_indices=[4],
            mamba_n_heads=32,
            mamba_d_head=64,
            mamba_d_state=128,
            mamba_n_groups=1,
            mamba_expand=2,
            mamba_chunk_size=256,
            **common,
        )
        model = BambaForCausalLM(config)
    elif name == "gemma3":
        config = Gemma3TextConfig(
            vocab_size=4096,
            hidden_size=1152,
            intermediate_size=512,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            sliding_window=512,
            max_position_embeddings=40000,
            **common,
        )
        model = Gemma3ForCausalLM(config)
    else:
        raise ValueError(name)
    model.config._attn_implementation = "eager"
    model = model.to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = None
    return model


def prompt(n: int, seed: int, first: int | None = None) -> torch.Tensor:
    ids = torch.randint(4, 4000, (1, n), generator=torch.Generator().manual_seed(seed))
    if first is not None:
        ids[0, 0] = first
    return ids


def run(model: Any, ids: torch.Tensor, store: PrefixCache | None) -> Any:
    kwargs: dict[str, Any] = {CACHE: store} if store is not None else {}
    return model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=1,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )


def sweep(name: str, args: argparse.Namespace) -> None:
    model = build(name, args.quick)
    n = args.prompt_len
    store = PrefixCache(model, snapshot_interval=args.interval)
    run(model, prompt(64, seed=3), None)  # warm-up, untimed
    # One stored prompt per repetition, so every repetition of a case reuses the same amount.
    stored = [prompt(n, seed=1 + rep, first=4 + rep) for rep in range(args.reps)]
    for ids in stored:
        run(model, ids, store)

    def fresh(k: int, rep: int, seed: int) -> torch.Tensor:
        """`k` new tokens starting with a token no other prompt starts its new part with."""
        return prompt(k, seed=seed + 1000 * rep, first=3990 - rep - 10 * (seed % 300))

    cases: list[tuple[str, Any]] = [("first request (miss)", lambda rep: fresh(n, rep, 0))]
    for frac in (0.25, 0.5, 0.75, 0.98):
        d = int(n * frac)
        cases.append((f"diverges at {d}", lambda rep, d=d: torch.cat([stored[rep][:, :d], fresh(n - d, rep, d)], 1)))
    cases.append(("repeat", lambda rep: stored[rep]))
    for k in args.continuations:
        cases.append((f"stored + {k} new", lambda rep, k=k: torch.cat([stored[rep], fresh(k, rep, 7 + k)], 1)))
    print(f"\n{name}: stored prompt {n} tokens, snapshot_interval {args.interval}; fastest of {args.reps} runs")
    print(f"{'case':<24} {'reused':>7} {'cold s':>8} {'store s':>8} {'store/cold':>10} {'max |dlogit|':>12}")
    for label, make in cases:
        seconds: dict[str, list[float]] = {"cold": [], "store": []}
        diff, reused, same = 0.0, set(), True
        for rep in range(args.reps):
            ids = make(rep)
            before = store.stats().hit_tokens
            out: dict[str, Any] = {}
            for which in ("cold", "store") if rep % 2 == 0 else ("store", "cold"):  # noise hits both alike
                took, out[which] = timed(run, model, ids, store if which == "store" else None)
                seconds[which].append(took)
            reused.add(store.stats().hit_tokens - before)
            pairs = zip(out["cold"].logits, out["store"].logits, strict=True)
            diff = max(diff, *((a - b).abs().max().item() for a, b in pairs))
            same = same and torch.equal(out["cold"].sequences, out["store"].sequences)
        cold_s, warm_s = min(seconds["cold"]), min(seconds["store"])
        print(
            f"{label:<24} {'/'.join(map(str, sorted(reused))):>7} {cold_s:>8.2f} {warm_s:>8.2f} "
            f"{warm_s / cold_s:>10.3f} {diff:>12.1e}" + ("" if same else "  TOKENS DIFFER")
        )


def disk(name: str, args: argparse.Namespace) -> None:
    model = build(name, args.quick)
    n = args.prompt_len
    ids = prompt(n, seed=7)
    with tempfile.TemporaryDirectory() as folder:
        kwargs: dict[str, Any] = {"disk_dir": folder, "snapshot_interval": args.interval, "save_on_exit": False}
        store = PrefixCache(model, max_bytes=args.device_budget, **kwargs)
        run(model, ids, store)
        stats = store.stats()
        on_disk = stats.snapshots
        run(model, ids, store)
        same = store.stats().hit_tokens
        store.save()  # what a process does at exit (save_on_exit)
        store.detach()
        fresh = PrefixCache(model, max_bytes=args.device_budget, **kwargs)
        run(model, ids, fresh)
        new = fresh.stats().hit_tokens
        fresh.detach()
    print(
        f"{name:<8} {n:>6} {stats.device_nbytes / 1e6:>9.1f} {stats.disk_nbytes / 1e6:>9.1f} {on_disk:>9} "
        f"{same:>9} {new:>9}"
    )


def own_cache_nbytes(model: Any, ids: torch.Tensor) -> int:
    """Bytes of the cache transformers itself keeps after a forward over `ids` (windows for sliding layers)."""
    with torch.no_grad():
        own = DynamicCache(config=model.config)
        kw = "cache_params" if "Mamba" in type(model).__name__ else "past_key_values"
        model(ids, **{kw: own}, use_cache=True, logits_to_keep=1)
    total = 0
    for layer in own.layers:
        for attr in ("keys", "values", "conv_states", "recurrent_states"):
            value = getattr(layer, attr, None)
            tensors = value.values() if isinstance(value, dict) else [value]
            total += sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))
    return total


def nbytes(name: str, args: argparse.Namespace) -> None:
    model = build(name, args.quick)
    modes = ["every_position", "window"] if name == "gemma3" else ["every_position"]
    for n in args.bytes_lens:
        ids = prompt(n, seed=11)
        own = own_cache_nbytes(model, torch.cat([ids, ids[:, :1]], 1))  # the stored length: prompt + first answer
        for mode in modes:
            store = PrefixCache(model, snapshot_interval=args.interval, max_bytes="16GB", sliding_window_mode=mode)
            run(model, ids, store)
            stored = store.stats().nbytes
            store.detach()
            label = f"{name} ({mode})" if len(modes) > 1 else name
            print(
                f"{label:<24} {n:>6} {stored / 1e6:>10.1f} {own / 1e6:>10.1f} {stored / own:>7.2f} "
                f"{stored / n / 1e3:>10.1f}"
            )
    if name == "gemma3":
        # Longer prompts, computed from the shapes (the formula tests/model/test_sliding_window.py checks exactly).
        c = model.config
        per_position = 2 * c.num_key_value_heads * c.head_dim * 4
        num_sliding = sum(t == "sliding_attention" for t in c.layer_types)
        num_full, window = c.num_hidden_layers - num_sliding, c.sliding_window - 1
        for n in (8192, 32768):
            stored_len = n  # prompt + first answer token - 1
            own = (num_full * stored_len + num_sliding * window) * per_position
            every = c.num_hidden_layers * stored_len * per_position
            # Windows at n - 1 and n (max_new_tokens=1) touch: one window reaching one position back.
            windowed = (num_full * stored_len + num_sliding * (window + 1)) * per_position
            for mode, stored in (("every_position", every), ("window", windowed)):
                label = f"gemma3 ({mode})"
                print(
                    f"{label:<24} {n:>6} {stored / 1e6:>10.1f} {own / 1e6:>10.1f} {stored / own:>7.2f} "
                    f"{stored / n / 1e3:>10.1f}  (computed)"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", nargs="+", default=["sweep", "disk", "bytes"])
    parser.add_argument("--sweep-models", nargs="+", default=["mamba", "jamba"])
    parser.add_argument("--disk-models", nargs="+", default=["mamba", "mamba2", "bamba", "jamba"])
    parser.add_argument("--bytes-models", nargs="+", default=["mamba2", "gemma3"])
    parser.add_argument("--prompt-len", type=int, default=1024)
    parser.add_argument("--continuations", type=int, nargs="+", default=[16, 128, 512])
    parser.add_argument("--bytes-lens", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--interval", type=int, default=256)
    parser.add_argument("--device-budget", default="4MB")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--quick", action="store_true", help="4-layer Mamba models and 128-token prompts")
    args = parser.parse_args()
    if args.quick:
        args.prompt_len, args.continuations, args.bytes_lens, args.interval = 128, [16], [128], 32
    started = start_run(args.threads)
    print_environment()
    if "sweep" in args.parts:
        for name in args.sweep_models:
            sweep(name, args)
    if "disk" in args.parts:
        print(f"\ndisk persistence (device budget {args.device_budget}, snapshot_interval {args.interval})")
        print(
            f"{'model':<8} {'prompt':>6} {'dev MB':>9} {'disk MB':>9} {'snapshots':>9} {'same hit':>9} {'new hit':>9}"
        )
        for name in args.disk_models:
            disk(name, args)
    if "bytes" in args.parts:
        print(f"\nstored bytes against the model's own cache (snapshot_interval {args.interval})")
        print(f"{'model':<24} {'tokens':>6} {'stored MB':>10} {'own MB':>10} {'ratio':>7} {'kB / tok':>10}")
        for name in args.bytes_models:
            nbytes(name, args)
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
