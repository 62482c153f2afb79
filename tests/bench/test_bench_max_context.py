"""bench/max_context.py on a CPU: its search against a known threshold, its tries' failures as
results, and the ``--device cpu --tiny`` run end to end under a forced memory cap.

The search is a pure function of the answers so far, so it is held against an oracle that fits
exactly up to a threshold: from a start below or above it, it must end with the longest fitting
multiple of the granule and the next multiple failing, within the try cap. The tries' processes
are held against runners that run out of memory, hang and get killed: each must come back as a
recorded outcome, with its process gone. The end-to-end run must find, for each system, the
boundary the cap sets: the longest length it reports stayed under the cap, the next one tried
went over.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from bench import max_context as bench
from tests.bench.bench_script import run_bench

GRANULE = 256


def threshold_oracle(threshold: int, calls: list[int]) -> Any:
    def fits(length: int) -> Optional[bool]:
        calls.append(length)
        return length <= threshold

    return fits


# Thresholds up to 32 granules: from a start 20% off, one or two growth steps bracket the
# threshold within a 25% gap, and 3-4 bisections close it, inside the default cap of 6.
THRESHOLDS = [GRANULE, GRANULE + 1, 3 * GRANULE - 1, 2500, 4000, 5000, 7999, 32 * GRANULE]
START_FACTORS = [0.8, 0.9, 1.0, 1.1, 1.25]


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("factor", START_FACTORS)
def test_search_finds_the_threshold_within_a_granule(threshold: int, factor: float) -> None:
    policy = bench.SearchPolicy(granule=GRANULE, growth=1.25, max_tries=6)
    calls: list[int] = []
    result = bench.search_longest(threshold_oracle(threshold, calls), int(threshold * factor), policy)
    expected = threshold // GRANULE * GRANULE
    assert result.longest == expected, (calls, result.stopped)
    assert result.failure == expected + GRANULE, (calls, result.stopped)
    assert result.stopped == "converged"
    assert len(calls) <= policy.max_tries
    assert len(set(calls)) == len(calls), f"a length tried twice: {calls}"
    assert all(n % GRANULE == 0 and n >= GRANULE for n in calls)


@pytest.mark.parametrize("start", [1024, 2**20, 2**24])
def test_search_keeps_to_the_cap_and_a_true_bracket_when_far_off(start: int) -> None:
    """1M tokens at a granule of 1,024 cannot be closed in 6 tries from 16x away: the search
    stops at the cap with a bracket that is still true (the longest tried fit, the failure above
    it did not, and nothing between them was tried)."""
    threshold = 1_000_000
    policy = bench.SearchPolicy(granule=1024, growth=1.25, max_tries=6)
    calls: list[int] = []
    result = bench.search_longest(threshold_oracle(threshold, calls), start, policy)
    assert len(calls) == 6
    assert result.stopped == "max tries"
    assert result.longest == max((n for n in calls if n <= threshold), default=0)
    if result.failure is not None:
        assert result.failure > threshold
        assert not any(result.longest < n < result.failure for n in calls)


def test_nothing_fits_stops_at_one_granule() -> None:
    policy = bench.SearchPolicy(granule=GRANULE, max_tries=20)
    calls: list[int] = []
    result = bench.search_longest(threshold_oracle(GRANULE - 1, calls), 10 * GRANULE, policy)
    assert result.longest == 0 and result.failure == GRANULE
    assert min(calls) == GRANULE
    assert result.stopped.startswith("nothing fits")


def test_growth_stops_at_the_ceiling() -> None:
    policy = bench.SearchPolicy(granule=GRANULE, max_tries=20, ceiling=5000)
    calls: list[int] = []
    result = bench.search_longest(threshold_oracle(10**9, calls), 1000, policy)
    assert max(calls) == 5000 // GRANULE * GRANULE
    assert result.stopped == "ceiling"


def test_a_failure_below_a_fit_does_not_narrow_the_bracket() -> None:
    """A search only tries lengths inside its bracket, but a history can hold a failure below a
    fit (a try that failed for another reason than memory): the fits bound the bracket, and the
    next length is new."""
    policy = bench.SearchPolicy(granule=GRANULE, max_tries=10)
    tried = [(1024, True), (1280, False), (1536, True)]
    assert bench.bracket(tried) == (1536, None)
    assert bench.next_length(policy, 1024, tried) == 1792
    assert bench.bracket([*tried, (2048, False)]) == (1536, 2048)
    assert bench.next_length(policy, 1024, [*tried, (2048, False)]) == 1792


def test_the_oracle_can_end_the_search() -> None:
    calls: list[int] = []

    def oracle(length: int) -> Optional[bool]:
        calls.append(length)
        return None if len(calls) == 2 else True

    result = bench.search_longest(oracle, 1024, bench.SearchPolicy(granule=GRANULE))
    assert calls == [1024, 1280]
    assert result.tried == [(1024, True)]
    assert result.stopped == "stopped by the caller"


# ---- the prediction's verdict over what the tries bracket ---------------------------------------

TOLERANCE = bench.PREDICTION_TOLERANCE


@pytest.mark.parametrize(("longest", "failure", "expected"), [
    (10240, 10240 + GRANULE, pytest.approx(0.0)),  # converged on the prediction
    (9472, 11264, pytest.approx(10240 / 9472 - 1)),  # every max from 9,472 to 11,008 is within 10%: the worst
    (8192, 8448, pytest.approx(10240 / 8192 - 1)),  # converged 25% short of the prediction
    (11776, None, pytest.approx(1 - 10240 / 11776)),  # at least 11,776 fits: 13% and more past it
    (0, 8192, pytest.approx(10240 / 7936 - 1)),  # nothing up to 7,936 can fit: 29% and more over
])
def test_the_prediction_is_decided_over_every_max_the_tries_leave(longest: int, failure: Optional[int],
                                                                   expected: Any) -> None:
    error, why = bench.prediction_error(10240, longest, failure, GRANULE, TOLERANCE)
    assert error == expected and why == ""


@pytest.mark.parametrize(("longest", "failure"), [(10240, None), (9216, 12288), (0, 11264)])
def test_a_bracket_across_the_tolerance_decides_nothing(longest: int, failure: Optional[int]) -> None:
    """A fit at the prediction with nothing tried above it, or a bracket with maxima inside and
    outside the tolerance: the longest fit alone would read as a verdict, and is not one."""
    error, why = bench.prediction_error(10240, longest, failure, GRANULE, TOLERANCE)
    assert error is None and why.startswith(f"the tries leave the max between {longest:,}")


def test_nothing_fits_where_the_planner_says_so_is_no_error() -> None:
    assert bench.prediction_error(0, 0, GRANULE, GRANULE, TOLERANCE) == (0.0, "")
    assert bench.prediction_error(2048, 0, GRANULE, GRANULE, TOLERANCE)[0] == float("inf")


def test_peaks_at_fewer_lengths_than_the_target_counts_are_not_a_miss() -> None:
    """Two tries measure two peaks at most: the target of three says nothing of them (not
    measured, and still not met under --check); three measured, two within, is a miss."""
    rt = {"max_seq_len": 4096, "failed_at": 4352, "tries": [{}], "stopped": ""}

    def peaks_target(measured: list[int], within: list[int]) -> Any:
        summary = {"predicted_max_error": 0.0, "predicted_max_undecided": "", "peak_measured_at": measured,
                   "peak_within_tolerance_at": within}
        return bench.targets_for("llama3.2-1b", _h200(None, 128), summary, {"ringtrain": rt})[-1]

    few = peaks_target([3840, 4096], [3840, 4096])
    assert few.value is None and not few.met and "fewer than 3" in few.line(smoke=False)
    enough = peaks_target([3584, 3840, 4096], [3840, 4096])
    assert enough.value == 2 and enough.line(smoke=False).endswith("MISS")


@pytest.mark.parametrize("predicted", [10_000, 30_848, 64_896])
def test_two_tries_at_the_edges_decide_the_prediction(predicted: int) -> None:
    """With the second try at the tolerance's edge, two tries give the verdict the true maximum
    deserves, wherever it lies: inside the 10% band or on either side of it."""
    policy = bench.SearchPolicy(granule=GRANULE, max_tries=2, edges=TOLERANCE)
    for threshold in range(int(predicted * 0.75), int(predicted * 1.3), GRANULE // 3):
        calls: list[int] = []
        result = bench.search_longest(threshold_oracle(threshold, calls), predicted, policy)
        error, why = bench.prediction_error(predicted, result.longest, result.failure, GRANULE, TOLERANCE)
        true_max = threshold // GRANULE * GRANULE
        assert error is not None, (threshold, calls, why)
        assert (error <= TOLERANCE) == (abs(predicted / true_max - 1) <= TOLERANCE), (threshold, calls, error)
        assert len(calls) == 2 and calls[0] == predicted // GRANULE * GRANULE


# ---- failures are results ---------------------------------------------------------------------


def test_out_of_memory_is_classified_by_its_limit() -> None:
    def raised(exc: BaseException, cause: Optional[BaseException] = None) -> BaseException:
        try:
            raise exc from cause
        except BaseException as caught:  # noqa: BLE001
            return caught

    assert bench.classify(raised(torch.OutOfMemoryError("CUDA out of memory"))) == (bench.OOM, bench.DEVICE_LIMIT)
    wrapped = raised(RuntimeError("step failed"), torch.OutOfMemoryError("CUDA out of memory"))
    assert bench.classify(wrapped) == (bench.OOM, bench.DEVICE_LIMIT)
    assert bench.classify(raised(MemoryError())) == (bench.OOM, bench.HOST_LIMIT)
    assert bench.classify(raised(RuntimeError("CUDA error: out of memory when pinning host memory"))) == (
        bench.OOM, bench.HOST_LIMIT)
    assert bench.classify(raised(RuntimeError("CUDA error: out of memory"))) == (bench.OOM, bench.DEVICE_LIMIT)
    # cuBLAS's own allocation, outside torch's allocator, on a device torch's cache has filled.
    cublas = RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`")
    assert bench.classify(raised(cublas)) == (bench.OOM, bench.DEVICE_LIMIT)
    assert bench.classify(raised(RuntimeError("CUDA error: an illegal memory access was encountered"))) == (
        bench.ERROR, "")
    assert bench.classify(raised(ValueError("bad shape"))) == (bench.ERROR, "")


def raise_oom(t: Any, meter: Any) -> dict[str, Any]:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def hang(t: Any, meter: Any) -> dict[str, Any]:
    time.sleep(600)
    return {}


def die_of_sigkill(t: Any, meter: Any) -> dict[str, Any]:
    os.kill(os.getpid(), signal.SIGKILL)
    return {}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize(
    ("runner", "timeout_s", "outcome", "limit"),
    [(raise_oom, 120, bench.OOM, bench.DEVICE_LIMIT), (hang, 3, bench.TIMEOUT, ""), (die_of_sigkill, 120, bench.OOM, bench.HOST_LIMIT)],
    ids=["oom", "timeout", "sigkill"],
)
def test_a_failed_try_is_a_result_and_leaves_no_process(runner: Any, timeout_s: float, outcome: str, limit: str) -> None:
    t = bench.Try("qwen3-1.7b", "ringtrain", "cpu", True, GRANULE, 1)
    out = bench.run_try(t, timeout_s, runner=runner)
    assert out["outcome"] == outcome, out
    assert out["limit"] == limit
    assert not alive(out["pid"])
    if runner is raise_oom:
        assert "Tried to allocate" in out["error"]
        assert out["host_peak_rss_bytes"] > 0


def test_a_try_predicted_past_the_budget_is_not_run() -> None:
    """Device time is the scarce thing: a search whose next try the planner predicts to outlast
    what is left of its share ends there, saying so, and starts no process."""
    from types import SimpleNamespace

    step = SimpleNamespace(step_s=500.0)
    plan = SimpleNamespace(machine=SimpleNamespace(device_type="cuda", cap_bytes=None),
                           at=lambda system, n: SimpleNamespace(step=step, layout=None), refusal=lambda *_: "")
    args = SimpleNamespace(steps=2, try_timeout=900.0, tiny=False, granule=1024)
    searcher = bench.Searcher(plan, "ringtrain", args, deadline=time.monotonic() + 600)  # type: ignore[arg-type]
    assert searcher.oracle(2**20) is None
    assert searcher.tries == []
    assert searcher.stopped.startswith("budget: a try at 1,048,576 tokens is predicted to take 1,025 s")


def _h200(cap_gb: Optional[float], host_gb: float, headroom: float = 0.0) -> Any:
    """The GPU tier's node as the planner sees it: an H200 (140 GB), a cap, a host of ``host_gb``."""
    host = int(host_gb * bench.GB)
    cap = None if cap_gb is None else int(cap_gb * bench.GB)
    return bench.Machine("cuda", "NVIDIA H200", 140 * bench.GB, cap, int(host * (1 - headroom)), headroom, host)


