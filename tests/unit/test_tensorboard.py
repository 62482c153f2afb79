"""TensorBoardSink: the event files it writes, read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ringtrain.status import PREFERENCE_METRICS
from ringtrain.telemetry.tensorboard import INCIDENT_COUNT_TAG, SCALAR_TAGS, TensorBoardSink
from ringtrain_dev.fake_run import NAN_INCIDENT, step_record


def load(run_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def steps_and_values(events: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_every_scalar_is_written_at_its_step(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    # A preference run's records, which carry its objective's metrics besides the rest.
    records = [step_record(step, **{name: step + i / 8 for i, name in enumerate(PREFERENCE_METRICS)}) for step in (1, 2)]
    for r in records:
        sink.step(r)
    sink.incident(NAN_INCIDENT)
    sink.close()

    events = load(tmp_path)
    scalars = set(events.Tags()["scalars"])
    assert set(SCALAR_TAGS.values()) <= scalars
    for key, tag in SCALAR_TAGS.items():
        assert steps_and_values(events, tag) == [(r["step"], pytest.approx(r[key], rel=1e-6)) for r in records], tag
    for rank in range(4):
        assert steps_and_values(events, f"step_time/rank_{rank}") == [
            (r["step"], pytest.approx(r["rank_step_time_s"][rank], rel=1e-6)) for r in records
        ]
        assert f"memory_bytes/rank_{rank}" in scalars
    assert "step_time/rank_4" not in scalars
    assert steps_and_values(events, INCIDENT_COUNT_TAG) == [(3, 1.0)]


def test_the_incident_text_names_kind_ranks_reason_and_verdict(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.incident(NAN_INCIDENT)
    sink.incident({**NAN_INCIDENT, "id": 2, "kind": "hang", "detected_at_step": 7, "verdict": None})
    sink.close()

    events = load(tmp_path)
    assert steps_and_values(events, INCIDENT_COUNT_TAG) == [(3, 1.0), (7, 2.0)]
    (tag,) = events.Tags()["tensors"]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in events.Tensors(tag)]
    assert [step for step, _ in texts] == [3, 7]
    first = texts[0][1]
    assert "incident 1: nan" in first and "ranks: [1]" in first and "action: abort" in first
    assert "non-finite loss" in first and "culprit_rank 1" in first and "op all_reduce" in first
    assert "    in all_reduce" in first  # the stack, as a Markdown code block
    assert "incident 2: hang" in texts[1][1] and "verdict" not in texts[1][1]


def test_absent_values_are_left_out_and_nan_is_kept(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    partial = step_record(1, loss=math.nan, mfu=None, goodput="n/a", dp=True)
    del partial["persist_s"], partial["rank_memory_bytes"]
    sink.step(partial)
    sink.close()

    events = load(tmp_path)
    scalars = set(events.Tags()["scalars"])
    assert {"throughput/mfu", "run/goodput", "mesh/dp", "checkpoint/persist_s"}.isdisjoint(scalars)
    assert not any(tag.startswith("memory_bytes/") for tag in scalars)
    (loss,) = events.Scalars("train/loss")
    assert loss.step == 1 and math.isnan(loss.value)


def test_nothing_is_written_before_the_first_step_nor_after_close(tmp_path: Path) -> None:
    sink = TensorBoardSink(tmp_path)
    sink.close()
    assert not (tmp_path / "tensorboard").exists()

    sink = TensorBoardSink(tmp_path)
    sink.step(step_record(1))
    sink.close()
    sink.step(step_record(2))
    sink.incident(NAN_INCIDENT)
    sink.close()
    events = load(tmp_path)
    assert [e.step for e in events.Scalars("train/loss")] == [1]
    assert INCIDENT_COUNT_TAG not in events.Tags()["scalars"]


def test_the_driver_writes_events_without_importing_torch(tmp_path: Path) -> None:
    # The sink runs in the driver, which has no other use for torch: importing it there would
    # cost every run seconds of CPU before its cluster starts.
    code = (
        "import sys; from pathlib import Path; from ringtrain.telemetry.tensorboard import TensorBoardSink; "
        "from ringtrain_dev.fake_run import NAN_INCIDENT, step_record; "
        "sink = TensorBoardSink(Path(sys.argv[1])); sink.step(step_record(1)); sink.incident(NAN_INCIDENT); sink.close(); "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))"
    )
    repo = Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=repo, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
    assert [e.step for e in load(tmp_path).Scalars("train/loss")] == [1]
