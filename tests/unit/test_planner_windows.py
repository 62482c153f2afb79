"""The planner on windowed models: the keys a window leaves a query (against a count of every
pair), which ring ranks' K/V it reads (against the attention's own rule), the FLOPs the MFU
counts, the memory the received K/V take, Gemma 3's shapes, and `ringtrain plan` on a Gemma 3
job."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Optional

import numpy as np
import pytest

from ringtrain import config
from ringtrain.planner.comm import ring_bytes
from ringtrain.planner.layout import Layout, Workload
from ringtrain.planner.memory import activations, score_bytes
from ringtrain.planner.models import PRESETS, ModelSpec, from_job
from ringtrain.planner.throughput import attention_flops_per_token, flops_per_token, layer_attention_flops
from ringtrain.planner.windows import attended_keys, window_ranks
from tests.unit.test_planner import _run

GEMMA_JOB = Path(__file__).resolve().parents[2] / "jobs" / "gemma3-1b-128k.yaml"
# Mistral-7B's shape with its 4K window on every layer.
MISTRAL = ModelSpec("mistral", 32000, 4096, 32, 32, 8, 14336, window=4096, num_windowed_layers=32)


def _pairs(seq_len: int, window: Optional[int]) -> int:
    p, q = np.meshgrid(np.arange(seq_len), np.arange(seq_len), indexing="ij")
    seen = q <= p if window is None else (q <= p) & (q > p - window)
    return int(seen.sum())


@pytest.mark.parametrize("seq_len, window", [(64, 1), (64, 8), (64, 40), (100, 7), (128, 64)])
def test_attended_keys_count_every_visible_pair(seq_len: int, window: int) -> None:
    assert attended_keys(seq_len, window) * seq_len == _pairs(seq_len, window)


def test_a_window_never_counts_more_than_a_full_layer() -> None:
    assert attended_keys(64, None) == attended_keys(64, 64) == attended_keys(64, 500) == 32
    keys = [attended_keys(4096, w) for w in range(1, 4097, 17)]
    assert keys == sorted(keys) and max(keys) <= 2048


@pytest.mark.parametrize("ring", [2, 3, 4, 6])
@pytest.mark.parametrize("window", [1, 5, 16, 17, 40, 100, 400])
def test_window_ranks_are_the_attentions_own(ring: int, window: int) -> None:
    from ringtrain.train.attention.window import needed_sources

    seq_len = 2 * ring * 16
    needs = needed_sources(ring, seq_len // ring, window)
    ranks = window_ranks(ring, seq_len, window)
    if all(len(sources) == ring for sources in needs):
        assert ranks is None
        return
    sources = [set(s) - {r} for r, s in enumerate(needs)]
    assert ranks is not None
    assert ranks.sources == max(len(s) for s in sources)
    assert ranks.readers == max(sum(r in s for s in sources) for r in range(ring))


def test_a_window_no_longer_than_a_chunk_reads_the_two_neighbours() -> None:
    assert window_ranks(8, 131072, 512) == window_ranks(8, 131072, 8192) == window_ranks(4, 4096, 512)
    assert window_ranks(8, 131072, 512).readers == window_ranks(8, 131072, 512).sources == 2  # type: ignore[union-attr]
    assert window_ranks(2, 131072, 512) is None  # on a ring of 2 each rank reads the other anyway
    assert window_ranks(8, 131072, None) is None and window_ranks(1, 131072, 512) is None


def test_a_1k_window_at_32k_tokens_is_a_sixteenth_of_a_full_layer() -> None:
    """The issue's bar: a windowed layer's attention FLOPs <= 0.1x the full causal layer's."""
    model = PRESETS["llama3-8b"]
    ratio = layer_attention_flops(model, 32768, 1024) / layer_attention_flops(model, 32768, None)
    assert ratio == pytest.approx((1024 - 1024 * 1023 / (2 * 32768)) / 16384) and ratio <= 0.1
    assert layer_attention_flops(model, 32768, None) == 6 * model.q_dim * 32768  # the causal convention


def test_model_flops_count_windowed_layers_as_windowed() -> None:
    gemma = PRESETS["gemma3-27b"]
    seq, q = 131072, gemma.q_dim
    attention = 12 * q * (10 * seq / 2 + 52 * attended_keys(seq, 1024))
    assert attention_flops_per_token(gemma, seq) == pytest.approx(attention)
    assert flops_per_token(gemma, seq, checkpointing=False)[0] == pytest.approx(6 * gemma.num_matmul_params + attention)
    unwindowed = dataclasses.replace(gemma, window=None, num_windowed_layers=0)
    assert flops_per_token(unwindowed, seq, checkpointing=False)[0] == 6 * gemma.num_matmul_params + 6 * 62 * q * seq


