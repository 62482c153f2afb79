"""Evaluation during training (``eval.every``) against a scripted group: which steps' records
carry an ``"eval"`` entry, and how TensorBoard and the report show it. No Ray, no torch."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ringtrain import config
from ringtrain.actors.controller import Controller
from ringtrain.actors.steps import StepResult
from ringtrain.evaluation.generation import GenerationRequest
from ringtrain.evaluation.tally import LossTally
from ringtrain.status import StepReport, WorkerInfo
from ringtrain.telemetry.report import write_report
from ringtrain.telemetry.rundir import RunDir
from ringtrain.telemetry.tensorboard import TensorBoardSink, eval_scalars
from ringtrain.topology import Topology
from ringtrain.train.data import IGNORE_INDEX
from ringtrain.train.evalset import EvalSet

BUCKET = 4


class EvaluatingGroup:
    """One rank that trains in no time; it scores position p's prediction as loss 1 + p / 100
    and answers passkey prompts by copying what followed the key's sentence."""

    # What the Group protocol asks beyond the steps: no phases, one world, no holders, from step 0.
    startup: dict[str, float] = {}
    phases: dict[str, float] = {}
    generation = 1
    holders: dict[str, Any] = {}
    start_step = 0

    def __init__(self) -> None:
        self.num_params = 1
        self.infos = [WorkerInfo(rank=0, host="h", pid=1, device="cpu")]
        self.topology = Topology(dp=1, cp=1)
        self.step = 0
        self.evaluated_after: list[int] = []

    def start(self) -> None:
        pass

    def safe_through(self, wait_s: float = 0.0) -> int:
        return self.step

    def train_step(self, probe: bool = False, on_safe: Optional[Callable[[int], None]] = None) -> StepResult:
        self.step += 1
        return StepResult(reports=(StepReport(step=self.step, rank=0, loss=1.0, local_loss=1.0, lr=1e-3, grad_norm=1.0,
                           num_tokens=8, step_time_s=0.01, samples=(self.step,)),))

    def evaluate(self, evalset: EvalSet, bucket_tokens: int) -> LossTally:
        self.evaluated_after.append(self.step)
        tally = LossTally(bucket_tokens)
        for row in range(evalset.num_rows):
            for p in np.nonzero(evalset.labels[row] != IGNORE_INDEX)[0]:
                tally.add(int(p), 1.0 + int(p) / 100)
        return tally

    def generate(self, request: GenerationRequest) -> list[list[int]]:
        marker = list(b"The pass key is")
        out = []
        for ids in map(list, request.prompts):
            start = next(i for i in range(len(ids)) if ids[i : i + len(marker)] == marker) + len(marker)
            out.append(ids[start : start + request.max_new])
        return out

    def snapshot_refs(self, step: int) -> list[Any]:
        return []

    def pin_snapshots(self, step: int) -> None:
        pass

    def restore(self, blobs: list[bytes]) -> int:
        raise AssertionError("not resumed")

    def shutdown(self) -> None:
        pass


def _run(tmp_path: Path) -> tuple[Path, EvaluatingGroup, dict[str, Any]]:
    rows = tmp_path / "rows.npy"
    np.save(rows, np.arange(2 * 20).reshape(2, 20) % 200)
    job = config.load(None, [
        "train.steps=5", "checkpoint.snapshot_every=0", "controllers.sdc_every_steps=0",
        "eval.every=2", f"eval.data={rows}", f"eval.bucket_tokens={BUCKET}", "eval.passkey=[260,300]",
        "eval.passkey_depths=[0,1]",
    ])  # fmt: skip
    run_dir = tmp_path / "run"
    group = EvaluatingGroup()
    summary = Controller(job, group, RunDir(run_dir), sinks=[TensorBoardSink(run_dir)]).run()
    return run_dir, group, summary


def test_eval_every_adds_eval_to_those_steps_records(tmp_path: Path) -> None:
    run_dir, group, summary = _run(tmp_path)
    assert summary["status"] == "finished"
    assert group.evaluated_after == [2, 4, 5]  # on the cadence, and after the last step
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # still one line per step
    assert [r["step"] for r in records if "eval" in r] == [2, 4, 5]
    ev = records[1]["eval"]
    expected = sum(1.0 + p / 100 for p in range(19)) / 19
    assert ev["tokens"] == 2 * 19 and math.isclose(ev["loss"], expected, rel_tol=1e-12)
    assert math.isclose(ev["perplexity"], math.exp(expected))
    assert [(b["start"], b["end"]) for b in ev["by_position"]] == [(0, 4), (4, 8), (8, 16), (16, 32)]
    assert sum(b["tokens"] for b in ev["by_position"]) == ev["tokens"]
    assert ev["passkey"]["overall"] == 1.0 and ev["passkey"]["lengths"] == [260, 300]
    assert ev["seconds"] >= 0 and ev["rows"] == 2 and ev["seq_len"] == 20
    assert summary["eval"] == {"step": 5, "loss": ev["loss"], "perplexity": ev["perplexity"], "tokens": 38}

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert [e.step for e in events.Scalars("eval/loss")] == [2, 4, 5]
    assert {"eval/loss_by_position/0000000-0000004", "eval/loss_by_position/0000016-0000032", "eval/passkey/len_0000260"} <= set(tags)

    path, _ = write_report(run_dir)
    page = path.read_text()
    for anchor in ('id="evaluation"', 'id="chart-eval-loss"', 'id="chart-eval-position"', 'id="eval-buckets"', 'id="passkey-grid"'):
        assert anchor in page, anchor
    assert ">16-32<" in page and "after step 5" in page


