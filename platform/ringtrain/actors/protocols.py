"""What the Controller needs of its collaborators, as protocols: the worker group, the recovery
that re-forms it, the durable persister and the sinks that follow the run. The real ones live
in this package (``group``, ``recovery``, ``persister``) and in ``telemetry``; the unit tests
drive the Controller with scripted ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

from ringtrain.actors.steps import StepResult
from ringtrain.policies.faults import Capacity, RankOutcome
from ringtrain.policies.recovery import RecoveryPlan
from ringtrain.status import WorkerInfo
from ringtrain.topology import Topology


class Group(Protocol):
    num_params: int
    infos: list[WorkerInfo]
    startup: dict[str, float]  # seconds by phase of the first world's start (summary.json)
    phases: dict[str, float]  # seconds by phase of the last world formed: a failure's is the first missing
    generation: int  # worlds formed so far
    holders: dict[str, Any]  # node id -> the snapshot holder there (none where nothing holds snapshots)
    start_step: int  # the step the run began after: 0, or the step a resume restored (``restore``)

    @property
    def topology(self) -> Topology:
        """The dp x cp grid of the world the group formed last: the one holder of the current
        dp, which a recovery or a grow changes when it forms its world."""
        ...

    def start(self) -> None: ...
    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        """How one step ended on every rank, as a value (``actors.steps.StepResult``)."""
        ...
    def safe_through(self, wait_s: float = 0.0) -> int:
        """The newest step whose snapshots are safe off their workers (``actors.safekeeping``);
        ``on_safe`` hears of it moving while a step runs."""
        ...

    def snapshot_refs(self, step: int) -> list[Any]: ...
    def restore(self, blobs: list[bytes]) -> int:
        """Every rank loads a checkpoint's shards; returns its step, which becomes ``start_step``."""
        ...
    def pin_snapshots(self, step: int) -> None: ...
    def shutdown(self) -> None: ...


@dataclass(frozen=True)
class Reform:
    """What ``Elastic.reform`` is asked: drop the ``lost`` ranks, seat the survivors of the kept
    replicas in a ``new_dp`` world, fill the empty seats with up to ``spares`` warm spares, then
    new workers, and resume from the newest whole snapshot at or before ``last_step`` (0: the
    initial state). ``fired_through``: the step the failure was seen in (None: ``last_step + 1``):
    chaos faults due by then have fired. ``quarantine``: the lost ranks' slots are never reused
    (their devices corrupted data, or are slow)."""

    lost: frozenset[int]
    new_dp: int
    spares: int
    last_step: int
    fired_through: Optional[int] = None
    quarantine: bool = False

    @property
    def fired(self) -> int:
        """The step by which the chaos faults due have fired."""
        return self.last_step + 1 if self.fired_through is None else self.fired_through


@dataclass(frozen=True)
class Reformed:
    """A world formed again, by a reform, a rollback or a grow, on Ray or on the simulated
    cluster: the step it resumes after, the seconds of each phase, who sits where, and the
    recovery plan carried out (``policies.recovery``)."""

    step: int
    phases: dict[str, float]  # seconds by phase: plan (find and fetch the state), warm, join, restore
    seats: tuple[Optional[int], ...] = ()  # new rank -> the old rank seated there (None: a new worker)
    plan: Optional[RecoveryPlan] = None


class Elastic(Protocol):
    """Carries out recoveries and resizes on the group (``actors.recovery.Recovery``). A reform,
    a rollback and a grow each return the world formed again (``Reformed``)."""

    def assess(self, failure: StepResult) -> list[RankOutcome]:
        """A failed step's outcomes, with what the cluster knows added (a node found gone takes
        every rank on it)."""
        ...
    def capacity(self, lost: tuple[int, ...], *, reuse_slots: bool = True) -> Capacity: ...
    def reform(self, request: Reform) -> Reformed: ...
    def cordon(self, ranks: tuple[int, ...]) -> None: ...
    def rollback(self, *, last_step: int, rejoin: bool, fired_through: Optional[int] = None) -> Reformed: ...
    def skip_batch(self, batch: int) -> range: ...
    def replenish_spares(self, target: int) -> None: ...
    def spares_changed(self) -> bool: ...
    def growth_capacity(self) -> int: ...
    def prepare_growth(self, replicas: int) -> None: ...
    def growth_ready(self) -> bool: ...
    def grow(self, *, new_dp: int, last_step: int) -> Reformed: ...
    def layout(self) -> dict[str, Any]: ...


class Durable(Protocol):
    """What the Controller needs of a Persister."""

    last_durable_step: int
    errors: list[str]
    requested: list[int]  # every step submitted
    stopped: Optional[str]  # why durable checkpointing stopped for good (the writer lease was lost)
    failed_saves: list[str]  # each save that failed, in one line (a lost lease aside)
    failed_in_a_row: int  # saves failed since the last that succeeded

    def submit(self, step: int, snapshot_refs: list[Any], *, timeout_s: Optional[float] = None) -> None: ...
    def poll(self) -> list[Any]: ...
    def flush(self, timeout_s: Optional[float] = None) -> list[Any]: ...
    def discard_after(self, step: int) -> list[int]: ...
    def close(self, timeout_s: Optional[float] = None) -> bool: ...
    def describe(self, exc: BaseException) -> str: ...


class Sink(Protocol):
    """Something that follows the run: TensorBoard, for one."""

    def step(self, record: dict[str, Any]) -> None: ...
    def incident(self, incident: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
