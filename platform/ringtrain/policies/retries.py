"""A failure during a recovery: what it is, and whether the recovery is tried again. Pure.

A recovery moves live workers into a new world (they join one process group) and loads a
snapshot into every rank. A survivor, or the spare or new worker taking a lost seat, can die
in the middle of that: the world it was joining is then broken before it trained anything.
Nothing of the run's progress is lost with it: the restore point's shards were fetched before
anyone left the old world (``actors.recovery``), and they stay readable. So the failure is
treated as a failure of the world being formed: the fault policy (``policies.faults``) picks
the way to fill the new hole (a spare, a shrink, a new worker) and the recovery is carried out
again from the same restore point. Each attempt is an incident and counts against
``controllers.max_recoveries``, so a world that never forms still ends the run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ringtrain.policies.faults import Failure
from ringtrain.incidents import Kind

# How a worker call of the recovery ended (``errors.WorkerError.kind``), as the fault it means:
# a dead process or one that stopped answering lost its seat; an exception in join or restore
# leaves a rank whose state cannot be trusted, so its seat is refilled too.
_KINDS = {"died": Kind.CRASH, "timeout": Kind.HANG, "error": Kind.CRASH}
PHASES = ("warm", "join", "restore")


@dataclass(frozen=True)
class RecoveryFault:
    """A worker call that failed while a world was being formed."""

    rank: int  # the rank in the world being formed
    kind: str  # died | timeout | error (``errors.WorkerError.kind``)
    cause: str
    phase: str = ""  # warm | join | restore, when known


@dataclass(frozen=True)
class Retry:
    """The recovery to try again: the failure of the world being formed, the restore point it
    keeps, and the evidence for its incident."""

    failure: Failure
    restore_to: int
    evidence: dict[str, Any]


def retry_recovery(
    fault: RecoveryFault, *, incident: int, restore_to: int, attempts: int, max_recoveries: int
) -> Optional[Retry]:
    """The retry of the recovery of ``incident`` (``attempts`` recoveries made so far, the
    interrupted one included) after ``fault``; None once ``controllers.max_recoveries`` is spent
    (the caller fails the run). The restore point does not move: the state it names was
    gathered before the old world was left, and no step has run since."""
    if attempts >= max_recoveries:
        return None
    kind = _KINDS.get(fault.kind, Kind.CRASH)
    where = f" while {fault.phase}ing" if fault.phase in ("warm", "join") else " while restoring" if fault.phase else ""
    reason = f"rank {fault.rank} of the world being formed failed{where} in the recovery of incident {incident}: {fault.cause}"
    evidence = {"during_recovery": {"incident": incident, "phase": fault.phase, "restore_to": restore_to}}
    return Retry(Failure(kind, (fault.rank,), reason), restore_to, evidence)


def phase_of(phases_done: dict[str, float]) -> str:
    """The phase a world failed in, from the phases it completed (``WorkerGroup.phases``)."""
    for phase in PHASES:
        if f"{phase}_s" not in phases_done:
            return phase
    return "restore"