def test_a_try_the_host_memory_does_not_allow_is_not_run() -> None:
    """An 8B model's smallest layout offloads 145 GB of state: a 128 GiB host (the H200 node's)
    does not hold it, and no process is started to find that out; a try without offloads runs."""
    from types import SimpleNamespace

    plan = bench.plan_shape("llama3-8b", _h200(None, 128 * 2**30 / bench.GB, headroom=0.1), False, 1024)
    assert plan.start("ringtrain") is None
    why = plan.first_refusal("ringtrain", 1024)
    assert why.startswith("host memory: a try at 1,024 tokens") and "offload" in why, why
    args = SimpleNamespace(granule=1024, growth=1.25, max_tries=6, tolerance_edges=True, peaks_at=[], steps=2,
                           try_timeout=60.0, tiny=False)
    searched = bench.search_system(plan, "ringtrain", args, 0.0, {})  # a try would fail: no CUDA here
    assert searched["tries"] == [] and searched["stopped"] == why and searched["max_seq_len"] == 0
    one_b = bench.plan_shape("llama3.2-1b", _h200(26, 0), False, 1024)
    assert one_b.first_refusal("ringtrain", 1024) == one_b.first_refusal("hf", 1024) == ""


def test_nothing_fits_at_one_granule_by_more_than_the_tolerance_is_not_tried() -> None:
    plan = bench.plan_shape("llama3-8b", _h200(26, 0), False, 1024)
    why = plan.first_refusal("hf", 1024)
    assert why.startswith("nothing fits: at 1,024 tokens") and "more than 10%" in why, why
    # Within the tolerance of the memory the planner may be wrong: that is tried.
    cand = plan.at("hf", 1024)
    assert plan.refusal(1024, cand, 1024)
    assert not dataclasses.replace(plan, machine=dataclasses.replace(
        plan.machine, cap_bytes=int(cand.memory.total / 1.05))).refusal(1024, cand, 1024)


