"""What `gated-qwen analyze`, `eval-ppl` and `reproduce` do once their flags are parsed (`cli`).

Each command checks its output (`--out` may not be, contain or lie inside MODEL or an input file) and every size
flag's memory (`memory`) before the slow part, imports the model stack when it runs, and writes through
`gated_qwen.files`: its output appears whole or not at all, and replaces an existing one only with `--overwrite`.
"""

from __future__ import annotations

import os
import time

from ..files import check_output, output_file, output_folder, write_json
from .inputs import Inputs, device, load_model
from .memory import check_fits, check_training_fits, check_windows_fit, forward_bytes


def run_analyze(args) -> int:
    from . import measure
    from .report import write_analysis

    out = dict(inputs=[args.model, args.text, args.tokens], overwrite=args.overwrite, create_parents=True)
    check_output(args.out, **out)  # before the slow part
    model = load_model(args.model, args.dtype, device(args.device))
    dtype_bytes = next(model.parameters()).element_size()
    check_fits(lambda length: forward_bytes(model.config, min(args.batch_size, args.sequences), length, dtype_bytes,
                                            gate_logits=True, map_tokens=args.map_tokens, logits=bool(args.quant)),
               args.length, "--length", f"one batch of {min(args.batch_size, args.sequences)} sequence(s)"
               + (" and its logits (--quant)" if args.quant else ""), device(args.device))
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
    model = load_model(args.model, args.dtype, device(args.device))
    dtype_bytes = next(model.parameters()).element_size()
    batch = min(args.batch_size, args.sequences)
    check_fits(lambda length: forward_bytes(model.config, batch, length, dtype_bytes, logits=True), max(args.lengths),
               "--lengths", f"one batch of {batch} sequence(s) and its logits", device(args.device))
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
    import torch

    from . import reproduce
    from .reproduce_report import write_reproduce

    preset, variants = reproduce_preset(args)
    out = dict(overwrite=args.overwrite, create_parents=True)
    check_output(args.out, **out)
    jobs = check_reproduce(preset, variants, args)
    hardware = (torch.cuda.get_device_name(0) if torch.cuda.is_available()
                else f"{os.cpu_count()} CPU cores ({reproduce.cpu_name()})")
    with output_folder(args.out, **out) as folder:
        started = time.perf_counter()
        results = reproduce.run_all(preset, variants, folder / "models", jobs)
        _save_held_out(folder, preset, results)
        meta = {"seeds": list(preset.seeds), "preset": args.preset, "jobs": jobs, "device": hardware,
                "seconds": time.perf_counter() - started, "environment": reproduce.environment()}
        text = write_reproduce(folder, reproduce.preset_dict(preset), variants, preset.learning_rates, results, meta)
    body = text.split("## Plots")[0]
    print(body.strip())
    print(f"\nWrote {args.out}/report.md, report.json, directions.json, plots and models in {meta['seconds']:.0f} s.")
    return 0


def reproduce_preset(args):
    """The `reproduce.Preset` and the variants the flags ask for (refused with the reason when they name no preset,
    corpus or variant, or a width the heads do not divide)."""
    import dataclasses

    from . import reproduce

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
    return preset, variants


def check_reproduce(preset, variants: list[str], args) -> int:
    """Everything a `reproduce` run could fail on after training started, checked before any worker starts: the
    seeds, each model family's corpus at every length it is drawn at, the memory of the runs at once and each
    variant's config. Returns the number of runs at once (`--jobs`, or one per CPU core)."""
    import torch

    from . import reproduce
    from .data import HELDOUT_SEED

    if HELDOUT_SEED in preset.seeds:
        raise ValueError(f"--seeds {HELDOUT_SEED} draws the held-out documents; choose another seed.")
    for name, chosen in (("the main models (--seq-len, --corpus)", preset),
                         ("the M-Act model", reproduce.mact_preset(preset)),
                         ("the long-context model", reproduce.long_context_preset(preset))):
        check_length = getattr(chosen.language, "check_length", None) if chosen else None
        stages = [chosen.short_stage[0]] if chosen and chosen.short_stage else []
        lengths = sorted({chosen.seq_len, *stages, *reproduce.extrapolation_lengths(chosen)}) if check_length else []
        for length in lengths[::-1]:  # the longest first: its message names the limit that holds for all
            try:
                check_length(length)
            except ValueError as error:
                raise ValueError(f"{name}, trained at {chosen.seq_len} tokens and measured at "
                                 f"{', '.join(map(str, lengths))}: {error}") from None
    runs = sum(len(runs(preset, variants)) for runs in (reproduce.planned_runs, reproduce.mact_runs,
                                                         reproduce.long_context_runs))
    jobs = args.jobs or (1 if torch.cuda.is_available() else min(runs, os.cpu_count() or 1))
    check_training_fits(preset, min(jobs, runs), args, "cuda" if torch.cuda.is_available() else "cpu")
    for variant in variants:  # a size the model refuses fails now, not in a worker
        reproduce.model_config(preset, variant)
    return jobs


def _save_held_out(folder, preset, results: list[dict]) -> None:
    """The held-out documents each trained family was measured on, as safetensors beside the report."""
    from safetensors.torch import save_file

    from . import reproduce

    save_file({"input_ids": reproduce.held_out(preset).contiguous()}, str(folder / "heldout.safetensors"))
    if any(r["part"] == "mact" for r in results):
        save_file({"input_ids": reproduce.held_out(reproduce.mact_preset(preset)).contiguous()},
                  str(folder / "heldout_mact.safetensors"))
    if any(r["part"] == "long" for r in results):
        long = reproduce.long_context_preset(preset)
        save_file({f"input_ids_{n}": reproduce.held_out(long, n).contiguous()
                   for n in reproduce.extrapolation_lengths(long)}, str(folder / "heldout_long_context.safetensors"))
