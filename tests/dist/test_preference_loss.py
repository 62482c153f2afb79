"""Preference objectives are exact under every layout: a step of DPO, IPO, SimPO or ORPO on rows of
whole pairs trains as transformers' model does on each pair alone.

A tiny transformers Llama, a preference dataset made by ``ringtrain prepare --format preference``
from plain prompt / chosen / rejected texts (rendered with a ChatML template), and one step of
the real Trainer on gloo ranks. The reference takes each pair of the step's global batch apart:
prompt + chosen and prompt + rejected as two sequences, no packing, no CP, each completion's
log-prob the sum of its trained tokens' log-probs; the objective of those sums (the reference
model's being the same starting weights, as ``reference: initial`` takes them), the mean over
the pairs, and its gradient. The step's loss, its logps and rewards, and every parameter's
gradient must equal it (fp32, 1e-5), with the prompt laid out once (shared) and twice (two
documents), under dp1 x cp1, ring cp2 (ZeRO-2), Ulysses cp2 (ZeRO-3), ring cp4 with all-gathered
K/V, hybrid cp4 and dp2 with accumulation; and some pair's completions lie on one rank alone.
A Mistral model whose every layer has a sliding window shorter than most prompts does the same
under dp1 x cp1 (both layouts), ring cp2 and ring cp4 (the window's neighbour exchange): a
completion's window reaches into the prompt by position id, as transformers' does on the pair
alone, not by its place in the row, where the rejected completion lies after the chosen one.

Each Trainer takes its four objectives' steps on the same batch, its learning rate 1e-30 (so the
weights stay the starting ones): one process group per world size.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ringtrain_dev.ranks import gloo_rank, run_ranks
from ringtrain_dev.tiny_tokenizer import CHAT_WORDS, save_chat_tokenizer
from tests.hf.windowed_models import save_windowed
from tests.hf_models import save_model

pytestmark = [pytest.mark.dist, pytest.mark.slow]

SEQ, GLOBAL_BATCH, SEED, VOCAB = 96, 4, 5, 320
WINDOW = 6  # the windowed model's: shorter than most prompts, and than a ring of four's chunks
OBJECTIVES = {"dpo": {"train.preference.beta": 0.5, "train.preference.label_smoothing": 0.1},
              "ipo": {"train.preference.beta": 0.5},
              "simpo": {"train.preference.beta": 2.0, "train.preference.gamma": 0.3, "train.preference.sft_weight": 0.5},
              "orpo": {"train.preference.beta": 0.25}}  # fmt: skip
LLAMA, WINDOWED = "llama", "mistral-windowed"
CP1 = ["mesh.dp=1", "mesh.cp=1", "zero.stage=0", "train.micro_batch=4"]
RING_CP2 = ["mesh.cp=2", "attention.impl=ring", "zero.stage=2", "train.micro_batch=4"]
# name -> (world size, prefix shared, overrides, model)
LAYOUTS: dict[str, tuple[int, bool, list[str], str]] = {
    "dp1-cp1": (1, True, CP1, LLAMA),
    "dp1-cp1-two-documents": (1, False, CP1, LLAMA),
    "ring-cp2-zero2": (2, True, RING_CP2, LLAMA),
    "ulysses-cp2-zero3": (2, True, ["mesh.cp=2", "attention.impl=ulysses", "zero.stage=3", "train.micro_batch=2"],
                          LLAMA),
    "dp2-accum-zero2": (2, True, ["mesh.dp=2", "mesh.cp=1", "zero.stage=2", "train.micro_batch=1"], LLAMA),
    "ring-cp4-allgather": (4, True, ["mesh.cp=4", "attention.impl=ring", "attention.kv_exchange=allgather",
                                     "zero.stage=2", "train.micro_batch=4"], LLAMA),
    "hybrid-cp4-zero3": (4, True, ["mesh.cp=4", "mesh.ulysses=2", "attention.impl=hybrid", "zero.stage=3",
                                   "train.micro_batch=4"], LLAMA),
    "windowed-dp1-cp1": (1, True, CP1, WINDOWED),
    "windowed-dp1-cp1-two-documents": (1, False, CP1, WINDOWED),
    "windowed-ring-cp2-zero2": (2, True, RING_CP2, WINDOWED),
    "windowed-ring-cp4-neighbours": (4, True, ["mesh.cp=4", "attention.impl=ring", "zero.stage=2",
                                               "train.micro_batch=4"], WINDOWED),
}


def _overrides(folder: str, root: str, shared: bool, layout: list[str]) -> list[str]:
    return [f"model.hf={folder}", f"data.path={root}", "data.packing=doc", f"data.seq_len={SEQ}",
            f"data.prefix_sharing={str(shared).lower()}", f"train.global_batch={GLOBAL_BATCH}", f"train.seed={SEED}",
            "train.steps=8", "train.warmup_steps=0", "train.lr=1e-30", "train.grad_clip=0", "train.fused_ops=false",
            "checkpoint.snapshot_every=0", "train.objective=dpo", *layout]  # fmt: skip


def _rank(rank: int, world: int, store: str, runs: list[tuple[str, list[str]]], results: mp.Queue) -> None:
    with gloo_rank(rank, world, store, results):
        from deepspeed.utils import safe_get_full_grad

        from ringtrain import config
        from ringtrain.hf import resolve_job
        from ringtrain.hf.names import to_hf
        from ringtrain.train.preference import Objective
        from ringtrain.train.trainer import Trainer

        out: dict[str, Any] = {}
        for name, overrides in runs:
            job = resolve_job(config.load(None, overrides))
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"))
            step = trainer.engine.step
            for objective, settings in OBJECTIVES.items():
                grads: dict[str, np.ndarray] = {}

                def capture(*args: Any, _step: Any = step, _grads: dict = grads, **kw: Any) -> Any:
                    if trainer.engine.is_gradient_accumulation_boundary():
                        for pname, p in trainer.model.named_parameters():
                            _grads[to_hf(pname)] = safe_get_full_grad(p).detach().numpy().copy()
                    return _step(*args, **kw)

                trainer.engine.step = capture
                trainer.objective = Objective(objective, **{k.rsplit(".", 1)[1]: v for k, v in settings.items()})
                trainer.data_cursor = 0  # every objective on the step's same batch
                report = trainer.train_step()
                out[f"{name}/{objective}"] = {"loss": report.loss, "metrics": report.objective_metrics, "grads": grads}
            trainer.prefetcher.close()
        if rank == 0:
            results.put(out)


def _records(num: int) -> list[dict[str, str]]:
    rng = random.Random(1)

    def say(low: int, high: int) -> str:
        return " ".join(rng.choice(CHAT_WORDS) for _ in range(rng.randint(low, high)))

    out = []
    for i in range(num):
        # Every third pair's completions a word each: short enough to lie on one rank of a ring
        # of four. Never the same text twice: a tie's reward accuracy would be rounding's to decide.
        longest = 8 if i % 3 else 1
        chosen = say(1, longest)
        rejected = chosen
        while rejected == chosen:
            rejected = say(1, longest)
        out.append({"prompt": say(3, 14), "chosen": chosen, "rejected": rejected})
    return out


def _pairs(root: Path) -> list[tuple[np.ndarray, ...]]:
    """Each stored pair: (prompt ids, chosen ids, chosen mask, rejected ids, rejected mask)."""
    from ringtrain.train.corpus import PreparedCorpus

    corpus = PreparedCorpus(str(root))
    out = []
    for j in range(corpus.manifest.num_documents // 3):
        spans = [corpus.document_span(3 * j + d) for d in range(3)]
        (p0, p1), (c0, c1), (r0, r1) = spans
        out.append((corpus.tokens(p0, p1), corpus.tokens(c0, c1), corpus.mask(c0, c1), corpus.tokens(r0, r1),
                    corpus.mask(r0, r1)))  # fmt: skip
    corpus.close()
    return out


def _completion_logp(model: Any, prompt: np.ndarray, completion: np.ndarray, mask: np.ndarray) -> tuple[torch.Tensor, int]:
    """transformers' summed log-prob of ``completion``'s trained tokens after ``prompt``, and their count."""
    ids = torch.as_tensor(np.concatenate([prompt, completion]))[None]
    logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
    targets = ids[0, 1:]
    trained = torch.zeros(ids.shape[1] - 1, dtype=torch.bool)
    trained[len(prompt) - 1 :] = torch.as_tensor(mask == 1)
    return logp[torch.arange(len(targets)), targets][trained].sum(), int(trained.sum())


def _reference(folder: Path, root: Path, pairs: list[tuple[np.ndarray, ...]], shared: bool) -> dict[str, Any]:
    """transformers on each pair of step 1's global batch alone: per objective, the loss, the
    metrics and the gradients."""
    from transformers import AutoModelForCausalLM

    from ringtrain.config import PreferenceConfig
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.mixture import MixedSamples, SourceSpec
    from ringtrain.train.preference import Objective, PairScores, pair_losses

    samples = MixedSamples([PreparedCorpus(str(root))], [SourceSpec(str(root))], seq_len=SEQ, seed=SEED, packing="doc",
                           prefix_sharing=shared)  # fmt: skip
    step = [int(p) for s in range(GLOBAL_BATCH) for p in samples.pair_rows().row(samples.orders[0].window(s))[0]]
    samples.close()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    scored = [(_completion_logp(model, pairs[j][0], pairs[j][1], pairs[j][2]),
               _completion_logp(model, pairs[j][0], pairs[j][3], pairs[j][4])) for j in step]  # fmt: skip
    chosen = torch.stack([c for (c, _), _ in scored])
    rejected = torch.stack([r for _, (r, _) in scored])
    counts = [torch.tensor([float(n) for (_, n), _ in scored]), torch.tensor([float(n) for _, (_, n) in scored])]
    out: dict[str, Any] = {"pairs": step}
    for name, settings in OBJECTIVES.items():
        objective = Objective.of(name, PreferenceConfig(**{k.rsplit(".", 1)[1]: v for k, v in settings.items()}))
        # The reference model is the starting one: its sums, detached.
        losses = pair_losses(objective, PairScores(chosen, rejected, counts[0], counts[1], chosen.detach(), rejected.detach()))
        loss = losses.loss.mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        out[name] = {"loss": float(loss.detach()), "metrics": losses.metrics(),
                     "grads": {k: g.numpy() for (k, _), g in zip(model.named_parameters(), grads)}}  # fmt: skip
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ringtrain import cli

    base = tmp_path_factory.mktemp("preference")
    tokenizer = save_chat_tokenizer(base / "tokenizer", "chatml", vocab_size=VOCAB)
    (base / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in _records(40)))
    assert cli.main(["prepare", str(base / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(base / "data"), "--quiet"]) == 0  # fmt: skip
    folders = {LLAMA: save_model(base / LLAMA, "llama", vocab_size=VOCAB),
               WINDOWED: save_windowed(base / WINDOWED, WINDOWED, vocab_size=VOCAB, sliding_window=WINDOW)}
    pairs = _pairs(base / "data")
    refs = {(model, shared): _reference(folder, base / "data", pairs, shared)
            for model, folder in folders.items() for shared in (True, False)}
    results: dict[str, Any] = {}
    for world in sorted({w for w, _, _, _ in LAYOUTS.values()}):
        runs = [(name, _overrides(str(folders[model]), str(base / "data"), shared, layout))
                for name, (w, shared, layout, model) in LAYOUTS.items() if w == world]  # fmt: skip
        results.update(run_ranks(_rank, world, base, runs))
    return {"refs": refs, "runs": results, "pairs": pairs, "root": base / "data"}


@pytest.mark.parametrize("objective", OBJECTIVES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_preference_step_equals_transformers_on_each_pair_alone(setup: dict[str, Any], layout: str, objective: str) -> None:
    _, shared, _, model = LAYOUTS[layout]
    got, ref = setup["runs"][f"{layout}/{objective}"], setup["refs"][(model, shared)][objective]
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=0)
    assert got["metrics"].keys() == ref["metrics"].keys()
    for key, value in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-6), key
    scale = max(float(np.abs(g).max()) for g in ref["grads"].values())
    diff = max(float(np.abs(got["grads"][k] - ref["grads"][k]).max()) for k in ref["grads"])
    print(f"{layout}/{objective}: loss {got['loss']:.7f} ref {ref['loss']:.7f} max|dgrad| {diff:.2e} (scale {scale:.2e})")
    assert diff <= 1e-5 * max(1.0, scale)


def test_the_step_holds_pairs_whose_completions_lie_on_one_ring_rank(setup: dict[str, Any]) -> None:
    """The layouts above met pairs whose completions' trained tokens all lie on one rank of the
    ring of four (the other ranks add 0 to their sums), and pairs spread over several."""
    from ringtrain.topology import sequence_positions
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.mixture import MixedSamples, SourceSpec

    root = setup["root"]
    samples = MixedSamples([PreparedCorpus(str(root))], [SourceSpec(str(root))], seq_len=SEQ, seed=SEED, packing="doc")
    rank_of = np.empty(SEQ, dtype=np.int64)
    for r in range(4):
        rank_of[np.asarray(sequence_positions(SEQ, 4, 1, r, 0))] = r
    spread = []
    for s in range(GLOBAL_BATCH):
        row = samples.pair_sample(samples.orders[0].window(s))
        owners = row.completions[1:]  # label i predicts token i + 1
        for k in range(len(row.pairs)):
            spread.append(len(set(rank_of[np.flatnonzero(owners // 2 == k)].tolist())))
    samples.close()
    assert min(spread) == 1 and max(spread) > 1, spread