def test_a_cuda_try_is_held_to_the_cap_and_a_peak_past_it_is_out_of_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each try under --memory-gb asks the allocator for the cap's share of the device; where its
    reserved peak still ends past the cap, the cap did not hold, and the try did not fit."""
    from types import SimpleNamespace

    plan = bench.plan_shape("llama3.2-1b", _h200(26, 0), False, 1024)
    args = SimpleNamespace(granule=1024, steps=2, try_timeout=60.0, tiny=False)
    searcher = bench.Searcher(plan, "hf", args, deadline=time.monotonic() + 600)
    ran: list[Any] = []
    reserved = {4096: 25 * bench.GB, 5120: 27 * bench.GB}

    def fake_try(t: Any, timeout_s: float, runner: Any = None) -> dict[str, Any]:
        ran.append(t)
        return {"outcome": bench.OK, "step_s": [0.1, 0.1], "wall_s": 20.0, "peak_device_bytes": 24 * bench.GB,
                "peak_reserved_bytes": reserved[t.seq_len], "pid": 0}

    monkeypatch.setattr(bench, "run_try", fake_try)
    assert searcher.oracle(4096) is True
    assert searcher.oracle(5120) is False
    assert [t.memory_fraction for t in ran] == [26 / 140] * 2
    assert searcher.tries[1]["outcome"] == bench.OOM and searcher.tries[1]["over_cap"]
    assert searcher.starts == {"hf": pytest.approx(19.8)}  # the next search of hf expects this start


ILLEGAL_ACCESS = "RuntimeError: CUDA error: an illegal memory access was encountered"


def tries_that(fit_up_to: int, past_it: str) -> Any:
    """A run_try whose tries fit up to ``fit_up_to`` tokens and end in ``past_it`` above it."""
    def run_try(t: Any, timeout_s: float, runner: Any = None) -> dict[str, Any]:
        if t.seq_len <= fit_up_to:
            return {"outcome": bench.OK, "step_s": [0.1, 0.1], "wall_s": 20.0, "peak_device_bytes": 20 * bench.GB,
                    "peak_reserved_bytes": 20 * bench.GB, "pid": 0}
        error = f"Traceback (most recent call last):\n  File \"trainer.py\", line 1\n{ILLEGAL_ACCESS}"
        limit = bench.DEVICE_LIMIT if past_it == bench.OOM else ""
        return {"outcome": past_it, "limit": limit, "error": error, "wall_s": 20.0, "pid": 0}

    return run_try


@pytest.mark.parametrize("past_it", [bench.ERROR, bench.OOM])
def test_an_error_ends_the_search_where_out_of_memory_narrows_it(monkeypatch: pytest.MonkeyPatch,
                                                                 past_it: str) -> None:
    """A crash (an error that is not out of memory) says nothing of whether a length fits: the
    search stops at it and claims no failure from it. Out of memory is a result: the search
    brackets the max with it and goes on to converge."""
    from types import SimpleNamespace

    plan = bench.plan_shape("llama3.2-1b", _h200(26, 0), False, GRANULE)
    first = plan.first_length("hf", GRANULE)
    monkeypatch.setattr(bench, "run_try", tries_that(first, past_it))
    args = SimpleNamespace(granule=GRANULE, growth=1.25, max_tries=6, tolerance_edges=False, peaks_at=[], steps=2,
                           try_timeout=60.0, tiny=False)
    searched = bench.search_system(plan, "hf", args, 600.0, {})
    second = searched["tries"][1]["seq_len"]
    assert searched["max_seq_len"] == first
    if past_it == bench.ERROR:
        assert len(searched["tries"]) == 2 and searched["failed_at"] is None
        assert searched["stopped"] == f"error at {second:,} tokens: {ILLEGAL_ACCESS}"
        assert not searched["converged"]
    else:
        assert searched["failed_at"] == first + GRANULE and searched["stopped"] == "converged"
        assert searched["tries"][1]["outcome"] == bench.OOM and len(searched["tries"]) > 2


def test_a_try_that_ends_in_an_error_fails_the_run_after_its_json(monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Every try errs: each search stops at its first try, nothing is claimed (the targets are
    not measured, saying why), the JSON lists the errors, and the run exits 1."""
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # main sets it where unset
    monkeypatch.setattr(bench, "run_try", tries_that(0, bench.ERROR))
    out = tmp_path / "max_context.json"
    assert bench.main(["--device", "cpu", "--tiny", "--shapes", "qwen3-1.7b", "--out", str(out)]) == 1
    record = json.loads(out.read_text())
    systems = record["shapes"]["qwen3-1.7b"]["systems"]
    assert [len(systems[s]["tries"]) for s in ("hf", "ringtrain")] == [1, 1]
    assert all(s["max_seq_len"] == 0 and s["failed_at"] is None for s in systems.values())
    assert [e.split(" at ")[0] for e in record["errors"]] == ["qwen3-1.7b/hf", "qwen3-1.7b/ringtrain"]
    assert all(e.endswith(ILLEGAL_ACCESS) for e in record["errors"])
    ratio = next(t for t in record["targets"] if t["what"] == "ringtrain max / hf max")
    assert ratio["value"] is None and "hf found no length that fits (error at" in ratio["missing"]
    prediction = next(t for t in record["targets"] if t["what"].startswith("|planner's predicted max"))
    assert prediction["value"] is None and prediction["missing"].startswith("the search measured nothing (error at")
    assert "failed: a try ended in an error" in capsys.readouterr().err


