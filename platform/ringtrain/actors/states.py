"""The Controller's states: one frozen value per state, carrying what its next move needs.

The Controller's ``run()`` is a loop: it hands the current state to the handler of its class,
which does that state's work and returns the next state, until a terminal one. A failure seen
anywhere (a step that did not finish, a non-finite loss, an SDC probe round, a straggler) becomes
a ``Recovering`` value, the one way into a recovery; a recovery broken by another failure returns
a new ``Recovering`` that remembers the recoveries it interrupted, rather than recursing.

::

    Starting ──> Training(step) ──> Training(step + 1) ──> ... ──> Finished
                   │    ^    │
                   │    │    └──> Resizing(step, new_dp) ──> Training(step + 1)
                   v    │
              Recovering ──> Restoring ──> Training(resumed + 1)
                   ^             │
                   └─────────────┘  a worker failed while the new world formed

    any state but the terminal ones ──> Failed | Stopping ──> Stopped

``ALLOWED`` is the transition table the Controller checks every move against, and the
Controller's ``HANDLERS`` the table of what it does in each state: ``check_handlers`` holds the
two against each other when the Controller's module is imported. A new state is one class here,
its rows in ``ALLOWED`` (where it may go, and which states lead to it) and one handler in
``HANDLERS``; a state without a handler, or a handler for a state with no row, fails that
import, not a run.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Collection, Mapping, Optional

from ringtrain.policies.faults import Decision, Failure
from ringtrain.status import Incident


@dataclass(frozen=True)
class State:
    """``reason``: why the run entered the state, logged with the transition."""

    name: ClassVar[str]  # what summary.json's status and the logs call it
    terminal: ClassVar[bool] = False
    reason: str


@dataclass(frozen=True)
class Starting(State):
    """The workers start; a resume restores its checkpoint."""

    name: ClassVar[str] = "starting"


@dataclass(frozen=True)
class Training(State):
    """Run ``step``, then watch it; past the job's last step the run finishes."""

    name: ClassVar[str] = "running"
    step: int


@dataclass(frozen=True)
class Recovering(State):
    """``failure`` was seen in ``step`` (which began at clock time ``t0``): the fault policy
    decides what to do about it. ``restore_to``: the newest step a restore may go back to
    (default: the step before ``step``); ``batch``: the data batch the step trained on (the one a
    skip drops); ``interrupted``: the recoveries this one retries, oldest first, each with the
    clock time its failure was seen."""

    name: ClassVar[str] = "recovering"
    failure: Failure
    step: int
    t0: float
    seen_at: float
    seen_unix: float
    verdict: Optional[dict[str, Any]] = None
    batch: Optional[int] = None
    restore_to: Optional[int] = None
    interrupted: tuple[tuple[Incident, float], ...] = ()


@dataclass(frozen=True)
class Restoring(State):
    """``decision`` (a rollback, or a new world) carried out for ``recovery``, whose
    ``incident`` is written; training resumes after the newest snapshot at or before
    ``last_step``."""

    name: ClassVar[str] = "restoring"
    recovery: Recovering
    decision: Decision
    incident: Incident
    last_step: int


@dataclass(frozen=True)
class Resizing(State):
    """Capacity came back and stayed: after ``step`` the job grows to ``new_dp`` replicas."""

    name: ClassVar[str] = "resizing"
    step: int
    new_dp: int


@dataclass(frozen=True)
class Stopping(State):
    """The user stopped the run: the newest snapshot is made durable within the stop's budget."""

    name: ClassVar[str] = "stopping"


@dataclass(frozen=True)
class Finished(State):
    name: ClassVar[str] = "finished"
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Failed(State):
    name: ClassVar[str] = "failed"
    terminal: ClassVar[bool] = True


@dataclass(frozen=True)
class Stopped(State):
    name: ClassVar[str] = "stopped"
    terminal: ClassVar[bool] = True


# The moves the Controller may make, by the class of the state it is in. Training and Resizing
# may also stop or fail from any step; Restoring may start over as a new Recovering
# (policies.retries); Recovering returns to Training when the decision only reports.
ALLOWED: dict[type[State], tuple[type[State], ...]] = {
    Starting: (Training, Failed, Stopping),
    Training: (Training, Recovering, Resizing, Finished, Failed, Stopping),
    Recovering: (Restoring, Training, Failed, Stopping),
    Restoring: (Training, Recovering, Failed, Stopping),
    Resizing: (Training, Failed, Stopping),
    Stopping: (Stopped,),
}


class MissingHandler(TypeError):
    """The Controller's handler table and its transition table disagree."""


def check_handlers(
    handlers: Collection[type[State]],
    allowed: Mapping[type[State], tuple[type[State], ...]] = ALLOWED,
    states: Collection[type[State]] = (),
) -> None:
    """Raise MissingHandler unless ``handlers`` (the states the Controller has a handler for)
    are exactly the states ``allowed`` moves from, and every state a row names or ``states``
    lists (default: every subclass of State) that is not terminal has its row. The Controller's
    module calls it as it is imported."""
    known = set(states or _subclasses(State)) | set(allowed) | {s for row in allowed.values() for s in row}
    problems = [f"{s.__name__} has no handler" for s in allowed if s not in handlers]
    problems += [f"{s.__name__} has a handler but no row in ALLOWED" for s in handlers if s not in allowed]
    problems += [f"{s.__name__} is not terminal but has no row in ALLOWED" for s in known if not s.terminal and s not in allowed]
    problems += [f"{s.__name__} is terminal but has a row in ALLOWED" for s in allowed if s.terminal]
    if problems:
        raise MissingHandler("the Controller's states and handlers disagree: " + "; ".join(sorted(problems)))


def _subclasses(cls: type[State]) -> list[type[State]]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return found
