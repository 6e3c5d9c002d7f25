"""`gated-qwen reproduce` (placeholder until the analysis job lands): train a tiny gated model on built-in text
and sample from it."""

from __future__ import annotations

import torch


def run(steps: int = 200, seed: int = 0) -> tuple[float, float, str]:
    from . import GatedQwenConfig, GatedQwenForCausalLM

    torch.manual_seed(seed)
    text = ("the gate sits after attention and before the output projection. " * 40).encode()
    data = torch.tensor(list(text), dtype=torch.long)
    config = GatedQwenConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    model = GatedQwenForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,))
        batch = torch.stack([data[s : s + 64] for s in starts])
        loss = model(batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    sample = model.generate(data[None, :16], max_new_tokens=48, do_sample=False)
    return losses[0], losses[-1], bytes(sample[0].tolist()).decode(errors="replace")


def register(subparsers) -> None:
    parser = subparsers.add_parser("reproduce", help="Train a tiny gated model on built-in data and sample from it.")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=lambda args: print("loss %.3f -> %.3f\nsample: %r" % run(args.steps, args.seed)))
