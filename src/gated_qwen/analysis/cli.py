"""`gated-qwen analyze`, `gated-qwen eval-ppl` and `gated-qwen reproduce`.

Defining the parser imports no model code; each command imports it when it runs. Outputs go through
`gated_qwen.outputs`: `--out` may not be, contain or lie inside MODEL or an input file, appears whole or not at all,
and replaces an existing one only with `--overwrite`. Bad input raises `ValueError` with the reason, which the
`gated-qwen` command prints as one line (exit status 2).
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from ..outputs import check_output, output_file, output_folder, write_json
from ..reading import CONFIG_VALUE_ERRORS, check_safetensors_files, config_from_dict, read_json_object

if TYPE_CHECKING:
    import torch


# ------------------------------------------------------------------------------------------------ input data
class Inputs:
    """Held-out token windows for a model: from a text file (the model folder's tokenizer), a safetensors file of
    `input_ids` `[N, S]`, or, by default, the built-in synthetic corpus (for models trained on it by
    `reproduce`). Every window starts the way training sequences did: with BOS where there is one."""

    def __init__(self, model_path: str, vocab_size: int, text: str | None, tokens: str | None):
        import torch

        from .data import CORPORA

        self.vocab_size = vocab_size
        self.stream = self.rows = None
        for option, path in (("--text", text), ("--tokens", tokens)):
            if path and not Path(path).is_file():
                raise ValueError(f"{option} {path!r} is not a file.")
        if text:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(model_path)
            except Exception as error:  # noqa: BLE001 (its only input is MODEL's tokenizer files, of any shape: the
                # tokenizers library raises a bare Exception for a model it rejects, Transformers whatever a value of
                # the wrong type meets)
                reason = " ".join(str(error).split())[:300] or type(error).__name__
                raise ValueError(f"--text needs a tokenizer in MODEL {model_path!r}, and none loads ({reason}). Pass "
                                 "--tokens FILE (a safetensors file holding `input_ids` [N, S]) instead.") from None
            try:
                content = Path(text).read_text()
            except UnicodeDecodeError as error:
                raise ValueError(f"--text {text!r} is not UTF-8 text ({error.reason} at byte {error.start}).") from None
            self.stream = tokenizer(content, add_special_tokens=False)["input_ids"]
            self.bos = tokenizer.bos_token_id
            self.description = f"{text} ({len(self.stream)} tokens, {type(tokenizer).__name__})"
        elif tokens:
            from safetensors import SafetensorError
            from safetensors.torch import load_file

            try:
                tensors = load_file(tokens)
            except SafetensorError as error:
                raise ValueError(f"--tokens {tokens!r} is not a safetensors file ({' '.join(str(error).split())}); "
                                 "give a safetensors file holding `input_ids` [N, S].") from None
            ids = tensors.get("input_ids")
            if ids is None or ids.dim() != 2 or ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ValueError(f"--tokens {tokens!r} must hold a 2-D integer tensor `input_ids` [N, S]; it holds "
                                 f"{ {k: f'{tuple(v.shape)} {v.dtype}' for k, v in tensors.items()} }.")
            if ids.numel() == 0:
                raise ValueError(f"--tokens {tokens!r} holds no tokens (`input_ids` is {tuple(ids.shape)}); give at "
                                 "least one sequence.")
            self.rows = ids.long()
            self.description = f"{tokens} ({self.rows.shape[0]} x {self.rows.shape[1]} tokens)"
        else:
            language = next((corpus() for corpus in CORPORA.values() if corpus().vocab_size == vocab_size), None)
            if language is None:
                raise ValueError(
                    f"Without --text or --tokens the input is a built-in synthetic corpus, whose vocabularies "
                    f"({', '.join(f'{name}: {corpus().vocab_size}' for name, corpus in CORPORA.items())} ids) do "
                    f"not match MODEL's {vocab_size}. Pass --text FILE (tokenized with MODEL's tokenizer) or "
                    "--tokens FILE.")
            self.language = language
            self.description = f"built-in synthetic corpus {type(language).__name__}, held-out documents"

    def windows(self, length: int, count: int) -> torch.Tensor:
        """`[n, length]` with n <= `count` windows (fewer only when a text is too short for `count`)."""
        import torch

        from .data import HELDOUT_SEED

        if self.stream is not None:
            body = length - (self.bos is not None)
            n = min(count, len(self.stream) // body)
            if n == 0:
                raise ValueError(f"The text has {len(self.stream)} tokens: too few for one window of {length}.")
            ids = torch.tensor(self.stream[: n * body]).view(n, body)
            if self.bos is not None:
                ids = torch.cat([torch.full((n, 1), self.bos), ids], dim=1)
        elif self.rows is not None:
            if self.rows.shape[1] < length:
                raise ValueError(f"--tokens holds sequences of {self.rows.shape[1]} tokens, shorter than the length "
                                 f"{length} asked for.")
            ids = self.rows[:count, :length]
        else:
            ids = self.language.sample(count, length, seed=HELDOUT_SEED)
        if int(ids.max()) >= self.vocab_size or int(ids.min()) < 0:
            raise ValueError(f"The input holds token ids outside MODEL's vocabulary [0, {self.vocab_size}).")
        return ids


def _load_model(path: str, dtype: str, device: str):
    """A gated_qwen or gated_qwen_moe folder, or one `from_pretrained` reads directly (the paper's release, stock
    Qwen3 / Qwen3-MoE, Qwen3.5 / Qwen3-Next; other model types are refused with the reason), with the causal LM of
    its kind: `GatedQwenForCausalLM`, or `GatedQwenMoeForCausalLM` for a mixture of experts."""
    import torch

    from .. import GatedQwenForCausalLM, GatedQwenMoeForCausalLM
    from ..configuration_gated import GATED_MODEL_TYPES
    from ..conversion.loading import gated_config_dict

    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"MODEL {path!r} is not a model folder (no config.json); pass a folder written by "
                         "save_pretrained.")
    what = f"the config.json of MODEL {path!r}"
    config_dict = read_json_object(Path(path) / "config.json", what)
    check_safetensors_files(Path(path), f"MODEL {path!r}")
    try:
        if config_dict.get("model_type") not in GATED_MODEL_TYPES:  # another format: its GatedQwen config
            config_dict = gated_config_dict(config_dict, {})
        moe = config_dict["model_type"] == GatedQwenMoeForCausalLM.config_class.model_type
        causal_lm = GatedQwenMoeForCausalLM if moe else GatedQwenForCausalLM
    except CONFIG_VALUE_ERRORS as error:
        raise ValueError(f"MODEL {path!r}: config.json is not a valid config ({' '.join(str(error).split())}).") from None
    config = config_from_dict(causal_lm.config_class, config_dict, what)  # refused before loading
    check_model_fits(causal_lm, config, getattr(torch, dtype), device, what)
    try:
        model = causal_lm.from_pretrained(path, dtype=getattr(torch, dtype), attn_implementation="sdpa",
                                          return_dict=True)  # outputs as measure reads them, whatever config.json says
    except pickle.UnpicklingError as error:
        from ..conversion.io import unpickling_reason

        raise ValueError(
            f"MODEL {path!r} holds pickled weights that torch.load(weights_only=True) refuses ("
            f"{unpickling_reason(error)}); only plain tensors are read from pickled files. Save the weights as "
            "safetensors from a source you trust.") from None
    return model.to(device).eval()


def _device(name: str) -> str:
    """`--device`: `auto` (CUDA when available, else the CPU) or a device this PyTorch has here, checked before any
    work (a `ValueError` naming what would be right)."""
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"--device {name!r} is not a device; give cpu, cuda, cuda:N or auto (CUDA when "
                         "available).") from None
    if device.type == "meta":
        raise ValueError(f"--device {name!r} holds no data (a meta tensor has a shape, not values), so nothing can be "
                         "measured on it; give cpu, cuda or auto.")
    if device.type == "cpu":
        return name
    backend = getattr(torch, device.type, None)
    count = backend.device_count() if backend is not None and backend.is_available() else 0
    if count == 0:
        raise ValueError(f"--device {name!r}: no {device.type.upper()} device is available here (this PyTorch, "
                         f"{torch.__version__}, sees none); give --device cpu or auto.")
    if device.index is not None and device.index >= count:
        raise ValueError(f"--device {name!r}: this machine has {count} {device.type.upper()} device(s), numbered from "
                         f"0; give one of {', '.join(f'{device.type}:{i}' for i in range(count))}.")
    return name


# ------------------------------------------------------------------------------------------------ memory checks
def available_memory(device: str) -> tuple[int, str] | None:
    """(bytes this process can still allocate on `device`, where the number comes from), None where unknown: on a
    GPU what it has free, on the CPU the smaller of the system's available memory and this cgroup's limit."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.mem_get_info(torch.device(device))[0], f"free on {device}"
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append((int(line.split()[1]) * 1024, "MemAvailable"))
    except (OSError, ValueError, IndexError):
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            used = int(Path("/sys/fs/cgroup/memory.current").read_text())
            found.append((max(0, int(limit) - used), "this cgroup's memory.max"))
    except (OSError, ValueError):
        pass
    try:  # an address-space cap (`ulimit -v`, resource.setrlimit): what this process has mapped counts against it
        import resource

        cap = resource.getrlimit(resource.RLIMIT_AS)[0]
        if cap != resource.RLIM_INFINITY:
            status = Path("/proc/self/status").read_text()
            mapped = int(next(line for line in status.splitlines() if line.startswith("VmSize:")).split()[1]) * 1024
            found.append((max(0, cap - mapped), "the RLIMIT_AS of this process"))
    except (ImportError, OSError, ValueError, StopIteration):
        pass
    return min(found) if found else None


def check_model_fits(causal_lm: type, config, dtype, device: str, what: str) -> None:
    """Refuses a config whose model would not fit in `device`'s memory in `dtype` (its parameters counted on the meta
    device, from the config's own sizes, before anything is allocated), naming its largest tensor: `vocab_size` 2e8
    over tiny weights is 25 GB of embeddings that `from_pretrained` would allocate before it found the shapes
    wrong. `what` names the config.json."""
    import torch

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
    """About the peak memory of one `reproduce` run of `preset` (a `reproduce.Preset`), from its sizes alone (no
    config is built: `--layers 10**9` would make a list of 10**9 layer types): the float32 weights, their gradients
    and Adam's two moments (16 bytes a parameter; the gate counted as the largest, elementwise, one), the training
    and held-out documents, and the largest forward the run makes: a training step (kept for the backward, about 3
    forwards), the analysis of `analysis_documents`, or the longest extrapolation length."""
    from types import SimpleNamespace

    hidden, heads, kv_heads, head_dim = (preset.hidden_size, preset.num_attention_heads, preset.num_key_value_heads,
                                         preset.head_dim)
    shape = SimpleNamespace(vocab_size=preset.language.vocab_size, hidden_size=hidden, head_dim=head_dim,
                            intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_hidden_layers,
                            num_attention_heads=heads, num_key_value_heads=kv_heads)
    per_layer = hidden * (3 * heads + 2 * kv_heads) * head_dim + 3 * hidden * preset.intermediate_size + 4 * hidden
    parameters = preset.num_hidden_layers * per_layer + 2 * preset.language.vocab_size * hidden
    longest = preset.seq_len * max(preset.extrapolation)
    documents = 8 * (preset.steps * preset.batch_size * preset.seq_len
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
    import dataclasses

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


# --------------------------------------------------------------------------------------------------- analyze
def run_analyze(args) -> int:
    from . import measure
    from .report import write_analysis

    out = dict(inputs=[args.model, args.text, args.tokens], overwrite=args.overwrite, create_parents=True)
    check_output(args.out, **out)  # before the slow part
    model = _load_model(args.model, args.dtype, _device(args.device))
    dtype_bytes = next(model.parameters()).element_size()
    check_fits(lambda length: forward_bytes(model.config, min(args.batch_size, args.sequences), length, dtype_bytes,
                                            gate_logits=True, map_tokens=args.map_tokens, logits=bool(args.quant)),
               args.length, "--length", f"one batch of {min(args.batch_size, args.sequences)} sequence(s)"
               + (" and its logits (--quant)" if args.quant else ""), _device(args.device))
    check_windows_fit(args, args.length)
    inputs = Inputs(args.model, model.config.vocab_size, args.text, args.tokens)
    ids = inputs.windows(args.length, args.sequences)
    layers = model.config.num_hidden_layers
    map_layers = args.map_layers if args.map_layers is not None else sorted({0, layers // 2, layers - 1})
    with output_folder(args.out, **out) as folder:
        started = time.perf_counter()
        result = measure.analyze(model, ids, batch_size=args.batch_size, map_tokens=args.map_tokens,
                                 map_layers=map_layers, progress=ids.numel() >= 8192)
        if args.quant:
            from .quantize import perplexity_under_quantization

            result["quantization"] = perplexity_under_quantization(model, ids, args.quant, args.batch_size)
        meta = {"model": args.model, "data": inputs.description, "sequences": ids.shape[0], "length": ids.shape[1],
                "seconds": time.perf_counter() - started, "device": str(next(model.parameters()).device)}
        text = write_analysis(folder, result, meta)
    print(text.split("## Per layer")[0].strip())
    print(f"\nWrote {args.out}/report.md, report.json and plots.")
    return 0


# -------------------------------------------------------------------------------------------------- eval-ppl
def run_eval_ppl(args) -> int:
    from .measure import perplexity_by_length
    from .report import markdown_table

    out = dict(inputs=[args.model, args.text, args.tokens], overwrite=args.overwrite, create_parents=True)
    if args.out:
        check_output(args.out, kind="file", **out)  # before the slow part
    model = _load_model(args.model, args.dtype, _device(args.device))
    dtype_bytes = next(model.parameters()).element_size()
    batch = min(args.batch_size, args.sequences)
    check_fits(lambda length: forward_bytes(model.config, batch, length, dtype_bytes, logits=True), max(args.lengths),
               "--lengths", f"one batch of {batch} sequence(s) and its logits", _device(args.device))
    check_windows_fit(args, max(args.lengths))
    inputs = Inputs(args.model, model.config.vocab_size, args.text, args.tokens)
    rows = perplexity_by_length(model, lambda length: inputs.windows(length, args.sequences), args.lengths,
                                yarn_factor=args.yarn, batch_size=args.batch_size)
    header = ["length", "sequences", "PPL"] + ([f"PPL with YaRN x{args.yarn:g}"] if args.yarn else [])
    print(f"{args.model} on {inputs.description} (trained context: {model.config.max_position_embeddings})")
    print(markdown_table(header, [[r["length"], r["sequences"], r["ppl"]] + ([r["ppl_yarn"]] if args.yarn else [])
                                  for r in rows]))
    if args.out:
        with output_file(args.out, **out) as path:
            write_json(path, {"model": args.model, "data": inputs.description, "yarn_factor": args.yarn, "rows": rows})
    return 0


# ------------------------------------------------------------------------------------------------- reproduce
def run_reproduce(args) -> int:
    import dataclasses

    import torch

    from . import reproduce
    from .data import HELDOUT_SEED
    from .report import write_reproduce

    if args.preset not in reproduce.PRESETS:
        raise ValueError(f"--preset {args.preset!r} is not a preset; choose one of {', '.join(reproduce.PRESETS)}.")
    if args.corpus and args.corpus not in reproduce.CORPORA:
        raise ValueError(f"--corpus {args.corpus!r} is not a corpus; choose one of {', '.join(reproduce.CORPORA)}.")
    base = reproduce.PRESETS[args.preset]
    size = {}
    if args.hidden_size:
        if args.hidden_size % base.num_attention_heads:
            raise ValueError(f"--hidden-size {args.hidden_size} must be a multiple of the {base.num_attention_heads} "
                             "attention heads.")
        size = dict(hidden_size=args.hidden_size, head_dim=args.hidden_size // base.num_attention_heads,
                    intermediate_size=3 * args.hidden_size)
    preset = reproduce.customised(
        base, steps=args.steps, num_hidden_layers=args.layers, seq_len=args.seq_len, batch_size=args.batch_size,
        learning_rates=tuple(args.learning_rates) if args.learning_rates else None,
        seeds=tuple(dict.fromkeys(args.seeds)) if args.seeds else None,
        language=reproduce.CORPORA[args.corpus]() if args.corpus else None, use_qk_norm=args.qk_norm,
        max_grad_norm=0.0 if args.no_clip else None, bf16=args.bf16 or None, **size)
    if args.no_mact_model:
        preset = dataclasses.replace(preset, mact=None)
    if args.no_long_context_model:
        preset = dataclasses.replace(preset, long_context=None)
    variants = list(dict.fromkeys(args.variants.split(","))) if args.variants else list(reproduce.VARIANTS)
    unknown = [v for v in variants if v not in reproduce.VARIANTS]
    if unknown:
        raise ValueError(f"--variants: unknown {unknown}; choose from {list(reproduce.VARIANTS)}.")
    if HELDOUT_SEED in preset.seeds:
        raise ValueError(f"--seeds {HELDOUT_SEED} draws the held-out documents; choose another seed.")
    out = dict(overwrite=args.overwrite, create_parents=True)
    check_output(args.out, **out)
    runs = sum(len(runs(preset, variants)) for runs in (reproduce.planned_runs, reproduce.mact_runs,
                                                         reproduce.long_context_runs))
    jobs = args.jobs or (1 if torch.cuda.is_available() else min(runs, os.cpu_count() or 1))
    check_training_fits(preset, min(jobs, runs), args, "cuda" if torch.cuda.is_available() else "cpu")
    for variant in variants:  # a size the model refuses fails now, not in a worker
        reproduce.model_config(preset, variant)
    device = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
              else f"{os.cpu_count()} CPU cores ({reproduce.cpu_name()})")
    with output_folder(args.out, **out) as folder:
        from safetensors.torch import save_file

        started = time.perf_counter()
        results = reproduce.run_all(preset, variants, folder / "models", jobs)
        save_file({"input_ids": reproduce.held_out(preset).contiguous()}, str(folder / "heldout.safetensors"))
        if any(r["part"] == "mact" for r in results):
            save_file({"input_ids": reproduce.held_out(reproduce.mact_preset(preset)).contiguous()},
                      str(folder / "heldout_mact.safetensors"))
        if any(r["part"] == "long" for r in results):
            long = reproduce.long_context_preset(preset)
            save_file({f"input_ids_{n}": reproduce.held_out(long, n).contiguous()
                       for n in reproduce.extrapolation_lengths(long)}, str(folder / "heldout_long_context.safetensors"))
        meta = {"seeds": list(preset.seeds), "preset": args.preset, "jobs": jobs, "device": device,
                "seconds": time.perf_counter() - started, "environment": reproduce.environment()}
        text = write_reproduce(folder, reproduce.preset_dict(preset), variants, preset.learning_rates, results, meta)
    body = text.split("## Plots")[0]
    print(body.strip())
    print(f"\nWrote {args.out}/report.md, report.json, plots and models in {meta['seconds']:.0f} s.")
    return 0


# ---------------------------------------------------------------------------------------------------- parser
def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _length(text: str) -> int:
    value = int(text)
    if value < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2 (a token is predicted from the ones before it), got {text}")
    return value


def _seed(text: str) -> int:
    value = int(text)
    if not 0 <= value < 2**32:
        raise argparse.ArgumentTypeError(f"a seed must be in [0, 2**32 - 1], got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _yarn_factor(text: str) -> float:
    value = float(text)
    if not value > 1 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"YaRN factor must be > 1 (the context extension ratio), got {text}")
    return value


def _quant_schemes(text: str) -> list[str]:
    """`--quant`: comma-separated names of `quantize.SCHEMES`, or `all`."""
    names = ["w8a8-tensor", "w8a8-token", "w4a8", "w4a4"]  # `quantize.SCHEMES`, listed without importing torch
    chosen = names if text == "all" else [name.strip() for name in text.split(",")]
    unknown = [name for name in chosen if name not in names]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"unknown scheme(s) {', '.join(map(repr, unknown))}; give a comma-separated "
                                         f"list of {', '.join(names)}, or all")
    return list(dict.fromkeys(chosen))


def _add_model_inputs(parser) -> None:
    parser.add_argument("model", metavar="MODEL", help="a GatedQwen model folder (save_pretrained)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="held-out text, tokenized with MODEL's tokenizer")
    source.add_argument("--tokens", metavar="FILE", help="safetensors file with `input_ids` [N, S] (e.g. the "
                        "heldout.safetensors of a reproduce run); default: the built-in synthetic corpus")
    parser.add_argument("--batch-size", type=_positive_int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... (default: cuda when available)")


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "analyze", help="F-Attn, M-Act, gate statistics and attention maps of a model (report.md, report.json, PNGs)")
    _add_model_inputs(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="output folder (created whole or not at all)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    parser.add_argument("--length", type=_length, default=2048, help="tokens per sequence (default 2048)")
    parser.add_argument("--sequences", type=_positive_int, default=1, help="sequences to average over (default 1)")
    parser.add_argument("--map-tokens", type=_positive_int, default=32, help="attention maps of the first N tokens")
    parser.add_argument("--map-layers", type=int, nargs="+", help="layers to draw (default: first, middle, last)")
    parser.add_argument("--quant", type=_quant_schemes, metavar="SCHEMES",
                        help="also the held-out perplexity under fake quantization of every decoder linear layer, in "
                        "float and under each of these comma-separated schemes: w8a8-tensor, w8a8-token, w4a8, w4a4, "
                        "or all (docs/analysis.md)")
    parser.set_defaults(func=run_analyze)

    parser = subparsers.add_parser("eval-ppl", help="perplexity against context length, with and without YaRN")
    _add_model_inputs(parser)
    parser.add_argument("--lengths", type=_length, nargs="+", required=True, help="context lengths")
    parser.add_argument("--yarn", type=_yarn_factor, metavar="FACTOR",
                        help="also evaluate with YaRN extending the trained context by FACTOR")
    parser.add_argument("--sequences", type=_positive_int, default=8, help="windows per length (default 8)")
    parser.add_argument("--out", metavar="FILE", help="also write the rows as JSON")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.set_defaults(func=run_eval_ppl)

    parser = subparsers.add_parser(
        "reproduce", help="train tiny baseline/gated models on built-in data, analyse them, write report.md (the demo)")
    parser.add_argument("--preset", default="default",
                        help="smoke: seconds; default: ~6 min on 2 idle CPU cores; large: a GPU (README)")
    parser.add_argument("--variants", help="comma-separated subset of the variants (default: all; the report lists "
                                           "them, e.g. baseline,g1-elementwise)")
    parser.add_argument("--steps", type=_positive_int, help="training steps per run")
    parser.add_argument("--hidden-size", type=_positive_int, help="model width (heads keep their number)")
    parser.add_argument("--layers", type=_positive_int, help="decoder layers")
    parser.add_argument("--seq-len", type=_length, help="training context length")
    parser.add_argument("--batch-size", type=_positive_int, help="sequences per step")
    parser.add_argument("--learning-rates", type=_positive_float, nargs=2, metavar=("STANDARD", "HIGH"))
    parser.add_argument("--seeds", "--seed", type=_seed, nargs="+", metavar="SEED",
                        help="train every model once per seed (default: the preset's, 0 1)")
    parser.add_argument("--corpus",
                        help="bigram-backcopy (default): sinks throughout the sequence; repeats: spans copied from "
                        "far back (the corpus of earlier demos)")
    parser.add_argument("--qk-norm", action="store_true", default=None,
                        help="RMSNorm on queries and keys, as in Qwen3 and the paper (off in the demo: see README)")
    parser.add_argument("--no-clip", action="store_true", help="no gradient clipping (default: clip at norm 1)")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast")
    parser.add_argument("--no-mact-model", action="store_true",
                        help="skip the preset's deeper M-Act model (trained, as baseline and g1-elementwise, for the "
                        "massive-activation check; the options above change only the main models)")
    parser.add_argument("--no-long-context-model", action="store_true",
                        help="skip the preset's long-context model (baseline, g1-elementwise and g1-headwise on key -> "
                        "value recall, evaluated at up to 8 times its training length)")
    parser.add_argument("--jobs", type=_positive_int, help="runs trained at once (default: one per CPU core on CPU)")
    parser.add_argument("--out", default="runs/reproduce", metavar="DIR", help="output folder (default runs/reproduce)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing non-empty --out")
    parser.set_defaults(func=run_reproduce)