def test_the_mfu_metric_counts_the_windowed_flops(monkeypatch: pytest.MonkeyPatch) -> None:
    from ringtrain.commands.run import run_metrics
    from ringtrain.telemetry import prometheus

    captured: dict[str, Any] = {}
    monkeypatch.setattr(prometheus, "RunMetrics", lambda job, run_id, **kwargs: captured.update(kwargs))
    job = config.load(GEMMA_JOB)
    run_metrics(job, "run")
    model = from_job(job)
    assert (model.num_windowed_layers, model.window) == (22, 512)
    assert captured["model_flops_per_token"] == flops_per_token(model, 131072, checkpointing=False)[0]
    assert captured["model_flops_per_token"] < flops_per_token(dataclasses.replace(model, num_windowed_layers=0), 131072, checkpointing=False)[0]


def test_gemma3_presets_have_the_reports_non_embedding_parameters() -> None:
    """Gemma 3 Technical Report, Table 1: 698M, 3,209M, 10,759M and 25,600M non-embedding."""
    for name, millions in (("gemma3-1b", 698), ("gemma3-4b", 3209), ("gemma3-12b", 10759), ("gemma3-27b", 25600)):
        model = PRESETS[name]
        assert round((model.num_params - model.vocab_size * model.dim) / 1e6) == millions, name
    one_b = PRESETS["gemma3-1b"]
    # four norm gains per layer and two per-head ones; none of them multiplies
    assert one_b.layer_tensors().count(one_b.dim) == 4
    assert one_b.num_params - one_b.num_matmul_params == (4 * 26 + 1) * 1152 + 2 * 26 * 256


def test_received_kv_are_kept_for_the_backward() -> None:
    """On a ring of 8 with a 4K window each rank keeps its two neighbours' K/V per layer; on a
    ring of 2 the ring passes them as for a full layer, and nothing more is kept."""
    seq, p = 131072, 2
    ring8, ring2 = Layout(1, 8, 1, 3, False), Layout(1, 2, 1, 3, False)
    t = seq // 8
    full = dataclasses.replace(MISTRAL, window=None, num_windowed_layers=0)
    extra = activations(MISTRAL, ring8, seq, p, flash=True).kept - activations(full, ring8, seq, p, flash=True).kept
    assert extra == activations(MISTRAL, ring8, seq, p, flash=True).received_kv == 32 * 2 * 2 * t * MISTRAL.kv_dim * p
    assert activations(MISTRAL, ring2, seq, p, flash=True).received_kv == 0
    # Its neighbours' K/V out and their fp32 dK/dV back, instead of 7 ring passes each way.
    assert ring_bytes(MISTRAL, ring8, t, p, seq, 4096) == (2 * 2 * t * MISTRAL.kv_dim * p, 2 * 2 * t * MISTRAL.kv_dim * 4)
    assert ring_bytes(MISTRAL, ring2, seq // 2, p, seq, 4096) == ring_bytes(full, ring2, seq // 2, p)


def test_the_unfused_kernels_largest_block_is_a_tile_when_every_layer_is_windowed() -> None:
    layout = Layout(1, 1, 1, 0, False)
    full = dataclasses.replace(MISTRAL, window=None, num_windowed_layers=0)
    assert score_bytes(MISTRAL, layout, 32768) == 20 * 32 * 4096 * 4096
    assert score_bytes(full, layout, 32768) == 20 * 32 * 32768 * 32768
    mixed = dataclasses.replace(MISTRAL, num_windowed_layers=31)
    assert score_bytes(mixed, layout, 32768) == score_bytes(full, layout, 32768)


def test_plan_reports_a_gemma3_jobs_windowed_flops_and_memory(capsys: pytest.CaptureFixture[str]) -> None:
    assert _run([str(GEMMA_JOB), "--gpus", "8"]) == 0
    text = capsys.readouterr().out
    assert "windowed attention: 22 of 26 layers windowed (512 tokens), 4 full" in text
    assert "windowed layers' received K/V" in text

    assert _run([str(GEMMA_JOB), "--gpus", "8", "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    flops = record["flops_per_token"]
    assert (record["model"]["num_windowed_layers"], record["model"]["window"]) == (22, 512)
    assert flops["attention"] < 0.2 * flops["attention_if_full"]
    assert flops["model"] == flops_per_token(from_job(config.load(GEMMA_JOB)), 131072, checkpointing=False)[0]
    job_layout = record["job_layout"]
    assert job_layout["fits"] and job_layout["memory_bytes"]["received_kv"] > 0
    workload = Workload(from_job(config.load(GEMMA_JOB)), 131072, "bf16", True, global_batch=8)
    assert workload.model.local_rope and workload.model.norm_style == "gemma"
