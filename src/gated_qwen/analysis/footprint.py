"""Memory checks made before anything large is allocated: every size flag of `analyze`, `eval-ppl` and
`reproduce` is refused (a `ValueError` naming the flag, the memory it needs and the most that fits) when what it
asks for would not fit in what the machine (or this cgroup, or the GPU) has available."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from types import SimpleNamespace

import torch

from ..files.memory import available_memory


def check_model_fits(causal_lm: type, config, dtype, device: str, what: str) -> None:
    """Refuses a config whose model would not fit in `device`'s memory in `dtype` (its parameters counted on the meta
    device, from the config's own sizes, before anything is allocated), naming its largest tensor: `vocab_size` 2e8
    over tiny weights is 25 GB of embeddings that `from_pretrained` would allocate before it found the shapes
    wrong. `what` names the config.json."""
    with torch.device("meta"):
        model = causal_lm(config)
    parameters = dict(model.named_parameters())  # tied weights once
    needed = sum(p.numel() for p in parameters.values()) * dtype.itemsize
    available = available_memory(device)
    if available is None or needed <= available[0]:
        return
    name, largest = max(parameters.items(), key=lambda item: item[1].numel())
    raise ValueError(f"{what} describes a model whose weights need about {needed / 2**30:.1f} GiB in "
                     f"{str(dtype).removeprefix('torch.')} (its largest tensor: {name} {list(largest.shape)}), more "
                     f"than the {available[0] / 2**30:.1f} GiB available ({available[1]}); check the config's sizes "
                     "against the weights, or load it in a smaller --dtype.")


def forward_bytes(config, batch: int, length: int, dtype_bytes: int, *, logits: bool = False,
                  gate_logits: bool = False, map_tokens: int = 0) -> int:
    """About how much memory one forward of `batch` sequences of `length` tokens allocates besides the weights:
    the activations of a layer (linear in the tokens: with causal masks the fused SDPA kernels need no score
    matrix), the mask of a sliding window ([batch, length, length], which Transformers builds whole, and its float
    copy), every layer's gate logits (`gate_logits`, kept for `analyze`), the full attention maps of the first
    `map_tokens` tokens, and the logits over the vocabulary (`logits`, with their float32 copy and log-softmax)."""
    tokens = batch * length
    heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    width = 4 * config.hidden_size + 3 * getattr(config, "intermediate_size", 0) + (2 * heads + 2 * kv_heads) * head_dim
    total = tokens * width * dtype_bytes + tokens * kv_heads * head_dim * 4  # + the one-hot value of F-Attn
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        total += 5 * batch * length * length
    if gate_logits:
        total += tokens * config.num_hidden_layers * heads * head_dim * 4
    if map_tokens:
        total += 16 * batch * heads * min(map_tokens, length) ** 2
    if logits:
        total += tokens * config.vocab_size * (dtype_bytes + 8)
    return total


def check_fits(needed: Callable[[int], int], value: int, flag: str, what: str, device: str, least: int = 2) -> None:
    """Refuses `flag value` (a `ValueError` naming the most that fits, from `least` up) when `needed(value)` bytes,
    for `what`, are more than `device` has available; `needed` grows with the value."""
    available = available_memory(device)
    if available is None or needed(value) <= available[0]:
        return
    fits, above = least - 1, value
    while above - fits > 1:  # the largest value that fits, by bisection
        middle = (fits + above) // 2
        fits, above = (middle, above) if needed(middle) <= available[0] else (fits, middle)
    limit = f"the most that fits is about {flag} {fits}" if fits >= least else f"not even {flag} {least} fits"
    raise ValueError(f"{flag} {value} needs about {needed(value) / 2**30:.1f} GiB of memory for {what}, more than the "
                     f"{available[0] / 2**30:.1f} GiB available ({available[1]} on this machine); {limit}.")


def check_windows_fit(args, length: int) -> None:
    """Refuses `--sequences` whose held-out windows of `length` tokens, sampled from the built-in corpus, would not
    fit in the machine's memory: int64 tokens, with room for the corpus's working copies (4 x the windows). Windows
    of a `--text` or `--tokens` file are no more than the file holds."""
    if not (args.text or args.tokens):
        check_fits(lambda count: 32 * count * length, args.sequences, "--sequences",
                   f"the held-out windows of {length} tokens (built whole, on the CPU)", "cpu", least=1)


def training_bytes(preset) -> int:
    """About the peak memory of one `reproduce` run of `preset` (a `miniature.presets.Preset`), from its sizes alone (no
    config is built: `--layers 10**9` would make a list of 10**9 layer types): the float32 weights, their gradients
    and Adam's two moments (16 bytes a parameter; the gate counted as the largest, elementwise, one), the training
    and held-out documents, and the largest forward the run makes: a training step (kept for the backward, about 3
    forwards), the analysis of `analysis_documents`, or the longest extrapolation length."""
    hidden, heads, kv_heads, head_dim = (preset.hidden_size, preset.num_attention_heads, preset.num_key_value_heads,
                                         preset.head_dim)
    shape = SimpleNamespace(vocab_size=preset.language.vocab_size, hidden_size=hidden, head_dim=head_dim,
                            intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_hidden_layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads)
    per_layer = hidden * (3 * heads + 2 * kv_heads) * head_dim + 3 * hidden * preset.intermediate_size + 4 * hidden
    parameters = preset.num_hidden_layers * per_layer + 2 * preset.language.vocab_size * hidden
    longest = preset.seq_len * max(preset.extrapolation)
    stages = (*preset.short_stages, (preset.seq_len, preset.steps))  # each stage's documents are drawn when it starts
    documents = 8 * (max(steps * length for length, steps in stages) * preset.batch_size
                     + max(preset.eval_documents, preset.extrapolation_documents) * longest)
    forward = max(3 * forward_bytes(shape, preset.batch_size, preset.seq_len, 4, logits=True),
                  forward_bytes(shape, preset.analysis_documents, preset.seq_len, 4, gate_logits=True, map_tokens=32),
                  forward_bytes(shape, preset.extrapolation_documents, longest, 4, logits=True))
    return 16 * parameters + documents + forward


def _training_sizes(preset) -> list[tuple[str, str, int, Callable[[int], dict], int]]:
    """(flag, its `args` name, its value, the preset's fields at another value, its least value) of each `reproduce`
    flag that sizes a run."""
    def width(n: int) -> dict:  # heads keep their number, head and MLP widths their ratio to the model's
        return dict(hidden_size=n, head_dim=max(1, n * preset.head_dim // preset.hidden_size),
                    intermediate_size=n * preset.intermediate_size // preset.hidden_size)

    return [("--hidden-size", "hidden_size", preset.hidden_size, width, preset.num_attention_heads),
            ("--layers", "layers", preset.num_hidden_layers, lambda n: dict(num_hidden_layers=n), 1),
            ("--seq-len", "seq_len", preset.seq_len, lambda n: dict(seq_len=n), 2),
            ("--batch-size", "batch_size", preset.batch_size, lambda n: dict(batch_size=n), 1),
            ("--steps", "steps", preset.steps, lambda n: dict(steps=n), 1)]


def check_training_fits(preset, runs_at_once: int, args, device: str) -> None:
    """Refuses a `reproduce` whose runs at once (`training_bytes` each) would not fit in `device`'s memory, naming
    the first flag that alone could make it fit (a flag given on the command line first) and the most that fits."""
    available = available_memory(device)
    if available is None or runs_at_once * training_bytes(preset) <= available[0]:
        return
    sizes = sorted(_training_sizes(preset), key=lambda size: getattr(args, size[1], None) is None)
    needed = {flag: lambda n, fields=fields: runs_at_once * training_bytes(dataclasses.replace(preset, **fields(n)))
              for flag, _, _, fields, _ in sizes}
    enough = [size for size in sizes if needed[size[0]](size[4]) <= available[0]]
    flag, _, value, _, least = (enough or sizes)[0]
    check_fits(needed[flag], value, flag, f"{runs_at_once} run(s) at once with the other sizes as given (weights, "
               "gradients and optimizer state, documents, activations)", device, least)

