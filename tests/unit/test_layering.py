"""The layer rules, checked on the source with `ast` (nothing is imported).

``LAYERS`` below is the one table of layers; docs/architecture.md mirrors it (a test checks).
Every module must have a layer, and imports only go downward. Every import counts: module
level, inside functions (lazy imports), under ``if TYPE_CHECKING``.

Around the product: the development package (platform/ringtrain_dev/) is what tests/ and bench/
share; the product imports none of them, the benches import neither the tests nor each other, the
tests import no bench but the one they test (tests/bench/), and nothing edits ``sys.path``.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

REPO = Path(__file__).resolve().parents[2]
PLATFORM = REPO / "platform"
PACKAGE = PLATFORM / "ringtrain"
DOC = REPO / "docs" / "architecture.md"

# Module or package -> layer; a package places every module under it, and the longest entry
# that matches wins (so a package can keep, say, a pure core at L1 and put one module at L3).
# A new package or top-level module gets a line here and in docs/architecture.md.
LAYERS: dict[str, int] = {
    "ringtrain.config": 0,
    "ringtrain.errors": 0,
    "ringtrain.topology": 0,
    "ringtrain.status": 0,
    "ringtrain.metrics": 0,
    "ringtrain.chaos": 0,
    "ringtrain.incidents": 0,
    "ringtrain.uris": 0,
    "ringtrain.cachedir": 0,  # the per-user data cache folder
    "ringtrain.jsonfile": 0,  # the one parser of JSON from elsewhere, with bounds (files, manifests, headers)
    "ringtrain.folderswap": 0,  # a finished output folder put in place, what was there judged last
    "ringtrain.links": 0,  # links in a folder from elsewhere, which must stay inside it
    "ringtrain.inputs": 0,  # the local inputs a job's config names
    "ringtrain.prepared": 0,  # the prepared dataset format: plain data shared by writer and reader
    "ringtrain.policies": 1,
    "ringtrain.planner": 1,
    "ringtrain.evaluation": 1,  # pure scoring: position buckets, tallies, passkey prompts
    "ringtrain.evaluation.tokenizer": 2,  # loads a Hugging Face tokenizer.json
    "ringtrain.train": 2,
    "ringtrain.checkpoint": 2,  # below train, which uses its retention rule
    "ringtrain.hf": 2,  # Hugging Face config mapping and safetensors I/O
    "ringtrain.actors": 3,
    "ringtrain.telemetry": 3,
    "ringtrain.prepare": 3,  # `ringtrain prepare` on Ray Data
    "ringtrain.cli": 4,  # builds the parser and dispatches to a verb
    "ringtrain.commands": 4,  # one module per verb of the command line
    "ringtrain.submission": 4,
    "ringtrain.submission_files": 4,
    "ringtrain.submission_secrets": 4,  # a submitted job's secrets: through the cluster's store, not its record
    "ringtrain.__main__": 4,
}
# The package itself holds only its version: L0, and it places nothing beneath it (or every
# module would have a layer by default).
ROOT = "ringtrain"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PLATFORM).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_package(module: str) -> bool:
    return MODULES.get(module, Path()).name == "__init__.py"


def imports_of(module: str, source: str) -> set[str]:
    """Absolute names of every module ``module``'s source imports, wherever the statement is."""
    found: set[str] = set()
    package = module if _is_package(module) else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = package.split(".")
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            found.add(base)
            # `from ringtrain import config` imports the module ringtrain.config
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def _imports(module: str) -> set[str]:
    return imports_of(module, MODULES[module].read_text())


def _top(name: str) -> str:
    return name.partition(".")[0]


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(name: str) -> Optional[int]:
    """The layer of module ``name`` from ``LAYERS`` (the longest matching entry); None if unplaced."""
    if name == ROOT:
        return 0
    matches = [prefix for prefix in LAYERS if _within(name, prefix)]
    return LAYERS[max(matches, key=len)] if matches else None


def _is_l0(name: str) -> bool:
    return layer_of(name) == 0


def _in_layer(prefix: str) -> list[str]:
    return [m for m in MODULES if _within(m, prefix)]


def _at_layer(layer: int) -> list[str]:
    return [m for m in MODULES if layer_of(m) == layer]


def _package(name: str) -> str:
    """``ringtrain.X`` of ``ringtrain.X.Y...``: what a module may import freely at its own layer."""
    return ".".join(name.split(".")[:2])


