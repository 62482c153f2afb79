"""Forming a world's groups waits for a dead peer no longer than ``controllers.join_timeout_s``;
once formed, every group's collectives get ``controllers.step_timeout_s``.

A rank that dies while a world forms leaves its peers inside torch: gloo retries a connect to
the dead rank's address, and a new group's barrier waits for it, each until the group's timeout
(torch's gloo default is 30 minutes). The recovery cannot interrupt them, so the bound has to be
the groups' own. Two gloo ranks: rank 1 leaves the world right after joining it, before the
mesh's groups form; rank 0's ``build_mesh`` must fail within the forming timeout.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path
from typing import Any

from ringtrain_dev.ranks import run_ranks

FORM_S = 2.0


def _forming_with_a_peer_that_dies(rank: int, world: int, store: str, results: Any) -> None:
    import torch
    import torch.distributed as dist

    from ringtrain.topology import Topology
    from ringtrain.train.mesh import build_mesh

    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    dist.barrier()  # both in the world
    if rank == 1:
        os._exit(0)  # dies as the world forms: its peer is about to form the mesh's groups with it
    t0 = time.monotonic()
    try:
        build_mesh(Topology(2, 1, 1), rank, form_timeout_s=FORM_S, timeout_s=600.0)
    except Exception as exc:
        results.put((time.monotonic() - t0, type(exc).__name__))
    else:
        results.put((time.monotonic() - t0, "formed"))
    results.close()
    results.join_thread()  # flushed before the exit below, which skips the queue's own
    os._exit(0)  # the broken default group is not torn down: nothing to wait for


def _forming_alone(rank: int, world: int, store: str, results: Any) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    from ringtrain.topology import Topology
    from ringtrain.train.mesh import build_mesh

    forming = datetime.timedelta(seconds=7)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world, timeout=forming)
    try:
        mesh = build_mesh(Topology(1, 1, 1), rank, form_timeout_s=FORM_S, timeout_s=123.0)
        groups = [c10d._get_default_group(), *mesh.groups()]
        results.put([g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups])
    finally:
        dist.destroy_process_group()


def test_a_peer_dying_as_the_mesh_forms_fails_it_within_the_forming_timeout(tmp_path: Path) -> None:
    waited, outcome = run_ranks(_forming_with_a_peer_that_dies, 2, tmp_path, timeout=60.0)
    assert outcome != "formed"
    assert waited < FORM_S + 10.0, f"waited {waited:.1f} s for the dead peer (forming timeout {FORM_S:g} s)"


def test_the_formed_groups_collectives_get_the_step_timeout(tmp_path: Path) -> None:
    timeouts = run_ranks(_forming_alone, 1, tmp_path, timeout=60.0)
    assert len(timeouts) >= 2 and set(timeouts) == {123.0}  # the world's too, not its forming 7 s
