"""The fenced blocks of the README and docs/, and a workspace that stands in for a checkout to run them in.

A block runs when the line before its fence is ``<!-- runnable -->``: a ``bash`` block as one
script, a ``console`` block command by command (each ``$ `` line, its output the lines under it).
``<!-- ci -->`` marks the blocks of ``make run`` and ``make test``, what CI runs: they are not
run again from inside the suite. Any other block of shell commands says why it cannot run here
on its first line (``WHY_NOT``).

The workspace has tiny copies of the job files (the keys a documented command sets still win)
and the scripts beside them,
``.venv/bin/`` commands that run this Python, the checkout's ``docs/`` and ``platform/`` (which
the examples read as a reader's checkout has them: nothing else is prepared for them), and a
``tmp/`` folder that every ``/tmp/`` path of a block and of the job files is moved into.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import yaml

from ringtrain_dev.tiny import TINY_MODEL

REPO = Path(__file__).resolve().parents[1]
PAGES: list[Path] = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

RUNNABLE, CI = "<!-- runnable -->", "<!-- ci -->"
SHELL_LANGUAGES = {"bash", "sh", "shell", "console"}
# The first line of a shell block that does not run here, and why.
WHY_NOT = ("# needs a cluster", "# needs a GPU", "# a benchmark")
# Commands that start a Ray cluster (or a Ray Data pipeline): their blocks run in the Ray tier.
STARTS_A_CLUSTER = re.compile(r"\bringtrain (run|eval|prepare)\b")
PROMPT = "$ "
# The Makefile's targets a block may run, and what each leaves in the venv (checked, not redone).
MAKE_TARGETS = {"trackers": "import mlflow, wandb"}
# What of the checkout the examples read (a corpus for prepare, the docs' pages).
CHECKOUT_FOLDERS = ("docs", "platform")

# Per job file: the keys that make it tiny. The model is ringtrain_dev/tiny.py's; sequences of 64 tokens
# (extend-context keeps 256: its YaRN scaling is over 512), a few steps, and logical CPUs for a
# warm spare beside four workers.
_TINY_MODEL = {key.removeprefix("model."): int(value) for key, value in (item.split("=") for item in TINY_MODEL)}
_TINY_STEPS = {"train": {"steps": 4, "warmup_steps": 1}, "cluster": {"num_cpus": 4}}
TINY_JOBS: dict[str, dict[str, Any]] = {
    "quickstart.yaml": {"model": _TINY_MODEL, "data": {"seq_len": 64}, **_TINY_STEPS},
    "your-own-data.yaml": {"model": _TINY_MODEL, "data": {"seq_len": 64}, **_TINY_STEPS},
    "extend-context.yaml": {"data": {"seq_len": 256}, **_TINY_STEPS},
    "sft-chat.yaml": _TINY_STEPS,
    "dpo-chat.yaml": _TINY_STEPS,
}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    language: str  # the info string's first word
    text: str
    marker: Optional[str]  # RUNNABLE, CI or None: the line before the fence

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"

    @property
    def is_commands(self) -> bool:
        """Shell commands: a shell language, or a transcript of prompts in any block."""
        return self.language in SHELL_LANGUAGES or any(line.startswith(PROMPT) for line in self.text.splitlines())

    @property
    def why_not(self) -> Optional[str]:
        first = self.text.lstrip().splitlines()[0] if self.text.strip() else ""
        return next((why for why in WHY_NOT if first.startswith(why)), None)

    @property
    def starts_a_cluster(self) -> bool:
        return self.language != "console" and bool(STARTS_A_CLUSTER.search(self.text))


def blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    lines = page.read_text(encoding="utf-8").splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        fence = re.match(r"^(```+)\s*(\S*)", lines[i])
        if fence is None:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith(fence.group(1))), len(lines))
        before = next((lines[j].strip() for j in range(i - 1, -1, -1) if lines[j].strip()), "")
        marker = before if before in (RUNNABLE, CI) else None
        found.append(Block(page, i + 1, fence.group(2).lower(), "\n".join(lines[i + 1 : end]) + "\n", marker))
        i = end + 1
    return found


def all_blocks() -> list[Block]:
    return [block for page in PAGES for block in blocks(page)]


def transcript(block: Block) -> list[tuple[str, str]]:
    """A console block's (command, expected output) pairs."""
    pairs: list[tuple[str, list[str]]] = []
    for line in block.text.splitlines():
        if line.startswith(PROMPT):
            pairs.append((line[len(PROMPT) :], []))
        elif pairs:
            pairs[-1][1].append(line)
        elif line.strip():
            raise AssertionError(f"{block.where}: output before the first {PROMPT!r} command: {line!r}")
    return [(command, "\n".join(output).rstrip()) for command, output in pairs]