def test_the_package_was_found() -> None:
    assert "ringtrain.config" in MODULES and "ringtrain.cli" in MODULES and "ringtrain.train.data" in MODULES


def test_the_import_collector_sees_lazy_relative_and_from_imports() -> None:
    source = (
        "import os.path\n"
        "from ringtrain import config\n"
        "from . import data\n"
        "from .attention.ring import x\n"
        "from .. import errors\n"
        "def f():\n"
        "    import ray\n"
        "    from ringtrain.actors.group import WorkerGroup\n"
        "class C:\n"
        "    def g(self):\n"
        "        if True:\n"
        "            import deepspeed.comm\n"
    )
    found = imports_of("ringtrain.train.trainer", source)
    assert {
        "os.path",
        "ringtrain.config",
        "ringtrain.train.data",
        "ringtrain.train.attention.ring",
        "ringtrain.errors",
        "ray",
        "ringtrain.actors.group",
        "deepspeed.comm",
    } <= found
    # the real run command imports the Ray layer only inside its functions: it must be seen
    assert any(_within(name, "ringtrain.actors") for name in _imports("ringtrain.commands.run"))


def test_platform_is_not_a_package() -> None:
    assert not (PLATFORM / "__init__.py").exists()


def test_every_module_has_a_layer() -> None:
    unplaced = sorted(m for m in MODULES if layer_of(m) is None)
    assert not unplaced, (
        f"{', '.join(unplaced)} has no layer: place it (or its package) in LAYERS in "
        f"tests/unit/test_layering.py and in the table of docs/architecture.md"
    )


def test_the_longest_entry_places_a_module() -> None:
    assert layer_of("ringtrain.train.attention.ring") == 2 and layer_of("ringtrain.hf.safetensors_io") == 2
    assert layer_of("ringtrain") == 0 and layer_of("ringtrain.newthing") is None
    assert layer_of("ringtrain.commands.jobs") == 4 and layer_of("ringtrain.submissions") is None


@pytest.mark.parametrize("module", sorted(m for m in MODULES if layer_of(m) is not None))
def test_imports_only_go_downward(module: str) -> None:
    """Among others: the policies never import train, the actors and telemetry never the cli."""
    mine = layer_of(module)
    assert mine is not None
    bad = {
        f"{name} (L{theirs})"
        for name in _imports(module)
        if _top(name) == ROOT and ((theirs := layer_of(name)) is None or theirs > mine)
    }
    assert not bad, f"{module} (L{mine}) imports {sorted(bad)}"


def test_the_command_line_lives_in_commands() -> None:
    """A verb registered in cli.py is ``commands/<verb>.py``, and no command module hides elsewhere."""
    from ringtrain.cli import VERBS

    verbs = list(VERBS)
    assert verbs and all(f"{ROOT}.commands.{verb}" in MODULES for verb in verbs), verbs
    stray = sorted(
        m for m in MODULES if re.search(r"(^|_)command$", m.rpartition(".")[2]) and not _within(m, f"{ROOT}.commands")
    )
    assert not stray, f"{stray}: the command line's modules live in platform/ringtrain/commands/"


@pytest.mark.parametrize("module", _in_layer("ringtrain.commands"))
def test_no_command_imports_the_cli(module: str) -> None:
    """cli imports every command: one importing it back would be a cycle."""
    assert not any(_within(name, "ringtrain.cli") for name in _imports(module))


def test_the_docs_layer_table_mirrors_this_one() -> None:
    """docs/architecture.md's rows read ``| L<n> | `module`, `package/`, `package/module.py` ... |``."""
    documented: dict[str, int] = {}
    for match in re.finditer(r"^\| L(\d) \| ([^|]*)\|", DOC.read_text(), flags=re.MULTILINE):
        for name in re.findall(r"`([^`]+)`", match.group(2)):
            module = name.removesuffix("/").removesuffix(".py").replace("/", ".")
            documented[f"{ROOT}.{module}"] = int(match.group(1))
    assert documented == LAYERS, "docs/architecture.md's layer table and LAYERS here must list the same placements"


L0_MODULES = sorted(_at_layer(0))


def test_the_l0_modules_exist() -> None:
    assert {"ringtrain.config", "ringtrain.errors", "ringtrain.topology", "ringtrain.status"} <= set(L0_MODULES)