@pytest.mark.parametrize(("name", "cap_gb", "host_gb", "held"), [
    ("NVIDIA H100 80GB HBM3", None, None, True),
    ("NVIDIA H100 80GB HBM3", 26, None, False),  # the GPU tier's cap
    ("NVIDIA H100 80GB HBM3", None, 0, False),  # no host memory to offload to
    ("NVIDIA H100 80GB HBM3", 200, None, True),  # a cap past the device is none
    ("NVIDIA H200", None, None, False),
])
def test_the_million_token_target_is_held_only_on_a_whole_h100(name: str, cap_gb: Optional[float],
                                                                host_gb: Optional[float], held: bool) -> None:
    total = 80 * bench.GB
    cap = None if cap_gb is None else int(cap_gb * bench.GB)
    host_cap = None if host_gb is None else int(host_gb * bench.GB)
    host = 2 * 10**12 if host_cap is None else host_cap
    machine = bench.Machine("cuda", name, total, cap, host, 0.1, host, host_cap)
    rt = {"max_seq_len": 40960, "failed_at": 41984, "tries": [{}], "stopped": "converged"}
    summary = {"predicted_max_error": 0.0, "predicted_max_undecided": "", "peak_measured_at": [],
               "peak_within_tolerance_at": []}
    whats = [t.what for t in bench.targets_for("llama3.2-1b", machine, summary, {"ringtrain": rt})]
    assert ("ringtrain max on an H100" in whats) == held


