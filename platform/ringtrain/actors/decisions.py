"""The Controller's recovery decisions for the goodput simulation, asked of the Controller itself.

Each failure the simulation draws (``planner.goodput``) is replayed on a simulated cluster of
the job's shape (``actors.simulated``): a world of the current replicas with its warm spares
and idle GPUs, the failure striking the first step, the Controller running unchanged until the
step is trained again. Its incident says what it did. Answers depend only on the failure's kind
and that state, so each is asked once; growth follows the policy the Controller grows by.
"""

from __future__ import annotations

import dataclasses
import io
import tempfile
from pathlib import Path
from typing import Optional

from ringtrain.actors.controller import Controller
from ringtrain.actors.simulated import Clock, Corruption, Fault, SimulatedGroup, SimulatedRecovery
from ringtrain.config import JobConfig, validate
from ringtrain.planner.goodput import Recovery
from ringtrain.policies.elastic import target_dp
from ringtrain.telemetry.progress import Progress
from ringtrain.telemetry.rundir import RunDir

# How each kind of failure strikes rank 0's first step: a GPU that fails takes its worker; a node
# takes every rank on it; software fails the step with no hardware lost. A corrupt device is
# found by the probe round after step 2 (step 1's sets the golden values).
_FAULTS = {"device": "crash", "node": "node_lost", "software": "error"}
_SDC_STEP = 2


class ControllerDecisions:
    """``planner.goodput.Decider``, answered by the Controller on a simulated cluster.
    ``job``: the job at full size (its mesh, batch, min_dp and spares target)."""

    def __init__(self, job: JobConfig, *, gpus_per_node: int) -> None:
        self.job = job
        self.gpus_per_node = gpus_per_node
        self._asked: dict[tuple[str, int, int, int], Recovery] = {}

    def recover(self, kind: str, *, dp: int, spares: int, free_gpus: int) -> Recovery:
        # No failure takes more ranks than a node holds: spares or idle GPUs beyond that many
        # change no decision (policies.faults.decide compares them with the ranks lost).
        most = min(self.gpus_per_node, self.job.world_size)
        key = (kind, dp, min(spares, most), min(free_gpus, most))
        if key not in self._asked:
            self._asked[key] = self._replay(*key)
        return self._asked[key]

    def grow_to(self, *, dp: int, free_gpus: int) -> int:
        j = self.job
        grown = target_dp(
            dp + free_gpus // j.mesh.cp,
            global_batch=j.train.global_batch,
            micro_batch=j.train.micro_batch,
            min_dp=j.mesh.min_dp,
            max_dp=j.max_dp,
        )
        return max(dp, grown or dp)

    @property
    def replays(self) -> int:
        return len(self._asked)

    def _replay(self, kind: str, dp: int, spares: int, free_gpus: int) -> Recovery:
        sdc = kind == "sdc"
        job = dataclasses.replace(
            self.job,
            mesh=dataclasses.replace(self.job.mesh, dp=dp),
            train=dataclasses.replace(self.job.train, steps=_SDC_STEP + 1 if sdc else 2, stop_at_step=None),
            controllers=dataclasses.replace(
                self.job.controllers,
                sdc_every_steps=1 if sdc else 0,
                on_straggler="off",
                max_recoveries=10**9,  # the simulation counts them; here each one is the first
            ),
        )
        validate(job)
        clock = Clock()
        faults: Optional[dict[int, list[Fault]]] = None if sdc else {1: [Fault(_FAULTS[kind], 0)]}
        corrupt = Corruption(_SDC_STEP, (0,)) if sdc else None
        ranks_per_node = min(self.gpus_per_node, job.world_size)
        group = SimulatedGroup(job, clock, faults, corrupt=corrupt, ranks_per_node=ranks_per_node)
        recovery = SimulatedRecovery(group, spares=spares, free_slots=free_gpus)
        with tempfile.TemporaryDirectory(prefix="ringtrain-goodput-") as scratch:
            quiet = Progress(job.train.steps, enabled=False, out=io.StringIO())
            summary = Controller(job, group, RunDir(Path(scratch)), progress=quiet, elastic=recovery, clock=clock).run()
        if summary["status"] == "failed":  # the decision was to abort: no recovery was made
            return Recovery(action="abort", dp_after=dp, spares_used=0, lost_steps=0)
        (incident,) = summary["recoveries"]
        return Recovery(
            action=str(incident["action"]),
            dp_after=int(incident["dp_after"] or dp),
            spares_used=spares - recovery.spares,
            lost_steps=int(incident["lost_steps"] or 0),
        )
