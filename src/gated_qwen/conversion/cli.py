"""`gated-qwen convert SRC DST --from FORMAT | --to FORMAT [...]`: the command-line face of `gated_qwen.conversion`."""

from __future__ import annotations

import argparse
import sys

from . import FROM_FORMATS, TO_FORMATS, VERIFY_MAX_PARAMETERS, VERIFY_RTOL, ConversionError, VerificationError, convert


def run(args: argparse.Namespace) -> int:
    try:
        convert(args.src, args.dst, from_format=args.from_format, to_format=args.to_format, add_gate=args.add_gate,
                overwrite=args.overwrite, allow_pickle=args.allow_pickle, verify=args.verify,
                max_shard_size=args.max_shard_size)
    except ConversionError as error:
        print(f"gated-qwen convert: error: {error}", file=sys.stderr)
        return 1 if isinstance(error, VerificationError) else 2
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="Convert checkpoints: the paper's release, stock Qwen3, Qwen3-MoE, Qwen3.5, Qwen3-Next <-> gated_qwen.",
        description=(
            "Import a checkpoint into gated_qwen (--from) or export a gated_qwen checkpoint (--to). Tensors are "
            "streamed; DST is written in a temporary folder beside it and renamed into place when complete."
        ),
    )
    parser.add_argument("src", metavar="SRC", help="source model folder (config.json + weights)")
    parser.add_argument("dst", metavar="DST", help="destination folder (must not exist unless --overwrite)")
    direction = parser.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from", dest="from_format", choices=FROM_FORMATS, metavar="FORMAT",
                           help=f"import SRC in FORMAT ({', '.join(FROM_FORMATS)}) into gated_qwen")
    direction.add_argument("--to", dest="to_format", choices=TO_FORMATS, metavar="FORMAT",
                           help=f"export the gated_qwen SRC to FORMAT ({', '.join(TO_FORMATS)})")
    parser.add_argument("--add-gate", metavar="VARIANT", default=None,
                        help="with --from qwen3 or qwen3_moe: add a gate initialised so the logits do not change; "
                             "'elementwise', 'headwise' (G1 sigmoid) or a JSON object of gate fields")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing DST (once the new one is complete)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help="read pickled pytorch_model*.bin weights (with torch.load(weights_only=True))")
    parser.add_argument("--verify", action=argparse.BooleanOptionalAction, default=None,
                        help=f"compare source and result logits (tolerance {VERIFY_RTOL:g} relative to the largest "
                             f"logit); default: on up to {VERIFY_MAX_PARAMETERS // 10**6}M parameters")
    parser.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="largest output shard, e.g. 2GB (default: half the largest weight file of SRC; peak "
                             "memory is about one output shard)")
    parser.set_defaults(func=run)
