"""The long-context recipes in jobs/: each plans to fit on 8 x H100 in the layout it names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain import cli, config

JOBS = Path(__file__).resolve().parents[2] / "jobs"
RECIPES = ("llama3-8b-128k.yaml", "qwen2.5-7b-128k.yaml", "gemma3-1b-128k.yaml")


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_fits_on_8_h100(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    job = config.load(JOBS / recipe)
    assert job.model.hf and job.data.seq_len == 131072 and job.model.rope_scaling

    assert cli.main(["plan", str(JOBS / recipe), "--gpus", "8", "--gpu-type", "h100", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    mine = plan["job_layout"]
    assert mine["fits"], mine
    layout = mine["layout"]
    assert (layout["dp"], layout["cp"], layout["zero_stage"]) == (job.mesh.dp, job.mesh.cp, job.zero.stage)
    assert mine["memory_bytes"]["total"] <= plan["usable_bytes_per_gpu"]

    assert cli.main(["plan", str(JOBS / recipe), "--gpus", "8"]) == 0
    text = capsys.readouterr().out
    assert "the job's layout (dp 1 x cp 8" in text and "fits" in text
