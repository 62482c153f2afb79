"""`ringtrain` command line: the parser of every verb, and the dispatch to its module in ``commands/``.

Exit codes: 0 success, 1 the run failed, 2 bad input (config, data path, capacity): one line
naming the key to change, no traceback. An error ends a verb by its class (``errors.ending``).
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from ringtrain.commands import dashboards, export, generate, jobs, plan, prepare, report, run
from ringtrain.commands import eval as evaluate  # `eval` alone would shadow the builtin
from ringtrain.errors import EXIT_FAILED, EXIT_USAGE, ConfigError, RingtrainError, end  # noqa: F401  (EXIT_FAILED: cli's too)

# What `ringtrain --help` says: for users, not about this module.
DESCRIPTION = (
    "Train long-context language models on a Ray cluster (elastic, fault-tolerant,\n"
    "context-parallel), then evaluate, export and report on them."
)
EPILOG = """\
A job is a YAML file (jobs/*.yaml) plus key=value overrides, written without dashes:
  ringtrain run jobs/quickstart.yaml train.steps=20 'data.sources[0].path=/data/code'
`ringtrain VERB --help` lists a verb's options. Every config key: docs/configuration.md;
the rest of the documentation: README.md and docs/ in the ringtrain repository."""
# An option whose name holds a dot is no option of any verb: an override written with dashes.
_DASHED_OVERRIDE = re.compile(r"^--?(?P<key>[A-Za-z_][\w-]*(?:\.|\[)[^=]*)(?P<value>=.*)?$")


class _ExactFlags(argparse.ArgumentParser):
    """A flag only as spelled, never a prefix of it: a flag renamed or removed fails the commands
    that still use its old name instead of quietly matching a longer one. Subparsers inherit it."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Verb:
    """A verb of its own module in ``commands/``: its one line in ``--help``, its options, and
    what it does given the parsed options and the command line (``argv``, None: sys.argv's)."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace, Optional[Sequence[str]]], int]


# In the order `ringtrain --help` lists them; submit, status, logs and stop come after, from jobs.
VERBS: dict[str, Verb] = {
    "run": Verb("train a job on an embedded local Ray cluster, or RAY_ADDRESS", run.add_arguments,
                lambda args, argv: run.run(args)),
    "plan": Verb("which layouts fit on N GPUs and how fast (needs no GPU)", plan.add_arguments,
                 lambda args, argv: plan.run(args, load_job=plan.load_job)),
    "dashboards": Verb("export the Grafana dashboards, or push them and the alert rules", dashboards.add_arguments,
                       lambda args, argv: dashboards.run(args)),
    "report": Verb("write RUN_DIR/report.html: curves, step time by rank, incidents (works offline)",
                   report.add_arguments, lambda args, argv: report.run(args)),
    "export": Verb("write a checkpoint as a Hugging Face model folder (config.json + safetensors)",
                   export.add_arguments, lambda args, argv: export.run(args)),
    "eval": Verb("score a run, checkpoint or HF model: loss by position, passkey retrieval, lm-eval tasks, "
                 "preference pairs", evaluate.add_arguments,
                 lambda args, argv: evaluate.run(args)),
    "generate": Verb("continue prompts from a JSONL file with a run, checkpoint or HF model", generate.add_arguments,
                     lambda args, argv: generate.run(args)),
    "prepare": Verb("tokenize JSONL/Parquet/text corpora into a prepared dataset, on Ray Data", prepare.add_arguments,
                    lambda args, argv: prepare.main(args, prepare.argv_after("prepare", argv))),
}  # fmt: skip


def _parser() -> argparse.ArgumentParser:
    parser = _ExactFlags(
        prog="ringtrain", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="VERB", title="verbs")
    for name, verb in VERBS.items():
        verb.add_arguments(sub.add_parser(name, help=verb.help))
    jobs.add_arguments(sub)  # submit, status, logs, stop
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        return _dispatch(argv)
    except (RingtrainError, KeyboardInterrupt) as exc:
        return end(exc)
    except Exception as exc:
        said = _s3_cause(exc)
        if said is None:
            raise
        return end(RingtrainError(f"S3: {said}"))


def _dispatch(argv: Optional[Sequence[str]]) -> int:
    dashed = _dashed_override(sys.argv[1:] if argv is None else list(argv))
    if dashed is not None:
        raise dashed
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in VERBS:
        return VERBS[args.command].run(args, argv)
    code = jobs.run(args)
    return EXIT_USAGE if code is None else code


def _s3_cause(exc: BaseException) -> Optional[str]:
    """The one sentence for an S3 failure no check caught first (botocore's own trace runs to 60
    lines); None for anything else."""
    from ringtrain.checkpoint.s3_access import cause

    return cause(exc)


def _dashed_override(argv: list[str]) -> Optional[ConfigError]:
    """The error for an override written as an option (``--train.steps=20``), which argparse
    would answer with the top-level usage; None when there is none."""
    for arg in argv:
        if arg == "--":
            return None
        match = _DASHED_OVERRIDE.match(arg)
        if match:
            fixed = match["key"] + (match["value"] or "=VALUE")
            return ConfigError(arg, f"overrides are written key=value with no dashes: {fixed}")
    return None
