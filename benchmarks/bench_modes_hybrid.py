"""Decoding modes on a hybrid model (recurrent states beside attention), cold against a hit, side by side in one run.

Model: a random-weight Qwen3-Next (gated-delta-net layers, then full attention, sparse MoE) of
``--layers`` layers, ``--hidden`` wide, float32 on the CPU; random token ids stand in for text
(timing and positions do not depend on the weights). Cases, as `bench_modes.py` times them
(`bench_modes.case`: each to the end of `generate`, sequences checked equal):

* ``few-shot batch``: 8 questions (8 to 36 tokens) after one shared prefix of ``--prefix`` tokens,
  left-padded into one batch, greedy. The store holds the prefix and one other question (one
  earlier one-row call); each row restores it and prefills its own question alone, then the rows
  are joined (`hooks/recurrent_rows.py`).
* ``self-consistency``: ``--samples`` samples of one ``--prompt``-token prompt, stored beforehand.
* ``beams``: ``--beams`` beams on the same prompt.

Run: ``PYTHONPATH=. python benchmarks/bench_modes_hybrid.py --threads 2``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import transformers
from _common import print_end, print_environment, start_run
from bench_modes import case


def build(layers: int, hidden: int) -> Any:
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=4096,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=hidden // 4,
        layer_types=[("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(layers)],
        linear_conv_kernel_dim=4,
        linear_key_head_dim=hidden // 8,
        linear_value_head_dim=hidden // 8,
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=hidden // 2,
        shared_expert_intermediate_size=hidden // 2,
        max_position_embeddings=8192,
        pad_token_id=0,
        eos_token_id=None,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    model.eval()
    model.generation_config.pad_token_id = 0
    model.generation_config.max_length = None
    return model


def left_padded(rows: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(r.shape[0] for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[0] :], mask[i, width - row.shape[0] :] = row, 1
    return {"input_ids": ids, "attention_mask": mask}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--prefix", type=int, default=1000, help="few-shot prefix tokens")
    parser.add_argument("--prompt", type=int, default=1500, help="self-consistency and beam prompt tokens")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--new", type=int, default=4, help="new tokens per row")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    started = start_run(args.threads)
    model = build(args.layers, args.hidden)
    print_environment(f", random-weight {type(model).__name__}, {args.layers} layers, hidden {args.hidden}")
    gen = torch.Generator().manual_seed(1)

    def tokens(n: int) -> torch.Tensor:
        return torch.randint(4, 4096, (n,), generator=gen)

    prefix = tokens(args.prefix)
    questions = [torch.cat([prefix, tokens(8 + 4 * i)]) for i in range(8)]
    warm = left_padded([torch.cat([prefix, tokens(12)])])
    greedy = {"max_new_tokens": args.new, "do_sample": False}
    case("few-shot batch", model, left_padded(questions), warm, greedy, args.repeats)

    prompt = left_padded([tokens(args.prompt)])
    sampling = {"max_new_tokens": args.new, "do_sample": True, "num_return_sequences": args.samples}
    case("self-consistency", model, prompt, prompt, sampling, args.repeats)
    case("beams", model, prompt, prompt, {**greedy, "num_beams": args.beams}, args.repeats)
    print_end(started, newline=True)


if __name__ == "__main__":
    main()
