"""The pure and driver-side parts of generation, each against its reference: the prompt file's
three kinds of line (a chat template's rendering as transformers renders it), where a
continuation stops and what its text keeps, which prompts decode together on which replica, and
how a token is drawn (greedy is the argmax; a nucleus that holds only the likeliest token is
greedy too; a seed draws the same tokens again)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from ringtrain.commands.prompt_file import ChatTemplate, read_prompts
from ringtrain.evaluation.batching import plan_batches, replica_batches
from ringtrain.evaluation.generation import Sampling
from ringtrain.evaluation.stops import StopRule
from ringtrain.evaluation.tokenizer import find_tokenizer
from ringtrain.train.sampling import next_tokens
from ringtrain_dev.tiny_tokenizer import save_chat_tokenizer


def test_prompt_lines_of_each_kind(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    folder = save_chat_tokenizer(tmp_path / "tok")
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is 2 + 2?"}]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in (
        {"prompt": "the sky is blue"}, {"messages": messages}, {"ids": [5, 6, 7]})) + "\n")
    tokenizer = find_tokenizer(str(folder))
    read = read_prompts(str(path), tokenizer, ChatTemplate(str(folder)), vocab_size=320)
    hf = AutoTokenizer.from_pretrained(folder)
    rendered = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered.endswith("<|im_start|>assistant\n")
    assert read == [(f"{path} line 1", hf("the sky is blue")["input_ids"]),
                    (f"{path} line 2", hf(rendered, add_special_tokens=False)["input_ids"]),
                    (f"{path} line 3", [5, 6, 7])]


def test_a_row_stops_at_eos_or_a_stop_string() -> None:
    words = {1: "The", 2: " sky", 3: ".", 4: " It", 9: "<eos>"}

    def decode(ids: list[int]) -> str:
        return "".join(words[i] for i in ids if i != 9)

    rule = StopRule(frozenset({9}), (".", "\n\n"))
    assert not rule.stopped([1, 2], decode)
    assert rule.stopped([1, 2, 3], decode)  # the token that completes the stop string ends the row
    assert rule.stopped([1, 9], decode)
    assert rule.cut("The sky. It") == "The sky" and rule.cut("no stop") == "no stop"
    assert not StopRule().stopped([1, 2, 3], decode)


def test_batches_longest_first_within_the_budget_and_as_many_on_every_replica() -> None:
    lengths = [5, 40, 300, 17, 90, 18]
    batches = plan_batches(lengths, budget_tokens=100, replicas=2)
    assert batches == [[2], [4], [1, 5], [3, 0]]  # 300 alone; 90; 40+18 padded to 80; 17+5 to 34
    assert sorted(i for b in batches for i in b) == list(range(6))
    odd = plan_batches(lengths, budget_tokens=2000, replicas=2)  # one batch of six, 300 tokens each
    assert len(odd) == 2 and odd[1] == odd[0]  # padded with a copy of the last batch
    assert replica_batches(batches, 2, 1) == [[4], [3, 0]]


def test_greedy_nucleus_and_seeded_sampling() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g)
    assert torch.equal(next_tokens(logits, Sampling(), None), logits.argmax(-1))
    tiny_nucleus = Sampling(temperature=1.0, top_p=1e-6)
    assert torch.equal(next_tokens(logits, tiny_nucleus, torch.Generator().manual_seed(1)), logits.argmax(-1))
    hot = Sampling(temperature=2.0, top_p=0.9)
    first = [next_tokens(logits, hot, torch.Generator().manual_seed(3)) for _ in range(2)]
    assert torch.equal(first[0], first[1])
    draws = torch.stack([next_tokens(logits, hot, torch.Generator().manual_seed(s)) for s in range(20)])
    assert len(set(draws[:, 0].tolist())) > 1, "a hot sample draws more than one token"
    for temperature in (-1.0, math.nan, math.inf):  # NaN passes a `< 0` check; inf turns the softmax flat
        with pytest.raises(ValueError, match=f"temperature must be a finite number >= 0 \\(got {temperature}\\)"):
            Sampling(temperature=temperature)
    for top_p in (0.0, 1.5, math.nan):
        with pytest.raises(ValueError, match="top_p must be in"):
            Sampling(temperature=1.0, top_p=top_p)