# ---- the budget's split ------------------------------------------------------------------------


def test_a_search_gets_a_share_in_proportion_to_its_predicted_cost() -> None:
    assert bench.share_of(90.0, 30.0, [60.0]) == pytest.approx(30.0)
    assert bench.share_of(90.0, 60.0, []) == 90.0  # the last search: all that is left
    assert bench.share_of(90.0, 0.0, [0.0, 0.0]) == pytest.approx(30.0)  # no costs: equal parts
    # A cheap search first holds a third of the budget, not half, where an expensive one comes after.
    assert bench.share_of(600.0, 100.0, [200.0]) < 600.0 / 2


def test_a_searchs_cost_is_its_tries_at_the_planners_step_time() -> None:
    from types import SimpleNamespace

    plan = bench.plan_shape("llama3.2-1b", _h200(26, 0), False, 1024)
    args = SimpleNamespace(granule=1024, max_tries=2, steps=2, peaks_at=[8192])
    first = plan.first_length("ringtrain", 1024)
    step = plan.at("ringtrain", first).step.step_s
    # Two tries at the first length, each two steps and a start, and the --peaks-at try before them.
    assert bench.search_cost_s(plan, "ringtrain", args, 25.0) == pytest.approx(
        2 * (2 * step + 25.0) + 2 * plan.at("ringtrain", 8192).step.step_s + 25.0)
    hf_step = plan.at("hf", plan.first_length("hf", 1024)).step.step_s
    assert bench.search_cost_s(plan, "hf", args, 15.0) == pytest.approx(2 * (2 * hf_step + 15.0))


