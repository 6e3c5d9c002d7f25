"""What `gated-qwen analyze` and `eval-ppl` do once their flags are parsed (`cli`; `reproduce`'s is
`miniature.command`).

Each command checks its output (`--out` may not be, contain or lie inside MODEL or an input file) and every size
flag's memory (`memory`) before the slow part, and writes through
`gated_qwen.files`: its output appears whole or not at all, and replaces an existing one only with `--overwrite`.
"""

from __future__ import annotations

import time

from ..files import check_output, output_file, output_folder, write_json
from . import measure
from .footprint import check_fits, check_windows_fit, forward_bytes
from .inputs import Inputs, device, load_model
from .perplexity import perplexity_by_length
from .quantize import perplexity_under_quantization
from .report import markdown_table, write_analysis


def run_analyze(args) -> int:
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
            result["quantization"] = perplexity_under_quantization(model, ids, args.quant, args.batch_size)
        meta = {"model": args.model, "data": inputs.description, "sequences": ids.shape[0], "length": ids.shape[1],
                "seconds": time.perf_counter() - started, "device": str(next(model.parameters()).device)}
        text = write_analysis(folder, result, meta)
    print(text.split("## Per layer")[0].strip())
    print(f"\nWrote {args.out}/report.md, report.json and plots.")
    return 0


# -------------------------------------------------------------------------------------------------- eval-ppl
def run_eval_ppl(args) -> int:
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