# omegaconf, and PyYAML, which omegaconf itself parses with (config/loading.py reads YAML through it
# to check a job file's shape before OmegaConf sees it).
L0_THIRD_PARTY = {"omegaconf", "yaml"}


@pytest.mark.parametrize("module", L0_MODULES)
def test_l0_imports_only_stdlib_omegaconf_and_l0(module: str) -> None:
    bad = {
        name
        for name in _imports(module)
        if not (_top(name) in sys.stdlib_module_names or _top(name) in L0_THIRD_PARTY or _is_l0(name))
    }
    assert not bad, f"{module} (L0) imports {sorted(bad)}"


@pytest.mark.parametrize("module", _at_layer(1))
def test_l1_imports_only_stdlib_l0_and_its_own_package(module: str) -> None:
    """Pure decisions (policies) and plans for clusters not yet had (planner) import no
    framework, and L1 packages do not lean on each other."""
    bad = {
        name
        for name in _imports(module)
        if not (_top(name) in sys.stdlib_module_names or _is_l0(name) or _package(name) == _package(module))
    }
    assert not bad, f"{module} (L1) imports {sorted(bad)}"


@pytest.mark.parametrize("module", _at_layer(2))
def test_l2_never_imports_ray(module: str) -> None:
    bad = {name for name in _imports(module) if _top(name) == "ray"}
    assert not bad, f"{module} (L2) imports {sorted(bad)}"


@pytest.mark.parametrize("module", _in_layer("ringtrain.train"))
def test_train_never_imports_the_policies(module: str) -> None:
    """They meet through status reports and Decisions, joined by the actors."""
    bad = {name for name in _imports(module) if _within(name, "ringtrain.policies")}
    assert not bad, f"{module} imports {sorted(bad)}"


# The checkpoint store moves bytes: L2 because train uses its retention rule, with boto3 its one
# dependency; it knows nothing of training or Ray, so a driver, a worker or a tool can use it.
CHECKPOINT_MAY_NOT_IMPORT = ("torch", "ray", "deepspeed", "ringtrain.train", "ringtrain.actors", "ringtrain.cli")


@pytest.mark.parametrize("module", _in_layer("ringtrain.checkpoint"))
def test_the_checkpoint_store_imports_no_training_code(module: str) -> None:
    bad = {name for name in _imports(module) for banned in CHECKPOINT_MAY_NOT_IMPORT if _within(name, banned)}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_light_modules_import_no_torch_ray_or_deepspeed(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "import ringtrain.config, ringtrain.errors, ringtrain.topology, ringtrain.status, ringtrain.cli\n"
        "import ringtrain.policies.snapshots, ringtrain.metrics, ringtrain.checkpoint\n"
        "heavy = sorted(m for m in sys.modules if m.partition('.')[0] in ('torch', 'ray', 'deepspeed'))\n"
        "print(json.dumps(heavy))\n"
    )
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLATFORM), env.get("PYTHONPATH")) if p)
    env["HOME"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def _import_graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (type-only imports included: a cycle of
    types is a cycle of understanding). A package's own ``__init__`` is left out as a target:
    ``from package import module`` names the module, not the package."""
    return {m: {n for n in _imports(m) if n in MODULES and n != m and not _is_package(n)} for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected set of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            members = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                members.append(top)
                if top == node:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_itself_back() -> None:
    """No import cycles, not even one closed by an import inside a function: a module's
    collaborators take what they use from a floor below both rather than reaching back into it
    (actors/group.py's helpers did, through type-only imports; the tracker modules took their
    points from trackers.py, which loads them, and the Parquet chat reader its bounds from
    sources.py, which calls it)."""
    assert _cycles(_import_graph()) == []


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# ---- the product, the development package, the tests and the benches ---------------------------

# The development package the tests and benches share (platform/ringtrain_dev/): no layer, and no
# part of the product.
DEV = "ringtrain_dev"
BENCH = REPO / "bench"
TESTS = REPO / "tests"
BENCH_FILES = sorted(BENCH.glob("*.py"))
DEV_FILES = sorted((PLATFORM / DEV).rglob("*.py"))
# The benches' own tests: a bench is what they test, so they import it (``from bench import x``).
BENCH_TESTS = TESTS / "bench"
# The one place allowed to change where imports come from: none does today (pytest's rootdir
# conftest puts the repository root on the path, and platform/ comes from the install or
# PYTHONPATH), and a new one goes here and nowhere else.
SYS_PATH_EDITORS = {TESTS / "conftest.py"}
SYS_PATH_EDIT = re.compile(r"\bsys\.path\s*(\.\s*(insert|append|extend|remove|pop|clear)\b|(\[[^\]]*\])?\s*\+?=[^=])")


def top_level_imports(source: str) -> set[str]:
    """The top-level names of every absolute import in ``source``, wherever the statement is
    (relative imports stay inside their own package)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module.partition(".")[0])
    return found


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO))