def test_eval_scalars_skip_what_is_missing() -> None:
    assert eval_scalars({}) == {}
    found = eval_scalars({"loss": 2.0, "by_position": [{"start": 1024, "end": 2048, "loss": None}, "junk"], "passkey": {"by_length": {"512": 0.5}}})
    assert found == {"eval/loss": 2.0, "eval/passkey/len_0000512": 0.5}


def test_a_report_without_evaluations_has_no_eval_section(tmp_path: Path) -> None:
    run = RunDir(tmp_path)
    run.append_metrics({"step": 1, "loss": 1.0})
    run.close()
    assert 'id="evaluation"' not in write_report(tmp_path)[0].read_text()


def test_eval_tasks_reach_the_records_tensorboard_trackers_and_report(tmp_path: Path) -> None:
    """eval.tasks without eval.data: each evaluation's lm-eval results by task (here a stand-in
    for lm-eval that counts its calls) in the step's record, TensorBoard and the trackers' scalars
    under comma-free tags, and the report's task table."""
    from ringtrain.actors.evaluation import EvalPlan
    from ringtrain.evaluation.text import ByteTokenizer
    from ringtrain.telemetry.tensorboard import record_scalars

    calls: list[int] = []

    def tasks(group: Any) -> dict[str, dict[str, Any]]:
        calls.append(group.step)
        return {"tiny_mc": {"alias": "tiny_mc", "acc,none": 0.25 * len(calls), "acc_stderr,none": 0.1},
                "tiny_gen": {"exact_match,strict-match": 0.5}}

    job = config.load(None, ["train.steps=4", "checkpoint.snapshot_every=0", "controllers.sdc_every_steps=0",
                             "eval.every=2", "eval.tasks=[tiny_mc,tiny_gen]"])
    config.validate(job)
    run_dir = tmp_path / "run"
    plan = EvalPlan(None, BUCKET, ByteTokenizer(), tasks=tasks)
    summary = Controller(job, EvaluatingGroup(), RunDir(run_dir), sinks=[TensorBoardSink(run_dir)], eval_plan=plan).run()
    assert summary["status"] == "finished" and calls == [2, 4]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    ev = records[3]["eval"]
    assert ev["tasks"]["tiny_mc"]["acc,none"] == 0.5 and "loss" not in ev
    scalars = record_scalars(records[3])
    assert scalars["eval/tasks/tiny_mc/acc"] == 0.5 and scalars["eval/tasks/tiny_gen/exact_match/strict-match"] == 0.5
    assert not any("stderr" in tag or "," in tag or "alias" in tag for tag in scalars)

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("eval/tasks/tiny_mc/acc")] == [(2, 0.25), (4, 0.5)]
    page = write_report(run_dir)[0].read_text()
    assert 'id="eval-tasks"' in page and "exact_match,strict-match" in page


def test_eval_tasks_read_the_models_tokenizer_at_the_first_evaluation_alone(monkeypatch: Any) -> None:
    """eval.tasks run at every evaluation of a run: the model folder's tokenizer is loaded for the
    first and the same one speaks for every later one."""
    from ringtrain.commands import eval_tasks

    loaded: list[str] = []
    spoken: list[object] = []

    def load(folder: str) -> object:
        loaded.append(folder)
        return object()

    def run(plan: Any, group: Any, tokenizer: object) -> dict[str, Any]:
        spoken.append(tokenizer)
        return {"results": {}}

    monkeypatch.setattr(eval_tasks, "hf_tokenizer", load)
    monkeypatch.setattr(eval_tasks, "run_tasks", run)
    tasks = eval_tasks.TrainingTasks(plan=None, tokenizer_folder="/models/tiny")  # type: ignore[arg-type]
    for _ in range(3):
        assert tasks(None) == {}
    assert loaded == ["/models/tiny"] and len(spoken) == 3 and len(set(map(id, spoken))) == 1


def test_a_run_with_eval_tasks_reads_the_models_tokenizer_once_at_start_up(tmp_path: Path, monkeypatch: Any) -> None:
    """``ringtrain run``'s eval plan and eval.tasks' check that the model has a tokenizer take one
    read of tokenizer.json between them (lm-eval's task search here a stand-in)."""
    from ringtrain.commands import eval_tasks
    from ringtrain.commands.run import _eval_plan
    from ringtrain.evaluation import tokenizer as tokenizer_module
    from ringtrain_dev.tiny_tokenizer import save_tokenizer
    from tests.unit.test_worker_tokenizer import tokenizer_reads

    folder = str(save_tokenizer(tmp_path / "model"))
    find = tokenizer_module.find_tokenizer
    reads = tokenizer_reads(monkeypatch)
    monkeypatch.setattr(eval_tasks, "plan_tasks", lambda names, **options: names)
    job = config.load(None, ["model.vocab_size=96", f"model.hf={folder}", "eval.every=2", "eval.tasks=[tiny_mc]"])
    plan = _eval_plan(job)
    assert reads == [folder]
    assert plan.tasks is not None and plan.tasks.plan == "tiny_mc" and plan.tokenizer.encode("uvwx") == find(folder).encode("uvwx")
