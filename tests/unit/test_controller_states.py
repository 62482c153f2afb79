"""The Controller's states and its handlers: a new state is one class, one handler and its rows
in the transition table, and a state without a handler fails the Controller's import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest

from ringtrain.actors.controller import HANDLERS
from ringtrain.actors.states import ALLOWED, Failed, MissingHandler, State, Stopping, Training, check_handlers

PLATFORM = Path(__file__).resolve().parents[2] / "platform"


@dataclass(frozen=True)
class Pausing(State):
    """A state the Controller does not have: training waits for something, then goes on."""

    name: ClassVar[str] = "pausing"


KNOWN = (*(set(ALLOWED) | {s for row in ALLOWED.values() for s in row}), Pausing)


def test_every_state_the_controller_moves_from_has_its_handler() -> None:
    assert set(HANDLERS) == set(ALLOWED)
    assert all(not s.terminal for s in HANDLERS)


def test_a_new_state_takes_one_class_one_handler_and_its_rows() -> None:
    rows = {**ALLOWED, Pausing: (Training, Failed, Stopping), Training: (*ALLOWED[Training], Pausing)}
    check_handlers({*HANDLERS, Pausing}, rows, KNOWN)  # the class above, its handler and its rows: enough

    with pytest.raises(MissingHandler, match="Pausing has no handler"):
        check_handlers(set(HANDLERS), rows, KNOWN)
    with pytest.raises(MissingHandler, match="Pausing is not terminal but has no row in ALLOWED"):
        check_handlers(set(HANDLERS), ALLOWED, KNOWN)
    with pytest.raises(MissingHandler, match="Pausing has a handler but no row in ALLOWED"):
        check_handlers({*HANDLERS, Pausing}, ALLOWED, tuple(s for s in KNOWN if s is not Pausing))


def test_a_state_without_a_handler_fails_the_controllers_import() -> None:
    """Added to the transition table but given no handler: importing the Controller fails,
    naming it, before any run could reach it."""
    script = textwrap.dedent(
        """
        from dataclasses import dataclass
        from typing import ClassVar

        from ringtrain.actors import states

        @dataclass(frozen=True)
        class Pausing(states.State):
            name: ClassVar[str] = "pausing"

        states.ALLOWED[Pausing] = (states.Training, states.Failed, states.Stopping)
        states.ALLOWED[states.Training] = (*states.ALLOWED[states.Training], Pausing)
        import ringtrain.actors.controller
        """
    )
    env = {**os.environ, "PYTHONPATH": f"{PLATFORM}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    found = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)

    assert found.returncode != 0
    assert "MissingHandler" in found.stderr and "Pausing has no handler" in found.stderr, found.stderr[-2000:]
