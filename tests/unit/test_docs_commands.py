"""The README and docs/ as a newcomer meets them: short, linked, and every command shown either
run here or marked with why it cannot be (tests/docs_blocks.py has the rules).

Run here: every ``console`` transcript, each command's output compared with the page, and every
runnable ``bash`` block that starts no cluster, each in a fresh workspace. The blocks that start
one (``ringtrain run``, ``eval``, ``prepare``) run in tests/ray/test_docs_examples.py.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.docs_blocks import CI, MAKE_TARGETS, PAGES, REPO, RUNNABLE, WHY_NOT, Block, Workspace, all_blocks, transcript
from tests.tools import tool

README = REPO / "README.md"
MAX_README_LINES = 250
BLOCK_TIMEOUT_S = 120.0

COMMAND_BLOCKS = [b for b in all_blocks() if b.is_commands]
TRANSCRIPTS = [b for b in COMMAND_BLOCKS if b.marker == RUNNABLE and b.language == "console"]
QUICK_SCRIPTS = [b for b in COMMAND_BLOCKS if b.marker == RUNNABLE and b.language != "console" and not b.starts_a_cluster]
_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


def test_the_readme_is_short() -> None:
    assert len(README.read_text().splitlines()) <= MAX_README_LINES


def test_the_readme_links_every_docs_page() -> None:
    linked = {target.partition("#")[0] for target in _LINK.findall(README.read_text())}
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in linked]
    assert not unlinked, f"docs pages the README's map does not link: {unlinked}"


def _anchors(page: Path) -> set[str]:
    """GitHub's ids of ``page``'s headings: lower case, punctuation but - and _ dropped, spaces to -."""
    found = set()
    for heading in re.findall(r"^#+ (.+)$", page.read_text(), flags=re.MULTILINE):
        found.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_between_pages_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists() or (anchor and file.suffix == ".md" and anchor not in _anchors(file)):
            broken.append(target)
    assert not broken, f"{page.relative_to(REPO)}: broken links {broken}"


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=_ids(COMMAND_BLOCKS))
def test_every_command_block_runs_or_says_why_not(block: Block) -> None:
    assert block.marker in (RUNNABLE, CI) or block.why_not, (
        f"{block.where}: a block of commands runs (`{RUNNABLE}` on the line before it) or says why it "
        f"cannot on its first line: one of {list(WHY_NOT)}"
    )


@pytest.mark.parametrize("block", COMMAND_BLOCKS, ids=_ids(COMMAND_BLOCKS))
def test_only_what_ci_runs_is_left_to_ci(block: Block) -> None:
    commands = [line.split("#")[0].strip() for line in block.text.splitlines() if line.split("#")[0].strip()]
    make_targets = [c for c in commands if re.match(r"^make (run|test)(\s|$)", c)]
    if block.marker == CI:
        assert commands and len(make_targets) == len(commands), f"{block.where}: {CI} marks only `make run` / `make test`"
    else:
        assert not make_targets, f"{block.where}: `make run` / `make test` are CI's: mark the block {CI}"


def test_the_make_targets_a_block_runs_install_what_the_workspace_checks() -> None:
    """The docs' workspace answers `make trackers` by checking the venv for what the target
    installs (tests/docs_blocks.py): the Makefile's own target must install exactly that."""
    import subprocess

    dry = subprocess.run([tool("make"), "-n", "trackers"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    assert re.search(r"pip install .*-e \"\.\[mlflow,wandb\]\"", dry.stdout), dry.stdout
    assert MAKE_TARGETS == {"trackers": "import mlflow, wandb"}


@pytest.mark.parametrize("block", [b for b in COMMAND_BLOCKS if b.why_not == "# a benchmark"])
def test_a_benchmark_block_holds_only_benchmarks(block: Block) -> None:
    commands = [line for line in block.text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    assert commands and all(re.search(r"\bbench/\w+\.py\b", c) for c in commands), block.where


@pytest.mark.parametrize("block", TRANSCRIPTS, ids=_ids(TRANSCRIPTS))
def test_a_transcript_is_what_its_commands_print(block: Block, tmp_path: Path) -> None:
    assert not block.starts_a_cluster
    workspace = Workspace(tmp_path / "ws", tmp_path / "ray")
    for command, expected in transcript(block):
        done = workspace.run(command, timeout=BLOCK_TIMEOUT_S)
        printed = "\n".join(line.rstrip() for line in (done.stdout + done.stderr).splitlines()).rstrip()
        assert printed == expected, f"{block.where}: `{command}` prints something else now:\n{printed}"


@pytest.mark.parametrize("block", QUICK_SCRIPTS, ids=_ids(QUICK_SCRIPTS))
def test_a_runnable_block_runs(block: Block, tmp_path: Path) -> None:
    workspace = Workspace(tmp_path / "ws", tmp_path / "ray")
    done = workspace.run(block.text, timeout=BLOCK_TIMEOUT_S)
    assert done.returncode == 0, f"{block.where} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