# The GPU tier's max_context part on an H200 (26 GB cap, no host memory, no headroom, granule 512,
# two tries at the tolerance's edges): the planner's step times with liger's kernels, and the
# seconds a try spends outside its steps (train-nvidia-h200.json).
TIER_START = {"hf": 3584, "ringtrain": 44544}
TIER_STEP_S = {"hf": {3584: 0.5, 4096: 0.5}, "ringtrain": {44544: 2.37, 49664: 2.79}}
TIER_PROCESS_START_S = {"hf": 15.0, "ringtrain": 23.0}
TIER_PROBE_S = 6.0
STEP_SLACK = 1.2  # the steps run 20% over the planner's estimate (the first step's compile)


class TierPlan(bench.ShapePlan):
    """Llama-3.2-1B as the tier's planner saw it: its starts and step times, every try allowed."""

    def start(self, system: str) -> Optional[int]:
        return TIER_START[system]

    def at(self, system: str, seq_len: int) -> Any:
        from types import SimpleNamespace

        layout = SimpleNamespace(overrides=lambda: (), checkpointing_mode="full", describe=lambda: "the planner's")
        return SimpleNamespace(step=SimpleNamespace(step_s=TIER_STEP_S[system][seq_len]), layout=layout,
                               memory=SimpleNamespace(total=20 * bench.GB, host=0), fits=True)

    def refusal(self, seq_len: int, cand: Any, granule: int) -> str:
        return ""

    def predicted(self, layout: Any, seq_len: int, checkpointing: str) -> Any:
        return self.at("ringtrain", seq_len)


def tier_searches(budget_s: float, monkeypatch: pytest.MonkeyPatch) -> dict[str, dict[str, Any]]:
    """The tier's two searches of the 1B shape on a clock the tries advance, every try fitting."""
    from types import SimpleNamespace

    clock = SimpleNamespace(now=0.0)
    monkeypatch.setattr(bench, "time", SimpleNamespace(monotonic=lambda: clock.now))

    def run_try(t: Any, timeout_s: float, runner: Any = None) -> dict[str, Any]:
        step_s = [STEP_SLACK * TIER_STEP_S[t.system][t.seq_len]] * t.steps
        wall_s = TIER_PROCESS_START_S[t.system] + sum(step_s)
        clock.now += min(wall_s, timeout_s)
        if wall_s > timeout_s:
            return {"outcome": bench.TIMEOUT, "limit": "", "error": "cut", "wall_s": timeout_s, "pid": 0}
        return {"outcome": bench.OK, "step_s": step_s, "wall_s": wall_s, "peak_device_bytes": 20 * bench.GB,
                "peak_reserved_bytes": 20 * bench.GB, "pid": 0}

    monkeypatch.setattr(bench, "run_try", run_try)
    real = bench.plan_shape("llama3.2-1b", _h200(26, 0), False, 512)
    plan = TierPlan(**{f.name: getattr(real, f.name) for f in dataclasses.fields(real)})
    args = SimpleNamespace(granule=512, growth=1.25, max_tries=2, tolerance_edges=True, peaks_at=[], steps=2,
                           try_timeout=60.0, tiny=False)
    budget = bench.Budget(budget_s)
    clock.now += TIER_PROBE_S
    starts: dict[str, float] = {}
    searches = [("llama3.2-1b", "hf"), ("llama3.2-1b", "ringtrain")]
    schedule = bench.Schedule(budget, {"llama3.2-1b": plan}, args, searches, starts)
    return {system: bench.search_system(plan, system, args, schedule.share("llama3.2-1b", system), starts)
            for system in ("hf", "ringtrain")}


