"""Calls to the workers of a world, and the one place Ray's errors become the platform's.

A call that ends in Ray's ``RayActorError`` is a worker that died, ``GetTimeoutError`` (or no
answer by the deadline) one that hung, ``RayTaskError`` an exception the worker raised: as a
``WorkerError`` naming the rank and its host (``get``, ``gather``) where a world forms or is
asked something, and as a ``RankOutcome`` (``outcome``) where a step's calls are judged rank by
rank (``policies.faults`` classifies those).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Sequence

from ringtrain.actors.roster import Member
from ringtrain.errors import WorkerError
from ringtrain.policies.faults import Outcome, RankOutcome
from ringtrain.policies.repeats import user_frame
from ringtrain.status import StepReport


def host_of(members: Sequence[Member], rank: int) -> str:
    """The host of ``rank`` as its worker reported it ("?" before it did)."""
    info = members[rank].info if rank < len(members) else None
    return info.host if info else "?"


def get(ref: Any, *, rank: int, host: str, timeout: float) -> Any:
    """The result of one worker's call (``timeout`` 0: wait as long as it takes), or the
    WorkerError that says why there is none."""
    import ray

    try:
        return ray.get(ref, timeout=timeout or None)
    except ray.exceptions.GetTimeoutError:
        raise WorkerError(rank, host, f"no answer within {timeout:g} s", kind="timeout") from None
    except ray.exceptions.RayActorError as exc:
        raise WorkerError(rank, host, f"worker process died ({type(exc).__name__})", kind="died") from None
    except ray.exceptions.RayTaskError as exc:
        raise WorkerError(rank, host, _raised(exc)) from None


def gather(
    members: Sequence[Member],
    call: Callable[[int, Any], Any],
    timeout: float,
    on_failure: Optional[Callable[[dict[Any, Member]], None]] = None,
    doing: str = "",
) -> list[Any]:
    """Call every one of ``members`` (with its rank and actor handle), wait for all; the first
    failure names its rank. ``on_failure`` is given the calls still pending when one failed
    (with the member running each), before the error; ``doing``, what the calls do when that
    is more than their name says, ends a timeout's message."""
    import ray

    rank_of = {call(rank, m.handle): rank for rank, m in enumerate(members)}
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    pending = list(rank_of)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        try:
            if not done:
                stuck = sorted(rank_of[r] for r in pending)
                why = f"no answer within {timeout:g} s (ranks {stuck})" + (f" {doing}" if doing else "")
                raise WorkerError(stuck[0], host_of(members, stuck[0]), why, kind="timeout")
            rank = rank_of[done[0]]
            results[rank] = get(done[0], rank=rank, host=host_of(members, rank), timeout=0)
        except WorkerError:
            if on_failure is not None:
                on_failure({ref: members[rank_of[ref]] for ref in pending})
            raise
    return [results[rank] for rank in range(len(members))]


def outcome(ref: Any, rank: int) -> RankOutcome | StepReport:
    """How one rank's step call ended: its report, or why not."""
    import ray

    try:
        report = ray.get(ref)
        assert isinstance(report, StepReport)
        return report
    except ray.exceptions.RayActorError as exc:
        return RankOutcome(rank, Outcome.DIED, type(exc).__name__)
    except ray.exceptions.RayTaskError as exc:
        where = user_frame(str(getattr(exc, "traceback_str", "") or ""))
        return RankOutcome(rank, Outcome.ERROR, _raised(exc), where=where)


def answered(ref: Any) -> bool:
    """Whether a call that has ended returned (a heartbeat: the worker is alive)."""
    import ray

    try:
        ray.get(ref, timeout=0)
        return True
    except Exception:  # the actor died: its step call reports that
        return False


def _raised(exc: Any) -> str:
    """What a worker raised, as "Type: its message's first line"."""
    cause = exc.cause if getattr(exc, "cause", None) is not None else exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}"
