"""Silent-data-corruption scanning end to end, through `ringtrain run` on an embedded cluster.

A rank's device goes bad mid-run (chaos ``bitflip`` on its gradients: the loss stays finite,
every rank applies the corrupted update, and from then on its probes show one flipped bit).
The probe round at the next scan names it; it is evicted, a warm spare takes its seat, and
training rolls back to the last clean scan. The run then ends exactly as the uninterrupted one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from .test_elastic import JOB, STEPS, check_ledger, check_matches_reference, incidents, job_file, records
from .test_run_e2e import processes_using, ray_tmp, run_cli  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

SDC_EVERY = 4
BAD_RANK, BAD_STEP = 2, 6


def test_a_bitflip_is_found_within_one_scan_interval_evicted_and_rolled_back_to_a_clean_snapshot(
    tmp_path: Path, ray_tmp: Path, reference: Path
) -> None:
    run_dir = tmp_path / "run"
    result = run_cli(
        [
            str(job_file(tmp_path)),
            f"run_dir={run_dir}",
            *JOB,
            "cluster.num_cpus=3",  # the four ranks, a warm spare, and room left for a new spare
            "mesh.spares=1",
            f"controllers.sdc_every_steps={SDC_EVERY}",
            # Bit 26, an exponent bit: the largest gradient element is 16x off, a visible error
            # in this short run, yet the loss stays finite.
            f"chaos.faults=[{{kind: bitflip, rank: {BAD_RANK}, step: {BAD_STEP}, target: gradients, bit: 26}}]",
        ],
        home=tmp_path,
        ray_tmp=ray_tmp,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert processes_using(ray_tmp) == []

    (incident,) = incidents(run_dir)
    verdict = incident["verdict"]["sdc"]
    last_clean = BAD_STEP // SDC_EVERY * SDC_EVERY
    # Found by the first scan after the corruption, naming the rank and the probe.
    assert (incident["kind"], incident["ranks"], verdict["kind"], verdict["ranks"]) == ("sdc", [BAD_RANK], "outlier", [BAD_RANK])
    assert incident["detected_at_step"] == last_clean + SDC_EVERY
    assert verdict["probes"] == ["gemm_float32"], verdict["explanation"]
    # Evicted for a warm spare; rolled back to the snapshot of the last clean scan.
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
    # And it is gone: every kept step and the final parameters are the uninterrupted run's.
    check_matches_reference(run_dir, reference)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["dp"] == 2
    # The first step's round, then one every SDC_EVERY steps, step 8's twice (the failed round
    # and the one after the steps were redone).
    assert summary["sdc"] == {"scans": 1 + STEPS // SDC_EVERY + 1, "last_clean_scan": STEPS}
    check_ledger(summary)
