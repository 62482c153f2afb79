"""The layer rules of ARCHITECTURE.md, checked on the source with `ast` (nothing is imported).

Every import counts: module level, inside functions (lazy imports), under ``if TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PLATFORM = Path(__file__).resolve().parents[2] / "platform"
PACKAGE = PLATFORM / "ringtrain"
L0 = {
    "ringtrain.config",
    "ringtrain.errors",
    "ringtrain.topology",
    "ringtrain.status",
    "ringtrain.metrics",
    "ringtrain.chaos",
}


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


def _is_l0(name: str) -> bool:
    return any(_within(name, m) for m in L0)


def _in_layer(prefix: str) -> list[str]:
    return [m for m in MODULES if _within(m, prefix)]


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
    # the real cli imports the Ray layer only inside cmd_run: it must be seen
    assert any(_within(name, "ringtrain.actors") for name in _imports("ringtrain.cli"))


def test_platform_is_not_a_package() -> None:
    assert not (PLATFORM / "__init__.py").exists()


L0_MODULES = sorted(m for m in MODULES if _is_l0(m))


def test_the_l0_modules_exist() -> None:
    assert {"ringtrain.config", "ringtrain.errors", "ringtrain.topology", "ringtrain.status"} <= set(L0_MODULES)


# omegaconf, and PyYAML, which omegaconf itself parses with (config.py reads YAML through it
# to check a job file's shape before OmegaConf sees it).
L0_THIRD_PARTY = {"omegaconf", "yaml"}


@pytest.mark.parametrize("module", L0_MODULES)
def test_l0_imports_only_stdlib_omegaconf_and_l0(module: str) -> None:
    bad = {
        name
        for name in _imports(module)
        if not (
            _top(name) in sys.stdlib_module_names or _top(name) in L0_THIRD_PARTY or _is_l0(name) or name == "ringtrain"
        )
    }
    assert not bad, f"{module} (L0) imports {sorted(bad)}"


@pytest.mark.parametrize("module", _in_layer("ringtrain.controllers"))
def test_controllers_import_only_l0_and_stdlib(module: str) -> None:
    bad = {
        name
        for name in _imports(module)
        if not (
            _top(name) in sys.stdlib_module_names
            or _is_l0(name)
            or _within(name, "ringtrain.controllers")
            or name == "ringtrain"
        )
    }
    assert not bad, f"{module} (L1) imports {sorted(bad)}"


TRAIN_MAY_NOT_IMPORT = ("ray", "ringtrain.actors", "ringtrain.telemetry", "ringtrain.controllers", "ringtrain.cli")


@pytest.mark.parametrize("module", _in_layer("ringtrain.train"))
def test_train_never_imports_ray_or_higher_layers(module: str) -> None:
    bad = {name for name in _imports(module) for banned in TRAIN_MAY_NOT_IMPORT if _within(name, banned)}
    assert not bad, f"{module} (L2) imports {sorted(bad)}"


@pytest.mark.parametrize("module", _in_layer("ringtrain.planner"))
def test_the_planner_is_pure(module: str) -> None:
    """L1 like the controllers: it plans clusters it does not have, so it imports no framework."""
    bad = {
        name
        for name in _imports(module)
        if not (_top(name) in sys.stdlib_module_names or _is_l0(name) or _within(name, "ringtrain.planner") or name == "ringtrain")
    }
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", _in_layer("ringtrain.controllers"))
def test_controllers_never_import_train(module: str) -> None:
    bad = {name for name in _imports(module) if _within(name, "ringtrain.train")}
    assert not bad, f"{module} imports {sorted(bad)}"


@pytest.mark.parametrize("module", _in_layer("ringtrain.actors") + _in_layer("ringtrain.telemetry"))
def test_l3_never_imports_the_cli(module: str) -> None:
    bad = {name for name in _imports(module) if _within(name, "ringtrain.cli")}
    assert not bad, f"{module} (L3) imports {sorted(bad)}"


# The checkpoint store moves bytes: it sits beside the actors (boto3 is an L3 dependency) but
# knows nothing of training or Ray, so it can be used from a driver, a worker or a tool.
CHECKPOINT_MAY_NOT_IMPORT = ("torch", "ray", "deepspeed", "ringtrain.train", "ringtrain.actors", "ringtrain.cli")


@pytest.mark.parametrize("module", _in_layer("ringtrain.checkpoint"))
def test_the_checkpoint_store_imports_no_training_code(module: str) -> None:
    bad = {name for name in _imports(module) for banned in CHECKPOINT_MAY_NOT_IMPORT if _within(name, banned)}
    assert not bad, f"{module} imports {sorted(bad)}"


def test_light_modules_import_no_torch_ray_or_deepspeed(tmp_path: Path) -> None:
    code = (
        "import json, sys\n"
        "import ringtrain.config, ringtrain.errors, ringtrain.topology, ringtrain.status, ringtrain.cli\n"
        "import ringtrain.controllers.snapshots, ringtrain.metrics, ringtrain.checkpoint\n"
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
