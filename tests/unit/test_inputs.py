"""A job's relative inputs anchored to the driver's folder, for workers that run from another."""

from __future__ import annotations

from pathlib import Path

from ringtrain import config
from ringtrain.inputs import anchored, input_paths


def test_relative_inputs_become_absolute_under_the_base_and_the_rest_stay() -> None:
    job = config.load(None, [
        "data.sources=[{path: prepared/a}, {path: s3://bucket/b}]",
        "eval.data=/abs/eval.jsonl",
        "model.hf=runs/tiny-llama",
    ])
    out = anchored(job, Path("/home/user/project"))
    assert dict(input_paths(out)) == {
        "data.path": "stdlib",  # the built-in corpus names no file
        "eval.data": "/abs/eval.jsonl",
        "model.hf": "/home/user/project/runs/tiny-llama",
        "data.sources[0].path": "/home/user/project/prepared/a",
        "data.sources[1].path": "s3://bucket/b",
    }
    assert job.model.hf == "runs/tiny-llama" and job.data.sources[0].path == "prepared/a"  # a copy


def test_a_relative_data_path_is_anchored_and_an_unset_one_stays_unset() -> None:
    job = config.load(None, ["data.path=corpus/train.bin"])
    out = anchored(job, Path("/w"))
    assert (out.data.path, out.model.hf, out.eval.data) == ("/w/corpus/train.bin", "", "")
