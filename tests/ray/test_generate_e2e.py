"""`ringtrain generate` end to end on an embedded local Ray cluster, on a ring of two.

A tiny Hugging Face model with a tokenizer continues a text prompt and an ids prompt: the new
ids equal transformers' greedy ``generate`` of the same prompt ids, in input order, and each
text is the tokenizer's decoding of them; a ``--stop`` string cuts a continuation's text and
ends its ids at the token that completed it. Progress reaches stderr.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ringtrain_dev.cli_runs import ringtrain_cli
from ringtrain_dev.ray_head import processes_using
from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.hf_models import greedy_reference, save_model

from .test_run_e2e import ray_tmp  # noqa: F401  (fixture)

pytestmark = [pytest.mark.ray, pytest.mark.slow]

NEW = 12


def test_generate_on_a_ring_equals_transformers(tmp_path: Path, ray_tmp: Path) -> None:
    from tokenizers import Tokenizer

    folder = save_tokenizer(save_model(tmp_path / "hf", "llama"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    text = "The grass is green. The sky is blue. Here we go."
    prompts = [tok.encode(text).ids, [5, 9, 33, 40, 41, 7, 8]]
    (tmp_path / "prompts.jsonl").write_text(json.dumps({"prompt": text}) + "\n" + json.dumps({"ids": prompts[1]}) + "\n")
    want = greedy_reference(folder, prompts, NEW)

    # The model's eos (id 2) ends a continuation, kept as transformers keeps it.
    expected = [ids[: ids.index(2) + 1] if 2 in ids else ids for ids in want]
    # A stop string from the middle of the first continuation's text: its ids end at the token
    # whose text completes the string, its text just before the string.
    first = tok.decode(expected[0])
    stop = first[len(first) // 2 : len(first) // 2 + 2]
    assert len(stop) == 2, first

    def stopped(ids: list[int]) -> tuple[list[int], str]:
        end = next((n for n in range(1, len(ids) + 1) if stop in tok.decode(ids[:n])), len(ids))
        kept = tok.decode(ids[:end])
        return ids[:end], kept[: kept.find(stop)] if stop in kept else kept

    out = tmp_path / "out.jsonl"
    args = ["generate", str(folder), "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", str(NEW),
            "--out", str(out), "--stop", stop, "mesh.cp=2", "attention.impl=ring", "data.seq_len=64",
            "cluster.num_cpus=2"]
    result = ringtrain_cli(args, home=tmp_path, ray_tmp=ray_tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(line["ids"], line["text"]) for line in lines] == [stopped(ids) for ids in expected]
    assert len(lines[0]["ids"]) < len(expected[0])
    assert "2/2 prompts" in result.stderr and "tokens/s" in result.stderr
    assert processes_using(ray_tmp) == []
