"""Before step 1 a run says what it waits for (Ray, the workers' start, step 1) and says it again
with the time waited while nothing else is printed: no minute of silence on a loaded machine."""

from __future__ import annotations

import io
from pathlib import Path

from ringtrain.actors.controller import Controller
from ringtrain.telemetry.progress import QUIET_S, Progress
from ringtrain.telemetry.rundir import RunDir
from tests.unit.controller_fakes import ScriptedGroup, job


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_wait_is_said_and_said_again_after_quiet_seconds_until_the_next_step() -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(3, out=out, clock=clock, ticking=False)
    progress.waiting("2 workers to start")
    clock.now += QUIET_S - 1
    progress.tick()  # not quiet for long enough yet
    clock.now += 1
    progress.tick()
    clock.now += 5
    progress.message("something else")  # any output resets the quiet
    clock.now += QUIET_S - 1
    progress.tick()
    clock.now += 1
    progress.tick()
    progress.step({"step": 1, "loss": 5.0, "tokens_per_s": 10.0, "step_time_s": 1.0, "lr": 1e-3, "dp": 1, "cp": 1})
    clock.now += 10 * QUIET_S
    progress.tick()  # step 1 came: the wait is over
    assert out.getvalue().splitlines()[:-1] == [
        "ringtrain: waiting for 2 workers to start",
        f"ringtrain: still waiting ({QUIET_S:.0f} s) for 2 workers to start",
        "something else",
        f"ringtrain: still waiting ({2 * QUIET_S + 5:.0f} s) for 2 workers to start",
    ]
    assert out.getvalue().splitlines()[-1].startswith("step 1/3 | loss 5.0000")


class SlowStart(ScriptedGroup):
    """Workers that take 40 s to start, the progress thread ticking meanwhile."""

    def __init__(self, clock: Clock, progress: Progress) -> None:
        super().__init__()
        self.clock, self.progress = clock, progress

    def start(self) -> None:
        for _ in range(4):
            self.clock.now += 10
            self.progress.tick()


def test_the_controller_says_what_it_waits_for_before_step_1(tmp_path: Path) -> None:
    clock, out = Clock(), io.StringIO()
    progress = Progress(6, out=out, clock=clock, ticking=False)
    Controller(job(), SlowStart(clock, progress), RunDir(tmp_path), progress, clock=clock).run()
    lines = out.getvalue().splitlines()
    assert lines[:4] == [
        "ringtrain: waiting for 2 workers to start (each imports torch and DeepSpeed, then together they build the "
        "model, its ZeRO engine and the data)",
        "ringtrain: still waiting (20 s) for 2 workers to start (each imports torch and DeepSpeed, then together they "
        "build the model, its ZeRO engine and the data)",
        "ringtrain: still waiting (40 s) for 2 workers to start (each imports torch and DeepSpeed, then together they "
        "build the model, its ZeRO engine and the data)",
        "ringtrain: waiting for step 1, the workers' first (it also warms their kernels, and reads the first batch)",
    ]
    assert lines[4].startswith("step 1/6 |")
