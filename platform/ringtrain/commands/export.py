"""`ringtrain export SOURCE OUT_DIR`: a checkpoint as a Hugging Face model folder.

``add_arguments`` fills the ``export`` subcommand's parser and ``run`` executes it. Exit codes:
0 written, 1 the export failed while writing (disk full, say), 2 bad input (a SOURCE that is
not a readable ringtrain checkpoint, a non-empty OUT_DIR without --overwrite, a bad flag): one
line naming it, no traceback. torch is imported only once the command runs, so the CLI stays
light for every other subcommand.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Callable

from ringtrain.errors import EXIT_OK, ConfigError, RingtrainError, end
from ringtrain.hf.shards import DEFAULT_MAX_SHARD_SIZE, parse_size

if TYPE_CHECKING:
    from ringtrain.hf.export import ExportResult


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``export`` subcommand's arguments. Values are parsed in ``run`` so errors stay one line."""
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="a run directory (its newest valid checkpoint), a checkpoint (.../step-000000010) "
        "or a checkpoint store (file:// or s3://, its newest valid checkpoint)",
    )
    parser.add_argument("out_dir", metavar="OUT_DIR", help="the Hugging Face model folder to write (empty or new)")
    parser.add_argument(
        "--dtype",
        metavar="{bf16,fp32}",
        help="bf16 or fp32 (default: the source model's dtype; fp32 for a model trained from scratch)",
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        metavar="SIZE",
        help=f"largest safetensors file, e.g. 5GB, 500MB, 2GiB (default {DEFAULT_MAX_SHARD_SIZE})",
    )
    parser.add_argument(
        "--hf-source", metavar="PATH", help="copy the tokenizer and generation_config.json from this model folder "
        "(default: the folder the run was started from, recorded in the checkpoint)"
    )
    parser.add_argument("--overwrite", action="store_true", help="replace OUT_DIR when it is not empty")


def run(args: argparse.Namespace) -> int:
    """Execute ``ringtrain export``; progress lines on stdout, errors as one line on stderr."""

    def progress(line: str) -> None:
        print(f"export: {line}", flush=True)

    try:
        result = _exported(args, progress)
    except RingtrainError as exc:
        return end(exc, "export")
    progress(
        f"wrote {result.out_dir}: {len(result.files)} files, {result.num_tensors} tensors, "
        f"{result.num_bytes / 1e6:,.1f} MB ({result.dtype}) from step {result.step}"
    )
    return EXIT_OK


def _exported(args: argparse.Namespace, progress: Callable[[str], None]) -> "ExportResult":
    """``hf.export``'s answer. Bad input is a ConfigError naming what to change: a flag, OUT_DIR,
    or SOURCE for whatever reading the checkpoint met (damaged, or not this model's); a folder
    that cannot be written is a failure the OS names."""
    from ringtrain.hf.export import export  # torch: only once the command runs

    try:
        max_shard_size = parse_size(args.max_shard_size)
    except ValueError as exc:
        raise ConfigError("--max-shard-size", str(exc)) from None
    try:
        return export(
            args.source,
            args.out_dir,
            dtype=args.dtype,
            max_shard_size=max_shard_size,
            overwrite=args.overwrite,
            hf_source=args.hf_source,
            say=progress,
        )
    except ConfigError:  # hf.export's ExportError among them
        raise
    except RingtrainError as exc:
        raise ConfigError(f"SOURCE {args.source}", str(exc)) from None
    except OSError as exc:
        raise RingtrainError(f"failed writing {args.out_dir}: {exc}") from exc
