"""The planner's long-context savers: each lowers the predicted peak, layouts with them round-trip
through the job config, and ``--max-seq-len`` reports the longest sequence per layout."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from ringtrain import config
from ringtrain.planner import command
from ringtrain.planner.devices import H100
from ringtrain.planner.layout import Layout, Workload, layout_of
from ringtrain.planner.memory import estimate
from ringtrain.planner.models import PRESETS
from ringtrain.planner.search import Cluster, max_seq_len
from ringtrain.planner.throughput import Assumptions

WORKLOAD = Workload(PRESETS["llama3-8b"], 131072, global_batch=1)
BASE = Layout(dp=1, ring=8, ulysses=1, zero_stage=3, checkpointing=False)


@pytest.mark.parametrize(
    "saver",
    [
        {"selective": True},
        {"mlp_tiles": 8},
        {"loss_chunk": 1024},
        {"offload_layers": 16},
        {"checkpointing": True},
    ],
)
def test_each_saver_lowers_the_peak(saver: dict[str, object]) -> None:
    plain = estimate(WORKLOAD, BASE)
    saved = estimate(WORKLOAD, dataclasses.replace(BASE, **saver))  # type: ignore[arg-type]
    assert saved.total < plain.total


def test_offload_moves_kept_bytes_to_the_host() -> None:
    ckpt = dataclasses.replace(BASE, checkpointing=True, loss_chunk=1024)
    half = estimate(WORKLOAD, dataclasses.replace(ckpt, offload_layers=16))
    none = estimate(WORKLOAD, ckpt)
    assert half.host - none.host == none.kept_by_layers // 2 and half.kept_by_layers == none.kept_by_layers // 2


def test_chunked_loss_no_longer_grows_with_tokens_times_vocab() -> None:
    def loss(seq: int, chunk: int) -> int:
        w = dataclasses.replace(WORKLOAD, seq_len=seq)
        return estimate(w, dataclasses.replace(BASE, loss_chunk=chunk)).logits_and_loss

    assert (loss(262144, 1024) - loss(131072, 1024)) / (loss(262144, 0) - loss(131072, 0)) <= 0.01


@pytest.mark.parametrize(
    "layout",
    [
        dataclasses.replace(BASE, selective=True, loss_chunk=2048),
        dataclasses.replace(BASE, checkpointing=True, mlp_tiles=4, offload_layers=3, loss_chunk=512),
    ],
)
def test_saver_layouts_round_trip_through_the_job_config(layout: Layout) -> None:
    job = config.load(None, ["model.n_heads=8", "model.dim=256", "data.seq_len=4096", *layout.overrides()])
    assert layout_of(job) == layout


def test_max_seq_len_grows_with_gpus_and_savers() -> None:
    one = max_seq_len(dataclasses.replace(WORKLOAD, seq_len=0), Cluster(H100, 1), Assumptions())
    eight = max_seq_len(dataclasses.replace(WORKLOAD, seq_len=0), Cluster(H100, 8), Assumptions())
    assert one and eight and eight[0].max_seq_len > 4 * one[0].max_seq_len
    plain = [r for r in eight if r.candidate.layout.num_savers == 0]
    assert eight[0].candidate.layout.num_savers > 0 and eight[0].max_seq_len > 2 * plain[0].max_seq_len
    for r in eight[:5]:
        assert r.candidate.fits and r.max_seq_len % (2 * r.candidate.layout.cp) == 0


def _run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="ringtrain")
    command.add_arguments(parser)
    return command.run(parser.parse_args(argv))


def test_max_seq_len_command_prints_the_host_assumption_and_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-8b", "--gpus", "8", "--max-seq-len", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "host memory: 2000 GB per node" in out and "longest:" in out and "max seq" in out
    assert _run(["--model", "llama3-8b", "--gpus", "8", "--max-seq-len", "--json", "--top", "3"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["host_memory_bytes_per_node"] == H100.host_memory_bytes
    assert len(record["layouts"]) == 3 and all(x["max_seq_len"] > 0 for x in record["layouts"])
    assert record["max_seq_len"] == record["layouts"][0]["max_seq_len"]
