"""The planner's long-context savers: each lowers the predicted peak, layouts with them round-trip
through the job config, and ``--max-seq-len`` reports the longest sequence per layout."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from ringtrain import config
from ringtrain.commands import plan as command
from ringtrain.planner.comm import traffic
from ringtrain.planner.devices import GB, H100
from ringtrain.planner.layout import SAVERS, Layout, Workload, layout_of
from ringtrain.planner.memory import OFFLOAD_GRAD_BYTES, estimate
from ringtrain.planner.models import PRESETS
from ringtrain.planner.search import Cluster, layouts, max_seq_len
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
    # The layers' one pair of rotary tables goes once, however many layers saved it (train/offload.py).
    rotary = 4 * WORKLOAD.seq_len // BASE.cp * WORKLOAD.model.head_dim
    assert half.host - none.host == none.kept_by_layers // 2 + rotary
    assert half.kept_by_layers == none.kept_by_layers // 2


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


def test_every_saver_reads_a_layout_field_and_has_a_long_and_a_short_label() -> None:
    fields = {f.name for f in dataclasses.fields(Layout)}
    for saver in SAVERS:
        assert saver.field in fields and saver.label.strip() and saver.short.strip(), saver
    for labels in ([s.field for s in SAVERS], [s.label for s in SAVERS], [s.short for s in SAVERS]):
        assert len(set(labels)) == len(labels), labels
    assert BASE.savers() == []
    for saver in SAVERS:
        alone = dataclasses.replace(BASE, **{saver.field: True if saver.value(BASE) is False else 4})
        assert alone.savers() == [saver] and alone.describe().endswith(", " + saver.describe(alone))


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


ONE_GPU = Layout(dp=1, ring=1, ulysses=1, zero_stage=3, checkpointing=True, loss_chunk=1024)


def test_zero_offload_moves_optimizer_gradients_then_parameters_to_the_host() -> None:
    n = WORKLOAD.model.num_params
    plain = estimate(WORKLOAD, ONE_GPU)
    opt = estimate(WORKLOAD, dataclasses.replace(ONE_GPU, offload_optimizer=True))
    both = estimate(WORKLOAD, dataclasses.replace(ONE_GPU, offload_optimizer=True, offload_params=True))
    # fp32 master, momentum and variance, and (stage 3) the reduced gradient partition leave the GPU.
    assert (opt.optimizer, opt.grads, opt.params) == (0, 0, plain.params)
    assert opt.host - plain.host == 12 * n + OFFLOAD_GRAD_BYTES * n
    # The bf16 partition follows; the gathered working set of the layers in flight stays.
    assert both.params == 0 and both.host - opt.host == 2 * n
    assert both.zero_buffers == plain.zero_buffers > 0 and both.activations == plain.activations


def test_parameter_offload_fetches_every_gather_over_pcie_and_uploads_nothing_per_step() -> None:
    n, prec = WORKLOAD.model.num_params, WORKLOAD.precision(3)
    lay = dataclasses.replace(BASE, checkpointing=True, offload_optimizer=True)
    opt = traffic(WORKLOAD.model, lay, WORKLOAD.seq_len, prec)
    both = traffic(WORKLOAD.model, dataclasses.replace(lay, offload_params=True), WORKLOAD.seq_len, prec)
    part = -(-n // lay.world)
    assert (opt.pcie_per_step, opt.pcie_fetch_per_micro) == ((4 + 2) * part, 0)
    assert (both.pcie_per_step, both.pcie_fetch_per_micro) == (4 * part, 3 * 2 * part)  # forward, recompute, backward


def test_search_tries_parameter_offload_at_stage_3_only_and_with_the_optimizer() -> None:
    tried = {(lay.zero_stage, lay.offload_optimizer, lay.offload_params) for lay in layouts(WORKLOAD, Cluster(H100, 8))}
    assert (3, True, True) in tried
    assert not any(params and (stage < 3 or not opt) for stage, opt, params in tried)


def test_one_gpu_reaches_past_alst_only_with_zero_offload_and_within_the_host_budget() -> None:
    w = dataclasses.replace(WORKLOAD, seq_len=0)
    reach = max_seq_len(w, Cluster(H100, 1), Assumptions())
    best = reach[0].candidate.layout
    assert best.offload_optimizer and best.offload_params and reach[0].max_seq_len >= 500_000
    without = max(r.max_seq_len for r in reach if not r.candidate.layout.offload_params)
    assert reach[0].max_seq_len > 1.2 * without
    # 8B's optimizer, gradients and parameters need 18 B/param = 145 GB of host memory: a node of
    # 120 GB holds none of the ZeRO offloads (the same budget as the activations').
    small = Cluster(dataclasses.replace(H100, host_memory_bytes=120 * GB), 1)
    assert not any(r.candidate.layout.offload_optimizer for r in max_seq_len(w, small, Assumptions()))


def test_selective_recomputation_with_tiles_recomputes_the_mlp_once() -> None:
    """The model recomputes a selective layer's MLP tile by tile, once (train/model.py ``_mlp``);
    tiles without selective add their own recompute."""
    from ringtrain.planner.models import preset
    from ringtrain.planner.savers import extra_flops_per_token

    model = preset("llama3-8b")
    mlp = 2.0 * 3 * model.dim * model.ffn_dim * model.n_layers
    flops = {(sel, tiles): extra_flops_per_token(model, Layout(1, 8, 1, 3, False, selective=sel, mlp_tiles=tiles))
             for sel in (False, True) for tiles in (1, 4)}
    assert flops == {(False, 1): 0.0, (False, 4): mlp, (True, 1): mlp, (True, 4): mlp}


def test_each_plan_row_shows_the_savers_its_run_line_selects(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run(["--model", "llama3-8b", "--seq-len", "131072", "--gpus", "8", "--top", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("#  dp"))
    rows = lines[head + 1 : head + 6]
    (run,) = [line for line in lines if line.strip().startswith("run: ringtrain run")]
    # The best row's recompute mode is the one its `run:` line selects, not "no checkpointing".
    mode = run.split("model.activation_checkpointing=")[1].split()[0]
    assert mode == "selective" and rows[0].split()[6].rstrip(",") == mode, rows[0]
    # No two rows alike in every layout column (dp to savers): a saver that differs is shown.
    layout_columns = [row[1 : lines[head].index("GB/GPU")] for row in rows]
    assert len(set(layout_columns)) == len(rows), layout_columns