@pytest.mark.parametrize("module", sorted(MODULES))
def test_the_product_imports_no_development_code(module: str) -> None:
    bad = {name for name in _imports(module) if _top(name) in (DEV, "tests", "bench")}
    assert not bad, f"{module} imports {sorted(bad)}: the product never leans on what only tests and benches have"


@pytest.mark.parametrize("path", BENCH_FILES, ids=_shown)
def test_a_bench_imports_neither_the_tests_nor_another_bench(path: Path) -> None:
    """What two benches, or a bench and a test, share lives in the development package."""
    siblings = {p.stem for p in BENCH_FILES}
    bad = top_level_imports(path.read_text()) & ({"tests", "bench"} | siblings)
    assert not bad, f"{_shown(path)} imports {sorted(bad)}: share it through platform/{DEV}/"


@pytest.mark.parametrize("path", DEV_FILES, ids=_shown)
def test_the_development_package_imports_neither_the_tests_nor_the_benches(path: Path) -> None:
    bad = top_level_imports(path.read_text()) & {"tests", "bench"}
    assert not bad, f"{_shown(path)} imports {sorted(bad)}"


def test_only_the_benches_tests_import_a_bench() -> None:
    importing = sorted(
        _shown(path) for path in TESTS.rglob("*.py")
        if not path.is_relative_to(BENCH_TESTS) and "bench" in top_level_imports(path.read_text())
    )  # fmt: skip
    assert not importing, f"{importing} import bench/: share it through platform/{DEV}/"


def test_the_development_package_is_found_and_kept_out_of_the_wheel() -> None:
    """Beside ringtrain in platform/, so the editable install and PYTHONPATH=platform bring it;
    the packages the wheel is built from (pyproject.toml, as setuptools reads it) leave it out."""
    import setuptools
    from setuptools.config.pyprojecttoml import read_configuration

    assert (PLATFORM / DEV / "__init__.py").is_file() and DEV_FILES
    find = read_configuration(REPO / "pyproject.toml", expand=False)["tool"]["setuptools"]["packages"]["find"]
    packages = setuptools.find_packages(where=str(REPO / find["where"][0]), include=find["include"])
    assert "ringtrain.train.attention" in packages
    assert not [p for p in packages if _top(p) != ROOT], packages


def _python_files() -> list[Path]:
    tracked = subprocess.run(["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "*.py"],
                             capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout.strip():
        return [REPO / line for line in tracked.stdout.splitlines() if (REPO / line).is_file()]
    return sorted(p for folder in ("platform", "tests", "bench", "jobs", "infra") for p in (REPO / folder).rglob("*.py"))


def test_nothing_edits_sys_path() -> None:
    """A module found through an edited ``sys.path`` is found only where that edit ran first:
    the installed ringtrain (and its development package beside it) is on the path everywhere."""
    edits = sorted(
        f"{_shown(path)}:{number}"
        for path in _python_files() if path not in SYS_PATH_EDITORS
        for number, line in enumerate(path.read_text().splitlines(), start=1) if SYS_PATH_EDIT.search(line)
    )  # fmt: skip
    assert not edits, f"sys.path edited at {edits}: import from the installed packages instead"


def test_a_sys_path_edit_is_seen() -> None:
    # Written with "SYS" for "sys", so this file holds no edit of its own.
    edits = ('SYS.path.insert(0, "x")', "SYS.path[:0] = [ROOT]", "SYS.path.append(p)", "SYS.path = []", "SYS.path += [p]")
    reads = ("for p in SYS.path:", "if SYS.path == other:", "x = SYS.path[0]", "SYS.path_hooks")
    assert all(SYS_PATH_EDIT.search(line.replace("SYS", "sys")) for line in edits)
    assert not any(SYS_PATH_EDIT.search(line.replace("SYS", "sys")) for line in reads)
