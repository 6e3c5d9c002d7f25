"""`gated-qwen convert SRC DST --from FORMAT | --to FORMAT [...]` and `gated-qwen convert --clean PATH`: the
command-line face of `gated_qwen.conversion`."""

from __future__ import annotations

import argparse

from ..files import say
from . import FORMATS, FROM_FORMATS, TO_FORMATS, VERIFY_MAX_PARAMETERS, VERIFY_RTOL, ConversionError, clean, convert
from .formats import described, export_options, taking


def run(args: argparse.Namespace) -> int:
    if args.clean is not None:
        given = [flag for flag, value in (("SRC", args.src), ("--from", args.from_format), ("--to", args.to_format))
                 if value is not None]
        if given:
            raise ConversionError(f"--clean PATH takes no other argument (got {', '.join(given)}).")
        actions = clean(args.clean)
        for line in actions:
            print(line)
        if not actions:
            say(f"no stale staging folder for {args.clean}")
        return 0
    if args.src is None or args.dst is None:
        raise ConversionError("give SRC and DST (gated-qwen convert SRC DST --from FORMAT | --to FORMAT), or --clean "
                              "PATH.")
    options = {name: getattr(args, name) for name in export_options() if getattr(args, name) is not None}
    convert(args.src, args.dst, from_format=args.from_format, to_format=args.to_format, add_gate=args.add_gate,
            overwrite=args.overwrite, allow_pickle=args.allow_pickle, verify=args.verify,
            max_shard_size=args.max_shard_size, carry_code=args.carry_code, **options)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help=f"Convert checkpoints between gated_qwen and {', '.join(FORMATS)}.",
        description=(
            "Import a checkpoint into gated_qwen (--from) or export a gated_qwen checkpoint (--to). Formats: "
            f"{described(FORMATS)}. Tensors are streamed; the structure (every tensor once, shapes from the written config) is "
            "checked whatever --verify says; DST is built in a staging folder beside it (.DST.writing-PID-XXXX) and "
            "renamed into place when complete. Exit status: 0 converted, 1 verification failed, 2 refused; "
            "nothing is written unless 0."
        ),
    )
    parser.add_argument("src", metavar="SRC", nargs="?", help="source model folder (config.json + weights)")
    parser.add_argument("dst", metavar="DST", nargs="?",
                        help="destination folder: new, or an existing one with --overwrite; never SRC, inside SRC "
                             "or a folder that contains SRC")
    direction = parser.add_mutually_exclusive_group()
    direction.add_argument("--from", dest="from_format", choices=FROM_FORMATS, metavar="FORMAT",
                           help=f"import SRC in FORMAT ({', '.join(FROM_FORMATS)}) into gated_qwen")
    direction.add_argument("--to", dest="to_format", choices=TO_FORMATS, metavar="FORMAT",
                           help=f"export the gated_qwen SRC to FORMAT ({', '.join(TO_FORMATS)})")
    gated = " or ".join(f for f in FROM_FORMATS if FORMATS[f].reading.takes_gate)
    parser.add_argument("--add-gate", metavar="VARIANT", default=None,
                        help=f"with --from {gated}: add a gate initialised so the logits do not change; "
                             "'elementwise', 'headwise' (G1 sigmoid) or a JSON object of gate fields")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing DST (once the new one is complete)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read pickled pytorch_model*.bin weights (with torch.load(weights_only=True))")
    parser.add_argument("--carry-code", action="store_true",
                        help="also carry SRC's own *.py files (custom tokenizer or model code, which Transformers "
                             "runs with trust_remote_code=True); by default code is not carried")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                        help=f"compare source and result logits (tolerance {VERIFY_RTOL:g} relative to the largest "
                             f"logit); default: on up to {VERIFY_MAX_PARAMETERS // 10**6}M parameters")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="largest output shard, e.g. 2GB (default: half the largest weight file of SRC)")
    for option in export_options().values():  # each format's own, declared in its module
        value = {"action": "store_true"} if option.metavar is None else {"metavar": option.metavar, "type": option.type}
        parser.add_argument(option.flag, dest=option.name, default=None, **value,
                            help=f"with {' / '.join(f'--to {f}' for f in taking(option.name))}: {option.help}")
    parser.add_argument("--clean", metavar="PATH", default=None,
                        help="instead of converting: remove the staging folders (.NAME.writing-*, .NAME.replaced-*) "
                             "that killed runs left beside PATH or inside the folder PATH, and their scratch folders "
                             "(gated-qwen-* in TMPDIR, or wherever they were made), when their process has ended (an interrupted replacement is "
                             "put back)")
    parser.set_defaults(func=run)