def test_the_gpu_tiers_budget_for_two_tries_a_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two tries a search with the steps 20% over the planner's: the probe (6 s), hf's two tries
    (16.2 s each), ringtrain's at 44,544 (23 + 2 x 2.84 s) and at the edge, 49,664 (23 + 2 x
    3.35 s): 96.8 s. A budget a second short cuts ringtrain's second try (the planner's 2.79 s
    steps let it start, and it runs past the share)."""
    enough = tier_searches(97.0, monkeypatch)
    assert [len(enough[s]["tries"]) for s in ("hf", "ringtrain")] == [2, 2]
    assert [r["seq_len"] for r in enough["ringtrain"]["tries"]] == [44544, 49664]
    assert enough["ringtrain"]["stopped"] == "max tries"
    short = tier_searches(96.0, monkeypatch)
    assert short["ringtrain"]["stopped"] == "budget: the try at 49,664 tokens ran past the end of this search's share"
    # At 95 s the second try is not even started: what is left is under the planner's 28.6 s.
    assert tier_searches(95.0, monkeypatch)["ringtrain"]["stopped"].startswith("budget: a try at 49,664 tokens")


# ---- the shapes, and bad input ----------------------------------------------------------------


@pytest.mark.parametrize("name", list(bench.SHAPES))
@pytest.mark.parametrize("tiny", [True, False])
def test_every_shape_is_a_valid_job_and_hf_config(name: str, tiny: bool) -> None:
    import transformers

    from ringtrain.hf.hfconfig import hf_config

    t = bench.Try(name, "hf", "cpu", tiny, 4096, 1)
    job = bench.load_job(t)
    shape = bench.SHAPES[name]
    assert job.model_int("dim") == t.model["dim"]
    config_class = getattr(transformers, shape.hf_config)
    source = {"architectures": [shape.hf_model], "model_type": config_class.model_type}
    config = config_class.from_dict(hf_config(job.model, source, trained_seq_len=t.seq_len, dtype="bf16"))
    assert config.num_hidden_layers == t.model["n_layers"]
    assert config.tie_word_embeddings == bool(t.model.get("tie_embeddings"))


def test_bad_input_exits_2_naming_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--device", "cpu"]) == 2
    assert "--tiny" in capsys.readouterr().err
    for argv, flag in ((["--shapes", "llama3.2-1b,gpt2"], "--shapes: gpt2"), (["--peaks-at", "1k"], "--peaks-at"),
                       (["--growth", "1"], "--growth"), (["--memory-gb", "0"], "--memory-gb"),
                       (["--host-memory-gb", "0"], "--host-memory-gb")):
        with pytest.raises(SystemExit) as exited:
            bench.parse_args(["--device", "cpu", "--tiny", *argv])
        assert exited.value.code == 2
        assert flag in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message a machine without CUDA gets")
def test_without_cuda_it_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main([]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


# ---- end to end -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "max_context.json"
    # The budget is not under test here: room for a busy machine, inside pytest's 600 s.
    done = run_bench("max_context.py", "--device", "cpu", "--tiny", "--shapes", "qwen3-1.7b", "--budget-s", "450",
                     "--out", str(out), timeout=540)
    return {"record": json.loads(out.read_text()), "stdout": done.stdout}


@pytest.mark.slow
def test_smoke_finds_the_boundary_the_cap_sets(smoke: dict[str, Any]) -> None:
    record = smoke["record"]
    cap = record["machine_memory"]["cap_bytes"]
    shape = record["shapes"]["qwen3-1.7b"]
    for system in ("hf", "ringtrain"):
        s = shape["systems"][system]
        tries = {r["seq_len"]: r for r in s["tries"]}
        assert s["converged"], (system, s["stopped"], list(tries))
        assert s["failed_at"] - s["max_seq_len"] == record["config"]["granule"]
        longest, failed = tries[s["max_seq_len"]], tries[s["failed_at"]]
        assert longest["outcome"] == "ok" and longest["peak_device_bytes"] <= cap
        # Out of memory is a recorded result: the try over the cap, with what it measured.
        assert failed["outcome"] == "oom" and failed["over_cap"] and failed["peak_device_bytes"] > cap
        for r in s["tries"]:
            assert (r["outcome"] == "ok") == (r["peak_device_bytes"] <= cap), r
            assert len(r["step_s"]) == 2 and r["host_peak_rss_bytes"] > 0
            assert not alive(r["pid"]), f"try process {r['pid']} outlived the bench"
    assert shape["ratio"] == shape["systems"]["ringtrain"]["max_seq_len"] / shape["systems"]["hf"]["max_seq_len"]
    assert bench.SMOKE in smoke["stdout"]
    assert record["git"]["commit"] and record["device_type"] == "cpu"


@pytest.mark.slow
def test_smoke_ringtrain_runs_and_predicts_the_planners_layout(smoke: dict[str, Any]) -> None:
    """Each ringtrain try runs the layout the planner picked for its length, and the planner's
    peak for it is the measured one's order: a try that ran another layout, dtype or mode than
    the one predicted for lands far off (fp32 against bf16 alone is 2x)."""
    shape = smoke["record"]["shapes"]["qwen3-1.7b"]
    start = shape["systems"]["ringtrain"]["start"]
    assert start == shape["planner"]["reach"]["max_seq_len"] // 256 * 256
    for r in shape["systems"]["ringtrain"]["tries"]:
        assert f"model.activation_checkpointing={r['planned_checkpointing']}" in r["overrides"]
        assert r["checkpointing"] == r["planned_checkpointing"]
        assert 0.8 < r["predicted_peak_bytes"] / r["peak_device_bytes"] < 1.25, r


# ---- the planner's side (ringtrain.planner.reach) ---------------------------------------------


def llama_1b_on(memory_bytes: int, host_bytes: int) -> tuple[Any, Any, Any]:
    from ringtrain.planner.layout import workload_of
    from ringtrain.planner.reach import device_seen
    from ringtrain.planner.search import Cluster
    from ringtrain.planner.throughput import Assumptions

    job = bench.load_job(bench.Try("llama3.2-1b", "ringtrain", "cuda", False, 4096, 1))
    device = device_seen("NVIDIA H100 80GB HBM3", memory_bytes, host_bytes)
    return workload_of(job, "cuda"), Cluster(device, gpus=1, gpus_per_node=1), Assumptions(gpus_per_node=1)


def test_device_seen_keeps_the_tables_speeds_and_takes_the_memory_measured() -> None:
    from ringtrain.planner.devices import H100, H200
    from ringtrain.planner.reach import device_seen

    h100 = device_seen("NVIDIA H100 80GB HBM3", 85_520_000_000, 10**11)
    assert (h100.memory_bytes, h100.host_memory_bytes, h100.peak_flops) == (85_520_000_000, 10**11, H100.peak_flops)
    assert device_seen("NVIDIA H200", 1, 1).pcie_bw == H200.pcie_bw
    assert device_seen("cpu", 1, 0, cpu_cores=2).peak_flops < H100.peak_flops / 1000


def test_recipe_reach_is_the_planners_reach_for_that_layout() -> None:
    """The longest sequence of one fixed layout, against search.max_seq_len's for the same rung."""
    from ringtrain.planner.reach import recipe_reach
    from ringtrain.planner.search import max_seq_len

    workload, cluster, assume = llama_1b_on(80 * 10**9, 10**12)
    layout = bench.hf_layout()
    mine = recipe_reach(workload, layout, cluster, assume)
    theirs = [r for r in max_seq_len(workload, cluster, assume) if r.candidate.layout == layout]
    assert mine is not None and len(theirs) == 1
    assert mine.max_seq_len == theirs[0].max_seq_len
    assert mine.candidate.fits


