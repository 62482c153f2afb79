"""Which context parallelism runs is decided in one place: checked on the source with ``ast``.

A job's CP layout (``topology.CPLayout``: ring degree, Ulysses degree, K/V exchange, what a group
of one rank runs) is built by one function, ``topology.cp_layout``, the only reader of
``attention.impl``, through ``JobConfig.cp_layout``; the planner makes the value of the degrees it
proposes. Attention, the trainer, the planner's layout, evaluation and the config checks read the
value and never decide a layout themselves: no comparison of an implementation's name, and no
comparison of a group's size or a CP degree with one rank. The multiple a sequence length takes
under a layout (``CPLayout.sequence_multiple``) is computed there alone too: no ``2 * cp`` elsewhere.
"""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest
import torch

from ringtrain import config
from ringtrain.errors import ConfigError
from ringtrain.planner.layout import layout_of
from ringtrain.topology import ATTENTION_IMPLS, HYBRID, LOCAL, RING, ULYSSES, CPLayout, cp_layout, sequence_positions

PACKAGE = Path(__file__).resolve().parents[2] / "platform" / "ringtrain"

# Where each is made: (file under platform/ringtrain, function). The value is built by the one
# function that reads a job's names, and made of its degrees by a planner candidate (which has no
# job yet); ``cp_layout`` is called by the job's property alone, which alone reads attention.impl.
BUILT_IN = {
    "CPLayout": {("topology.py", "cp_layout"), ("planner/layout.py", "Layout.cp_layout")},
    "cp_layout": {("config/schema.py", "JobConfig.cp_layout")},
}
READS_IMPL_NAME = {("config/schema.py", "JobConfig.cp_layout")}

# The readers of the layout, which must not decide one themselves.
READERS = ("train/attention/", "train/trainer.py", "train/evaluator.py", "planner/layout.py", "config/checks.py",
           "config/schema.py", "commands/eval.py", "commands/run.py")
# The names of what a layout runs, as constants and as values.
LAYOUT_NAMES = {RING, ULYSSES, HYBRID, LOCAL}
LAYOUT_CONSTANTS = {"RING", "ULYSSES", "HYBRID", "LOCAL", "LOCAL_ATTENTION_IMPL", "ATTENTION_IMPLS", "IMPLS"}
# What holds a layout's name: attention.impl, CPLayout.runs and .impl, and variables named so.
NAME_HOLDERS = {"impl", "runs"}
# What holds a group's size or a CP degree.
SIZE_HOLDERS = {"cp", "ring", "ulysses", "uly", "ring_degree", "ulysses_degree"}


