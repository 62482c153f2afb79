"""Hang tracing and SDC scanning end to end, in one run of ``ringtrain run`` on an embedded cluster.

Four injected faults (chaos), each recovered from before the next:

- three stalls, with ``controllers.hang_timeout_s=3``: a rank stuck in compute mid-step, a rank
  that leaves out the step's closing loss all-reduce, a rank that enters it with another shape.
  Each is diagnosed from every rank's collective records and stacks, the culprit named and
  replaced by a new worker (``mesh.min_dp=2`` keeps the job at dp 2);
- a rank's device going bad (``bitflip`` on its gradients: the loss stays finite, every rank
  applies the corrupted update, and its probes show a flipped bit from then on). The probe
  round of the next scan names it; it is evicted and training rolls back to the last clean scan.

Every recovery restores the state exactly at the same dp, so the run must end as the
uninterrupted one does.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.chaos_replay import keep

from .test_elastic import STEPS, check_ledger, check_matches_reference, incidents, records, run_to_its_end

pytestmark = [pytest.mark.ray, pytest.mark.slow]

HANG_TIMEOUT_S = 3.0
# (kind, rank, step) -> the verdict expected: its kind and the op the culprit is named with.
# Stalls strike off the scan steps: a rank that leaves out the loss all-reduce and goes on to
# the probe round's all-reduce would pair it with the others' loss all-reduce, and gloo aborts
# on the size mismatch (a crash, handled as one, but not the stall under test).
STALLS = {
    ("hang", 1, 3): ("compute", "batch_isend_irecv"),  # its ring peer waits for its K/V (a ring of two passes them)
    ("skip_collective", 2, 6): ("missing", "all_reduce"),
    ("wrong_shape", 3, 10): ("mismatch_shape", "all_reduce"),
}
SDC_EVERY = 4
BAD_RANK, BAD_STEP = 0, 13


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    home = tmp_path_factory.mktemp("chaos")
    stalls = [f"{{kind: {kind}, rank: {rank}, step: {step}}}" for kind, rank, step in STALLS]
    # Bit 26, an exponent bit: the largest gradient element is 16x off, an error that shows in
    # this short run, yet the loss stays finite.
    bitflip = f"{{kind: bitflip, rank: {BAD_RANK}, step: {BAD_STEP}, target: gradients, bit: 26}}"
    run_dir = run_to_its_end(
        home,
        "cluster.num_cpus=3",  # room for a new worker while the bad device's slot stays held
        "mesh.min_dp=2",
        f"controllers.hang_timeout_s={HANG_TIMEOUT_S}",
        f"controllers.sdc_every_steps={SDC_EVERY}",
        f"chaos.faults=[{', '.join([*stalls, bitflip])}]",
    )
    keep(run_dir, "three_stalls_then_a_bitflip")
    return run_dir


def test_each_stall_is_diagnosed_naming_the_rank_and_op_and_the_job_recovers(run_dir: Path) -> None:
    found = [i for i in incidents(run_dir) if i["kind"] == "hang"]
    assert len(found) == len(STALLS)
    for incident, ((_, rank, step), (kind, op)) in zip(found, STALLS.items()):
        verdict = incident["verdict"]["hang"]
        assert (incident["ranks"], incident["detected_at_step"]) == ([rank], step)
        assert (verdict["kind"], verdict["ranks"]) == (kind, [rank]), verdict["explanation"]
        (culprit,) = verdict["culprits"]
        assert culprit["op"] == op and culprit["stack"], verdict["explanation"]
        # Reported within hang_timeout_s + 5 s of the stalled step's start, then recovered.
        assert HANG_TIMEOUT_S <= incident["detect_s"] <= HANG_TIMEOUT_S + 5
        assert (incident["action"], incident["dp_after"], incident["lost_steps"]) == ("replace", 2, 0)
        assert incident["recover_s"] is not None


def test_a_bitflip_is_found_within_one_scan_interval_evicted_and_rolled_back_to_a_clean_snapshot(
    run_dir: Path, reference: Path
) -> None:
    (incident,) = [i for i in incidents(run_dir) if i["kind"] == "sdc"]
    verdict = incident["verdict"]["sdc"]
    last_clean = BAD_STEP // SDC_EVERY * SDC_EVERY
    # Found by the first scan after the corruption, naming the rank and the probe.
    assert (incident["ranks"], verdict["kind"], verdict["ranks"]) == ([BAD_RANK], "outlier", [BAD_RANK])
    assert incident["detected_at_step"] == last_clean + SDC_EVERY
    assert verdict["probes"] == ["gemm_float32"], verdict["explanation"]
    # Evicted for a new worker; rolled back to the snapshot of the last clean scan.
    assert (incident["action"], incident["dp_before"], incident["dp_after"]) == ("replace", 2, 2)
    assert incident["verdict"]["last_clean_scan"] == last_clean
    assert incident["lost_steps"] == SDC_EVERY and incident["recover_s"] is not None

    # The corruption was real: the first attempt of the step reduced another gradient, and the
    # step after it trained other weights.
    ref = {r["step"]: r for r in records(reference)}
    first_attempt: dict[int, dict[str, float]] = {}
    for r in records(run_dir):
        first_attempt.setdefault(r["step"], r)
    assert first_attempt[BAD_STEP]["grad_norm"] != ref[BAD_STEP]["grad_norm"]
    assert first_attempt[BAD_STEP + 1]["loss"] != ref[BAD_STEP + 1]["loss"]
    # And it is gone, as are the stalls: every kept step and the final parameters are the
    # uninterrupted run's.
    check_matches_reference(run_dir, reference)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dp"] == 2
    # The first step's round, one per cadence step that completed (4, 8, 12, 16: the stalled
    # attempts never reached theirs), and the failed round of step 16.
    assert summary["sdc"] == {"scans": 1 + STEPS // SDC_EVERY + 1, "last_clean_scan": STEPS}
    check_ledger(summary)
