"""The command line of a bench: the flags of one that runs on one device, how bad input ends it
(exit 2, one line naming the flag), a bench that needs a GPU on a machine without one, and the
device's name in the file a bench writes.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Optional

EXIT_BAD_INPUT = 2  # also: no CUDA where the bench needs it


def one_device_parser(doc: Optional[str]) -> argparse.ArgumentParser:
    """A parser described by the first line of ``doc`` (the bench's docstring), with the flags of
    a bench that runs on one device: ``--device`` (cuda, or cpu for a smoke run) and ``--tiny``."""
    p = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu needs --tiny")
    p.add_argument("--tiny", action="store_true", help="tiny shapes of both families: a smoke run")
    return p


def bad_input(script: str, message: str) -> int:
    """Say what is wrong with the command line of ``bench/<script>.py``; the exit code it ends with."""
    print(f"bench/{script}.py: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def listed(text: str, known: Sequence[str], flag: str, script: str) -> list[str]:
    """The comma-separated names of ``flag``, each one of ``known``; else exit 2 naming the rest."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        raise SystemExit(bad_input(script, f"{flag}: {', '.join(unknown) or 'nothing'} is not among {', '.join(known)}"))
    return names


def without_cuda(script: str, where: str = "") -> Optional[int]:
    """Where torch sees no CUDA GPU: say so (and how to run ``bench/<script>.py`` instead; ``where``
    names another way to a GPU machine) and return the exit code; None where it sees one."""
    import torch

    if torch.cuda.is_available():
        return None
    print(
        f"bench/{script}.py needs a CUDA GPU: this torch ({torch.__version__}, CUDA build "
        f"{torch.version.cuda or 'none'}) sees none. Run it{where} on a GPU machine, "
        "or pass --device cpu --tiny for a smoke run.",
        file=sys.stderr,
    )
    return EXIT_BAD_INPUT


def slug(name: str) -> str:
    """A device's name as a file name's part: ``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower()