def test_pick_is_the_plans_first_layout_and_past_the_reach_the_leanest() -> None:
    import dataclasses

    from ringtrain.planner.reach import DEVICE, HOST, binding_limit, longest, pick
    from ringtrain.planner.search import search

    workload, cluster, assume = llama_1b_on(80 * 10**9, 10**12)
    reach = longest(workload, cluster, assume)
    assert reach is not None
    short = pick(workload, cluster, assume, 32768, leanest=reach.candidate.layout)
    assert short.layout == search(dataclasses.replace(workload, seq_len=32768), cluster, assume)[0].layout
    assert short.fits
    past = 2 * reach.max_seq_len
    beyond = pick(workload, cluster, assume, past, leanest=reach.candidate.layout)
    assert not beyond.fits
    assert dataclasses.replace(beyond.layout, mlp_tiles=1) == dataclasses.replace(reach.candidate.layout, mlp_tiles=1)
    assert beyond.memory.total > reach.candidate.memory.total
    assert DEVICE in binding_limit(beyond.memory, cluster)
    # With little host memory the offloads that reach far no longer fit: the host binds.
    _, small_host, _ = llama_1b_on(80 * 10**9, 10**9)
    assert HOST in binding_limit(reach.candidate.memory, small_host)
    assert binding_limit(short.memory, cluster) == ()
