"""Cached greedy decoding on a CP group against transformers' ``generate(do_sample=False)`` in fp32:
the same tokens, token for token, for one batch of prompts of 3 to 2,500 tokens decoded together,
under every layout (one rank; ring cp2 and cp4 with each K/V exchange; Ulysses cp2; hybrid
2 x 2), for a GQA Llama, an MQA one whose single KV head Ulysses copies, one whose six heads
Ulysses pads to eight, and sliding-window models (Mistral, Gemma 3's local and global layers).

The CP group is emulated in one process (tests/emulated_cp.py: every rank a thread with its own
model, the real attention, cache and merge code, only the transport in memory); the gloo tier's
tests/dist/test_evaluator.py runs the same decoder over process groups under ZeRO-3.

Each rank's cache is checked too: at cp 1, 2 and 4 a full layer holds the rank's share of the
prompt's slots and of the new tokens, never the whole; a windowed layer never more than its window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from ringtrain_dev.emulated_cp import EmulatedGroups
from tests.hf.windowed_models import WINDOWS, save_windowed
from tests.hf_models import VOCAB, greedy_reference, save_model

pytestmark = [pytest.mark.slow]

LENGTHS = (3, 37, 130, 2500)
NEW = 10
# name -> (ring, ulysses, kv_exchange)
LAYOUTS = {
    "cp1": (1, 1, "ring"),
    "ring-cp2": (2, 1, "ring"),
    "ring-cp2-allgather": (2, 1, "allgather"),
    "ring-cp4": (4, 1, "ring"),
    "ring-cp4-allgather": (4, 1, "allgather"),
    "ulysses-cp2": (1, 2, "ring"),
    "hybrid-cp4": (2, 2, "ring"),
}


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _decode(folder: Path, ring: int, ulysses: int, exchange: str, prompts: list[list[int]]) -> tuple[list[list[int]], list[Any]]:
    """Every rank's tokens (rank 0's returned, every rank's checked equal) and every rank's cache."""
    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.hf.weights import PretrainedWeights, load_full
    from ringtrain.topology import CPLayout
    from ringtrain.train.decode import Decoder
    from ringtrain.train.model import ModelArgs, Transformer

    job = resolve_job(config.load(None, [f"model.hf={folder}", "data.seq_len=64"]))
    groups = EmulatedGroups(CPLayout(ring, ulysses, exchange), timeout_s=120.0)
    weights = PretrainedWeights(folder)

    def rank_main(rank: int) -> tuple[list[list[int]], Any]:
        attention = groups.attention(rank)
        model = Transformer(ModelArgs.from_job(job), attention_fn=attention, init_std=None)
        load_full(model, weights)
        model.eval()
        decoder = Decoder(model, attention, torch.device("cpu"))
        with torch.no_grad():
            tokens = decoder.generate(prompts, NEW)
        return tokens, decoder.last_cache

    done = groups.run(rank_main)
    assert all(tokens == done[0][0] for tokens, _ in done), "every rank of the group draws the same tokens"
    return done[0][0], [cache for _, cache in done]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, list[list[int]]]]:
    root = tmp_path_factory.mktemp("decode-models")
    prompts = _prompts()
    folders = {
        "llama-gqa": save_model(root / "llama", "llama"),
        "llama-mqa": save_model(root / "mqa", "llama", num_key_value_heads=1),
        "qwen2-six-heads": save_model(root / "six", "qwen2", num_attention_heads=6, num_key_value_heads=2,
                                      hidden_size=48),
        "mistral-windowed": save_windowed(root / "mistral", "mistral-windowed"),
        "gemma3": save_windowed(root / "gemma3", "gemma3"),
    }
    return {name: (folder, greedy_reference(folder, prompts, NEW)) for name, folder in folders.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gqa_model_decodes_as_transformers_under_every_layout(layout: str, models: dict[str, Any]) -> None:
    folder, want = models["llama-gqa"]
    got, caches = _decode(folder, *LAYOUTS[layout], _prompts())
    assert got == want
    ring = LAYOUTS[layout][0]
    slots = max(-(-n // (2 * ring * LAYOUTS[layout][1])) for n in LENGTHS) * 2 * ring * LAYOUTS[layout][1]
    for cache in caches:
        # A rank holds its ring shard's slots and its share of the NEW - 1 tokens fed back.
        share = slots // ring + -(-(NEW - 1) // ring)
        assert max(cache.held()) <= share and min(cache.held()) >= slots // ring + (NEW - 1) // ring


@pytest.mark.parametrize(("model", "layout"), [
    ("llama-mqa", "ulysses-cp2"), ("llama-mqa", "hybrid-cp4"),
    ("qwen2-six-heads", "ulysses-cp2"), ("qwen2-six-heads", "hybrid-cp4"),
    ("mistral-windowed", "ring-cp2"), ("mistral-windowed", "hybrid-cp4"),
    ("gemma3", "ring-cp4"), ("gemma3", "ulysses-cp2"),
])
def test_other_models_decode_as_transformers(model: str, layout: str, models: dict[str, Any]) -> None:
    folder, want = models[model]
    got, caches = _decode(folder, *LAYOUTS[layout], _prompts())
    assert got == want
    window = WINDOWS.get(model)
    if window is not None:
        for cache in caches:
            for shard in cache.layers:
                if shard.window is not None:
                    assert shard.held <= window and shard.k.shape[2] <= window


def test_a_ranks_cache_is_its_share(models: dict[str, Any]) -> None:
    """The bytes of a rank's cache at cp 1, 2 and 4: the whole's, a half, a quarter (to a token)."""
    folder, _ = models["llama-gqa"]
    prompts = [_prompts()[3]]
    sizes = {}
    for ring in (1, 2, 4):
        _, caches = _decode(folder, ring, 1, "ring", prompts)
        sizes[ring] = [cache.nbytes for cache in caches]
    whole = sizes[1][0]
    for ring in (2, 4):
        per_token = whole / (2500 + NEW)
        for nbytes in sizes[ring]:
            assert abs(nbytes - whole / ring) <= 2 * per_token, (ring, nbytes, whole)


@pytest.mark.parametrize("layout", ["cp1", "ring-cp4", "hybrid-cp4"])
def test_scores_equal_transformers_log_probabilities(layout: str, models: dict[str, Any]) -> None:
    """lm-eval's loglikelihood on the group: a batch of sequences of 5 to 130 tokens, their last
    1 to 4 tokens scored: the summed log-probabilities of transformers' logits, and its greedy flags."""
    from ringtrain import config
    from ringtrain.hf import resolve_job
    from ringtrain.hf.weights import PretrainedWeights, load_full
    from ringtrain.topology import CPLayout
    from ringtrain.train.decode import Decoder
    from ringtrain.train.model import ModelArgs, Transformer
    from transformers import AutoModelForCausalLM

    folder, _ = models["llama-gqa"]
    sequences = [p[:n] for p, n in zip(_prompts(), (3, 5, 130, 40))]
    sequences[0] = _prompts()[2][60:65]
    scored = [1, 4, 3, 2]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    want = []
    with torch.no_grad():
        for seq, n in zip(sequences, scored):
            logprobs = torch.log_softmax(hf(input_ids=torch.tensor([seq])).logits[0].double(), dim=-1)
            picks = [(j - 1, seq[j]) for j in range(len(seq) - n, len(seq))]  # (predicted at, token)
            want.append((sum(float(logprobs[p, t]) for p, t in picks),
                         all(int(logprobs[p].argmax()) == t for p, t in picks)))

    ring, ulysses, exchange = LAYOUTS[layout]
    job = resolve_job(config.load(None, [f"model.hf={folder}", "data.seq_len=64"]))
    groups = EmulatedGroups(CPLayout(ring, ulysses, exchange), timeout_s=120.0)

    def rank_main(rank: int) -> list[tuple[float, bool]]:
        attention = groups.attention(rank)
        model = Transformer(ModelArgs.from_job(job), attention_fn=attention, init_std=None)
        load_full(model, PretrainedWeights(folder))
        with torch.no_grad():
            return Decoder(model.eval(), attention, torch.device("cpu")).score(sequences, scored)

    done = groups.run(rank_main)
    assert all(r == done[0] for r in done)
    assert [g for _, g in done[0]] == [g for _, g in want]
    for (got, _), (expected, _) in zip(done[0], want):
        assert abs(got - expected) < 1e-4, (got, expected)
