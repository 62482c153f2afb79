"""summary.json's ``startup.before_ray_init_s``: the driver's own time before it asks for a
cluster, read against the time the process really ran.

A start time in wall-clock seconds rests on the boot time the kernel reports rounded down to
the second, so it reads up to a second early; the driver's prelude (well under a second) then
looked twice its length. The check runs a process that sleeps a known time and compares what it
measured with the wall time its parent saw around it.
"""

from __future__ import annotations

import subprocess
import sys
import time

SLEEP_S = 0.5
PROBE = f"""
import time
time.sleep({SLEEP_S})
from ringtrain.actors.cluster import _since_process_start
print(_since_process_start())
"""


def test_time_since_the_process_started_is_what_its_parent_saw() -> None:
    for _ in range(3):  # three tries: the wall time around a process start is loose by scheduling only
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True).stdout
        wall = time.monotonic() - t0
        measured = float(out.split()[-1])
        assert measured >= SLEEP_S
        if measured <= wall:
            return
    raise AssertionError(f"{measured:.3f} s since the process started, but it ran {wall:.3f} s in all")