class Workspace:
    """A folder a page's runnable blocks run in, as if it were a checkout after ``make venv``."""

    def __init__(self, root: Path, ray_tmp: Path) -> None:
        self.root = root
        self.tmp = root / "tmp"
        bin_dir = root / ".venv" / "bin"
        for folder in (self.tmp, bin_dir, root / "home", root / "jobs"):
            folder.mkdir(parents=True, exist_ok=True)
        for name, command in (("ringtrain", f'"{sys.executable}" -m ringtrain'), ("python", f'"{sys.executable}"')):
            shim = bin_dir / name
            shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n')
            shim.chmod(0o755)
        # `make TARGET` in a block: the suite runs in the venv the Makefile's targets made, so
        # what a target leaves behind is checked rather than made again.
        make = bin_dir / "make"
        make.write_text(
            "#!/bin/sh\n"
            'case "$*" in\n'
            + "".join(f'  {target}) exec "{sys.executable}" -c "{check}" ;;\n' for target, check in MAKE_TARGETS.items())
            + '  *) echo "make $*: not a target the docs\' blocks may run" >&2; exit 1 ;;\nesac\n'
        )
        make.chmod(0o755)
        for job in sorted((REPO / "jobs").glob("*.yaml")):
            self._write_job(job)
        for script in sorted((REPO / "jobs").glob("*.py")):  # the jobs' own generators, as they are
            shutil.copy(script, root / "jobs" / script.name)
        for name in CHECKOUT_FOLDERS:  # read, never written, by the examples
            (root / name).symlink_to(REPO / name, target_is_directory=True)
        env = dict(os.environ)
        for name in ("RAY_ADDRESS", "RAY_API_SERVER_ADDRESS", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
            env.pop(name, None)
        env.update(
            HOME=str(root / "home"),
            RAY_TMPDIR=str(ray_tmp),
            RAY_AUTH_MODE="disabled",
            BROWSER="true",  # `report --open` hands the page to a browser that does nothing
            TORCH_EXTENSIONS_DIR=str(REPO / ".ringtrain-cache" / "torch_extensions"),
            PATH=os.pathsep.join([str(bin_dir), env.get("PATH", "")]),
            PYTHONPATH=os.pathsep.join([str(REPO / "platform"), env.get("PYTHONPATH", "")]),
        )
        self.env = env

    def local(self, text: str) -> str:
        """``text`` with its /tmp/ paths moved into this workspace."""
        return re.sub(r"(?<![\w./])/tmp/", f"{self.tmp}/", text)

    def _write_job(self, source: Path) -> None:
        job = yaml.safe_load(source.read_text())
        _merge(job, TINY_JOBS.get(source.name, {}))
        (self.root / "jobs" / source.name).write_text(self.local(yaml.safe_dump(job, sort_keys=False)))

    def run(self, command: str, timeout: float) -> subprocess.CompletedProcess[str]:
        """``command`` run by bash in the workspace; a failing command stops it (``-e``, pipefail)."""
        return subprocess.run(
            ["bash", "-eo", "pipefail", "-c", self.local(command)],
            cwd=self.root,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )


def _merge(into: dict[str, Any], keys: dict[str, Any]) -> None:
    for key, value in keys.items():
        if isinstance(value, dict):
            _merge(into.setdefault(key, {}), value)
        else:
            into[key] = value
