"""Command line: ``python -m mla_attn.convert SRC DST ...`` and ``mla-attn convert SRC DST ...``.

``main(argv)`` takes the arguments after the program (or subcommand) name and returns an exit
code, so the package-level ``mla-attn`` script can hand it ``argv[1:]`` of its ``convert``
subcommand; ``add_arguments`` fills an existing (sub)parser the same way.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}

DESCRIPTION = (
    "Convert a Hugging Face DeepSeek-style checkpoint (DeepSeek-V2/V3, Kimi-K2, Moonlight) for "
    "mla_attn: dequantize block-FP8 weights, add the absorbed MLA matrices w_uk / w_uv per layer, "
    "copy everything else unchanged. Streams shard by shard; writes atomically."
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("src", metavar="SRC", help="checkpoint folder (config.json, *.safetensors)")
    parser.add_argument("dst", metavar="DST", help="output folder (must not exist unless --overwrite)")
    parser.add_argument(
        "--dtype",
        default="bf16",
        choices=sorted(DTYPES),
        help="dtype of dequantized FP8 weights (default bf16); other tensors keep theirs",
    )
    parser.add_argument("--no-absorb", action="store_true", help="do not add w_uk / w_uv")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument(
        "--max-shard-size", default="5GB", help="largest output shard, e.g. 5GB or 500MB (default 5GB)"
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="only print errors")
    return parser


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    """Run the converter; returns 0 on success, 1 on a checkpoint / destination error."""
    parser = add_arguments(
        argparse.ArgumentParser(prog=prog or "python -m mla_attn.convert", description=DESCRIPTION)
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")

    from .checkpoint import convert_checkpoint

    try:
        dst = convert_checkpoint(
            args.src,
            args.dst,
            dtype=DTYPES[args.dtype],
            absorb=not args.no_absorb,
            progress=not (args.no_progress or args.quiet),
            overwrite=args.overwrite,
            max_shard_size=args.max_shard_size,
        )
    except (ValueError, FileExistsError, FileNotFoundError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: {args.dst} left as it was (no partial output)", file=sys.stderr)
        return 130
    if not args.quiet:
        print(f"wrote {dst}")
    return 0
