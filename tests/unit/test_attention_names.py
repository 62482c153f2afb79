"""The attention names are declared once, in config (the implementations with the CP layout, in
topology), and every train-side registry matches them.

Adding a kernel or implementation name without what runs it, or the reverse, fails here (and at
the registry's import, through ``keyed_by``) instead of when a job names it.
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest

from ringtrain.config import (
    ATTENTION_BLOCK_KERNELS,
    ATTENTION_IMPLS,
    ATTENTION_KERNELS,
    AUTO_KERNEL,
    LOCAL_ATTENTION_IMPL,
)
from ringtrain.topology import CPLayout
from ringtrain.train import attention
from ringtrain.train.attention import implementations, kernels
from ringtrain.train.attention.block_kernel import AttentionKernel

BLOCK_KERNELS = set(ATTENTION_BLOCK_KERNELS)


def test_kernel_names_are_auto_and_the_block_kernels() -> None:
    assert ATTENTION_KERNELS == (AUTO_KERNEL, *ATTENTION_BLOCK_KERNELS)
    assert len(set(ATTENTION_KERNELS)) == len(ATTENTION_KERNELS)
    assert kernels.KERNEL_NAMES == ATTENTION_KERNELS
    assert attention.KERNEL_NAMES == ATTENTION_KERNELS


@pytest.mark.parametrize("table", ["KERNEL_CLASSES", "KERNEL_SPECS", "UNAVAILABLE"])
def test_every_per_kernel_table_has_exactly_the_declared_kernels(table: str) -> None:
    assert tuple(getattr(kernels, table)) == ATTENTION_BLOCK_KERNELS


def test_each_kernel_class_carries_its_own_name() -> None:
    for name, cls in kernels.KERNEL_CLASSES.items():
        assert cls.name == name


def test_every_kernel_class_in_the_package_is_registered() -> None:
    # A kernel written but never added to the registry would be unreachable by name.
    for info in pkgutil.iter_modules(attention.__path__):
        importlib.import_module(f"{attention.__name__}.{info.name}")
    pending, found = [AttentionKernel], set()
    while pending:
        for sub in pending.pop().__subclasses__():
            pending.append(sub)
            if sub.__module__.startswith(attention.__name__ + "."):
                found.add(sub)
    assert found == set(kernels.KERNEL_CLASSES.values())


def test_partial_tables_name_only_declared_kernels() -> None:
    assert set(kernels.KERNEL_OPS) <= BLOCK_KERNELS
    for order in (*kernels.AUTO_ORDER.values(), *kernels.MASK_ORDER.values()):
        assert set(order) <= BLOCK_KERNELS
    for name in (name for order in kernels.MASK_ORDER.values() for name in order):
        assert kernels.KERNEL_CLASSES[name].supports_mask
    assert not set(kernels.NO_LSE) & set(ATTENTION_KERNELS)


def test_implementations_are_the_configs_and_local() -> None:
    assert implementations.IMPLS == (*ATTENTION_IMPLS, LOCAL_ATTENTION_IMPL)
    assert attention.IMPLS == implementations.IMPLS
    assert tuple(implementations.IMPLEMENTATIONS) == implementations.IMPLS


class _Group:
    """A group of ``ranks`` ranks as ``build_attention`` sees one: a transport that sends nothing."""

    def __init__(self, ranks: int) -> None:
        self.ranks = ranks

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return self.ranks

    def send_recv(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("building an attention sends nothing")


# (ring, ulysses) -> what the layout runs: every implementation, the ring or Ulysses alone where
# the other group is one rank.
RUNS = {(1, 1): LOCAL_ATTENTION_IMPL, (2, 1): "ring", (1, 2): "ulysses", (2, 2): "hybrid", (4, 1): "ring",
        (1, 4): "ulysses", (2, 4): "hybrid"}


def test_every_implementation_is_what_some_layout_runs() -> None:
    assert set(RUNS.values()) == set(implementations.IMPLS)


@pytest.mark.parametrize(("ring", "ulysses"), list(RUNS), ids=[f"{r}x{u}" for r, u in RUNS])
def test_the_built_attention_runs_its_layouts_implementation(ring: int, ulysses: int) -> None:
    runs = RUNS[(ring, ulysses)]
    layout = CPLayout(ring, ulysses)
    assert layout.runs == runs
    fn = attention.build_attention(layout, "auto", ring_group=_Group(ring), ulysses_group=_Group(ulysses))
    assert fn.impl == runs
    assert fn._run.func is implementations.IMPLEMENTATIONS[runs]


@pytest.mark.parametrize(("ring", "ulysses"), [(1, 1), (2, 1), (2, 2)])
def test_groups_that_are_not_the_layouts_are_refused(ring: int, ulysses: int) -> None:
    with pytest.raises(ValueError, match=f"ring {ring} x ulysses {ulysses} was given"):
        attention.build_attention(CPLayout(ring, ulysses), "auto", ring_group=_Group(ring * 2),
                                  ulysses_group=_Group(ulysses))


@pytest.mark.parametrize("kernel", ATTENTION_KERNELS)
def test_every_declared_kernel_name_builds(kernel: str) -> None:
    attention.build_attention(CPLayout(1, 1), kernel, ring_group=None, ulysses_group=None)


def test_a_registry_that_disagrees_with_the_declared_names_is_refused() -> None:
    names = ("a", "b")
    assert list(kernels.keyed_by(names, {"b": 2, "a": 1}, "t")) == ["a", "b"]
    with pytest.raises(RuntimeError, match=r"missing \['b'\]"):
        kernels.keyed_by(names, {"a": 1}, "t")
    with pytest.raises(RuntimeError, match=r"undeclared \['c'\]"):
        kernels.keyed_by(names, {"a": 1, "b": 2, "c": 3}, "t")