class _Scoped(ast.NodeVisitor):
    """Every node of a module with the qualified name of the function (or class) it sits in."""

    def __init__(self) -> None:
        self.scope: list[str] = []
        self.found: list[tuple[str, ast.AST]] = []

    def _enter(self, node: ast.AST, name: str) -> None:
        self.scope.append(name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._enter(node, node.name)

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._enter(node, node.name)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self._enter(node, node.name)

    def generic_visit(self, node: ast.AST) -> None:
        self.found.append((".".join(self.scope), node))
        super().generic_visit(node)


def _nodes(source: str) -> list[tuple[str, ast.AST]]:
    visitor = _Scoped()
    visitor.visit(ast.parse(source))
    return visitor.found


@functools.lru_cache(maxsize=1)
def _package() -> dict[str, list[tuple[str, ast.AST]]]:
    """Every module of the package (its path under platform/ringtrain): its nodes, each with its scope."""
    return {p.relative_to(PACKAGE).as_posix(): _nodes(p.read_text()) for p in sorted(PACKAGE.rglob("*.py"))}


def _called(node: ast.AST) -> str:
    """The name a call calls (``f(...)`` or ``x.f(...)``), else ""."""
    if not isinstance(node, ast.Call):
        return ""
    func = node.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""


def _named(node: ast.AST) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else ""


def _mentions(node: ast.AST, names: set[str]) -> bool:
    return any(_named(n) in names for n in ast.walk(node))


def _compares_a_name(node: ast.Compare) -> bool:
    """A layout's name compared: a name constant, or a layout name against what holds one."""
    operands = [node.left, *node.comparators]
    if any(_mentions(o, LAYOUT_CONSTANTS) for o in operands):
        return True
    names = [o for o in operands if isinstance(o, ast.Constant) and o.value in LAYOUT_NAMES]
    holders = [o for o in operands if _mentions(o, NAME_HOLDERS)]
    # "ring" and "local" are also exchange names: a bare constant counts against a name's holder.
    return bool(holders) or any(n.value in (ULYSSES, HYBRID) for n in names)


# Comparisons that tell one rank from more (``x == 1``, ``x > 1``, ``1 < x``), by the side the 1 is on;
# ``x >= 1`` and ``x < 1`` tell a valid size from an invalid one instead.
ONE_RANK_OPS = {"right": (ast.Eq, ast.NotEq, ast.Gt, ast.LtE), "left": (ast.Eq, ast.NotEq, ast.Lt, ast.GtE)}


def _is_size(node: ast.AST) -> bool:
    return _called(node) in ("group_size", "size") or _named(node) in SIZE_HOLDERS


def _is_one(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == 1


def _compares_a_size_with_one_rank(node: ast.Compare) -> bool:
    """A group's size (``group_size(g)``, ``g.size()``) or a CP degree told apart from one rank."""
    operands = [node.left, *node.comparators]
    for left, op, right in zip(operands, node.ops, operands[1:]):
        if _is_size(left) and _is_one(right) and isinstance(op, ONE_RANK_OPS["right"]):
            return True
        if _is_one(left) and _is_size(right) and isinstance(op, ONE_RANK_OPS["left"]):
            return True
    return False


def _decisions(path: str, nodes: list[tuple[str, ast.AST]]) -> list[str]:
    found = []
    for scope, node in nodes:
        if isinstance(node, ast.Compare) and (_compares_a_name(node) or _compares_a_size_with_one_rank(node)):
            found.append(f"{path}:{node.lineno} ({scope or 'module'}): {ast.unparse(node)}")
    return found


def test_the_cp_layout_is_built_in_one_function() -> None:
    made: dict[str, set[tuple[str, str]]] = {name: set() for name in BUILT_IN}
    for path, nodes in _package().items():
        for scope, node in nodes:
            if _called(node) in made:
                made[_called(node)].add((path, scope))
    assert made == BUILT_IN


def test_only_the_layout_reads_attention_impl() -> None:
    readers = set()
    for path, nodes in _package().items():
        for scope, node in nodes:
            if isinstance(node, ast.Attribute) and node.attr == "impl" and _named(node.value) == "attention":
                readers.add((path, scope))
    assert readers == READS_IMPL_NAME


def test_no_reader_of_the_layout_decides_one() -> None:
    """Attention, the trainer, the planner's layout, evaluation and the checks compare no
    implementation name and no group size with one rank: the layout says what runs."""
    readers = {path: nodes for path, nodes in _package().items() if path.startswith(READERS)}
    assert {path for path in readers if path.startswith(READERS[0])}, "the attention package moved"
    found = [line for path, nodes in readers.items() for line in _decisions(path, nodes)]
    assert not found, "a layout decided outside topology.py:\n" + "\n".join(found)


@pytest.mark.parametrize("decision", [
    'impl = job.attention.impl if mesh.topology.cp > 1 else "local"',
    "if group_size(ulysses_group) == 1:\n    pass",
    'if impl == "ring" and uly != 1:\n    pass',
    'return "ulysses" if self.ring == 1 else "hybrid"',
    "if layout.runs == RING:\n    pass",
    "if ring.size() > 1:\n    pass",
])
def test_the_scan_sees_a_decision(decision: str) -> None:
    """Each of the decisions the layout replaced, written again, is found."""
    assert _decisions("train/trainer.py", _nodes(decision))


@pytest.mark.parametrize("check", [
    'if self.exchange == "local" and name != "ring":\n    pass',  # exchange names, not layouts
    "local_seq = seq_len // cp if cp >= 1 else seq_len",  # a valid size, not one rank
    "if groups != (layout.ring, layout.ulysses):\n    pass",  # groups checked against the layout
])
def test_the_scan_passes_what_decides_no_layout(check: str) -> None:
    assert not _decisions("train/attention/call.py", _nodes(check))


def _sequence_multiples(nodes: list[tuple[str, ast.AST]]) -> list[str]:
    """``2 * cp`` written again (``2 * job.mesh.cp``, ``cp * 2``, ``2 * layout.cp * 64``): the
    multiple a CP layout's sequence lengths take, which ``CPLayout.sequence_multiple`` (and, for a
    bare degree, ``CPLayout.sequence_multiple_of``) alone computes."""
    found = []
    for scope, node in nodes:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult):
            sides = (node.left, node.right)
            if any(_named(side) == "cp" for side in sides) and any(
                    isinstance(side, ast.Constant) and side.value == 2 for side in sides):
                found.append(f"{scope or 'module'}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_sequence_multiple_is_computed_by_the_layout_alone() -> None:
    found = [f"{path} {line}" for path, nodes in _package().items() if path != "topology.py"
             for line in _sequence_multiples(nodes)]
    assert not found, "a CP sequence multiple computed outside topology.py:\n" + "\n".join(found)


@pytest.mark.parametrize("multiple", ["unit = 2 * layout.cp * 64", "n % (2 * job.mesh.cp)", "m = cp * 2"])
def test_the_scan_sees_a_sequence_multiple(multiple: str) -> None:
    assert _sequence_multiples(_nodes(multiple))


@pytest.mark.parametrize(("ring", "ulysses", "length", "padded"), [
    (1, 1, 5, 6), (4, 1, 8, 8), (4, 1, 9, 16), (1, 4, 1, 8), (2, 2, 17, 24),
])
def test_a_layout_pads_a_sequence_to_what_its_ranks_shard(ring: int, ulysses: int, length: int, padded: int) -> None:
    """Every rank of the group holds its two zigzag chunks, split over its Ulysses group."""
    layout = CPLayout(ring, ulysses)
    assert layout.sequence_multiple == 2 * ring * ulysses
    assert layout.padded_length(length) == padded
    for ring_idx in range(ring):
        for ulysses_idx in range(ulysses):
            assert len(sequence_positions(padded, ring, ulysses, ring_idx, ulysses_idx)) == padded // layout.cp


# ---------------------------------------------------------------- the value


@pytest.mark.parametrize(("ring", "ulysses", "runs", "impl"), [
    (1, 1, LOCAL, RING), (4, 1, RING, RING), (1, 4, ULYSSES, ULYSSES), (2, 2, HYBRID, HYBRID), (4, 2, HYBRID, HYBRID),
])
def test_what_a_layout_runs_and_is_called(ring: int, ulysses: int, runs: str, impl: str) -> None:
    layout = CPLayout(ring, ulysses)
    assert (layout.cp, layout.runs, layout.impl) == (ring * ulysses, runs, impl)


@pytest.mark.parametrize("cp", [1, 2, 4, 6, 8])
def test_the_planners_name_for_its_degrees_builds_them_back(cp: int) -> None:
    """A planned layout runs as ``attention.impl=<its impl> mesh.ulysses=<u>``: the builder gives
    back the degrees the name was taken from."""
    for ulysses in (u for u in range(1, cp + 1) if cp % u == 0):
        layout = CPLayout(cp // ulysses, ulysses)
        assert cp_layout(layout.impl, cp, ulysses) == layout


@pytest.mark.parametrize(("impl", "cp", "ulysses", "expected"), [
    (RING, 4, None, (4, 1)), (ULYSSES, 4, None, (1, 4)), (HYBRID, 8, 2, (4, 2)), (RING, 1, None, (1, 1)),
    (ULYSSES, 1, None, (1, 1)),
])
def test_a_jobs_names_build_its_degrees(impl: str, cp: int, ulysses: int, expected: tuple[int, int]) -> None:
    layout = cp_layout(impl, cp, ulysses, "allgather")
    assert (layout.ring, layout.ulysses, layout.kv_exchange) == (*expected, "allgather")


def test_the_job_its_topology_and_its_planner_layout_read_one_layout() -> None:
    job = config.load(None, ["mesh.dp=2", "mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid",
                             "attention.kv_exchange=allgather", "train.global_batch=4"])
    assert job.cp_layout == CPLayout(2, 2, "allgather")
    assert (job.topology.ring, job.topology.ulysses) == (2, 2)
    assert layout_of(job).cp_layout == CPLayout(2, 2)


def test_an_unknown_implementation_is_named_by_its_key() -> None:
    assert ATTENTION_IMPLS == (RING, ULYSSES, HYBRID)
    with pytest.raises(ConfigError) as err:
        cp_layout("zigzag", 2, None)
    assert err.value.key == "attention.impl"


class _Built(Exception):
    pass


def test_a_warm_up_of_any_layout_runs_one_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker warms up on a one-rank copy of its job: a hybrid job's too, whose mesh.ulysses
    fits no CP group of one rank."""
    from ringtrain.train import trainer as trainer_module

    built: list[config.JobConfig] = []

    def trainer(job: config.JobConfig, **kwargs: object) -> None:
        built.append(job)
        raise _Built

    monkeypatch.setattr(trainer_module, "set_rank_env", lambda **kwargs: None)
    monkeypatch.setattr(trainer_module.dist, "init_process_group", lambda *args, **kwargs: None)
    monkeypatch.setattr(trainer_module, "Trainer", trainer)
    job = config.load(None, ["mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "attention.kv_exchange=ring"])
    with pytest.raises(_Built):
        trainer_module.warm_up(job, torch.device("cpu"))
    (tiny,) = built
    assert tiny.cp_layout == CPLayout(1, 1, "ring") and tiny.cp_layout.runs == LOCAL
