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

The same processes check the rest of the reference model's and evaluation's numbers:

- ``train.preference.reference`` another model: the table a Trainer takes (under ring cp2,
  ZeRO-2) equals transformers' log-probs under that model's weights for every pair, and its DPO
  step is transformers' against them, so the starting weights were put back; a model trained
  from scratch gets back its very starting weights (bitwise).
- ``ringtrain eval``'s pairs (its PairSet, rows shorter than the layout's and padded, the
  workers' ``score_pairs`` and the command's result object): the DPO (against another model)
  and SimPO numbers of every pair that fits equal transformers' on each pair alone, under dp1 x
  cp1, ring cp2 and hybrid cp4.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import random
from pathlib import Path
from typing import Any, Optional

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
SUM_RTOL = 1e-6  # a summed completion log-prob of many fp32 terms: its rounding grows with its size
EVAL_SEQ = 62  # the rows `ringtrain eval` packs, padded to 64 on rings of two and four; some pairs are longer
EVALUATED = ("dp1-cp1", "ring-cp2-zero2", "hybrid-cp4-zero3")
REFERENCE_LAYOUTS = ("ring-cp2-zero2", "hybrid-cp4-zero3")  # a reference model's table taken, then the starting weights back
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


def _rank(rank: int, world: int, store: str, runs: list[tuple[str, list[str], dict[str, Any]]], results: mp.Queue) -> None:
    with gloo_rank(rank, world, store, results):
        import dataclasses

        from deepspeed.utils import safe_get_full_grad

        from ringtrain import config
        from ringtrain.actors.worker import TrainWorker
        from ringtrain.hf import resolve_job
        from ringtrain.hf.names import to_hf
        from ringtrain.train.pairset import load_pair_set
        from ringtrain.train.preference import Objective
        from ringtrain.train.reference_input import Reference, ReferenceWeights
        from ringtrain.train.trainer import Trainer

        out: dict[str, Any] = {}
        for name, overrides, extra in runs:
            job = resolve_job(config.load(None, overrides))
            if extra.get("scratch"):  # the model folder's shape, its weights drawn from the seed
                job = dataclasses.replace(job, model=dataclasses.replace(job.model, hf=""))
            other = extra.get("reference")
            trainer = Trainer(job, rank=rank, device=torch.device("cpu"),
                              reference=Reference(weights=ReferenceWeights("other", folder=other)) if other else None)
            if extra.get("scratch"):
                out[name] = {"table": trainer.reference, "params": {k: v.numpy() for k, v in trainer.parameters_fp32().items()}}
                trainer.prefetcher.close()
                continue
            step = trainer.engine.step
            for objective, settings in OBJECTIVES.items():
                if objective not in extra.get("objectives", OBJECTIVES):
                    continue
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
            if other:
                out[f"{name}/table"] = trainer.reference
            if extra.get("eval"):
                # As `ringtrain eval` scores them: its rows, on its workers, the reference put in after.
                pairs = load_pair_set(job.data.path, seq_len=EVAL_SEQ, multiple=job.cp_layout.sequence_multiple,
                                      vocab_size=job.model_int("vocab_size"), prefix_sharing=True, overlong="drop",
                                      packing="next_fit")  # fmt: skip
                worker = TrainWorker(job, rank, "cpu")
                worker._trainer = trainer
                policy, counts = worker.score_pairs(pairs, None)
                table, _ = worker.score_pairs(pairs, ReferenceWeights("other", folder=extra["eval"]))
                out[f"{name}/eval"] = {"pairs": pairs, "policy": policy, "counts": counts, "table": table}
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
    return logp[torch.arange(len(targets)), targets][trained].double().sum(), int(trained.sum())


def _reference(folder: Path, root: Path, pairs: list[tuple[np.ndarray, ...]], shared: bool,
               reference: Optional[Path] = None) -> dict[str, Any]:  # fmt: skip
    """transformers on each pair of step 1's global batch alone: per objective, the loss, the
    metrics and the gradients; the reference model's log-probs those of ``reference`` (None:
    the starting weights)."""
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
    # The reference model is the starting one (its sums, detached), or ``reference``'s.
    ref = (chosen.detach(), rejected.detach()) if reference is None else _pair_sums(reference, pairs, step)[:2]
    out: dict[str, Any] = {"pairs": step}
    for name, settings in OBJECTIVES.items():
        objective = Objective.of(name, PreferenceConfig(**{k.rsplit(".", 1)[1]: v for k, v in settings.items()}))
        losses = pair_losses(objective, PairScores(chosen, rejected, counts[0], counts[1], *ref))
        loss = losses.loss.mean()
        grads = torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)
        out[name] = {"loss": float(loss.detach()), "metrics": losses.metrics(),
                     "grads": {k: g.numpy() for (k, _), g in zip(model.named_parameters(), grads)}}  # fmt: skip
    return out


def _pair_sums(folder: Path, pairs: list[tuple[np.ndarray, ...]], which: list[int]) -> tuple[torch.Tensor, ...]:
    """transformers' (chosen sums, rejected sums, chosen counts, rejected counts) of pairs ``which``, each alone."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        scored = [(_completion_logp(model, pairs[j][0], pairs[j][1], pairs[j][2]),
                   _completion_logp(model, pairs[j][0], pairs[j][3], pairs[j][4])) for j in which]  # fmt: skip
    return (torch.stack([c for (c, _), _ in scored]).double(), torch.stack([r for _, (r, _) in scored]).double(),
            torch.tensor([float(n) for (_, n), _ in scored], dtype=torch.float64),
            torch.tensor([float(n) for _, (_, n) in scored], dtype=torch.float64))  # fmt: skip


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
    folder = folders[LLAMA]
    other = save_model(base / "other", "llama", vocab_size=VOCAB, seed=7)
    pairs = _pairs(base / "data")
    refs: dict[Any, Any] = {(model, shared): _reference(path, base / "data", pairs, shared)
                            for model, path in folders.items() for shared in (True, False)}
    refs["other"] = _reference(folder, base / "data", pairs, True, reference=other)
    results: dict[str, Any] = {}
    for world in sorted({w for w, _, _, _ in LAYOUTS.values()}):
        runs = [(name, _overrides(str(folders[model]), str(base / "data"), shared, layout),
                 {"eval": str(other)} if name in EVALUATED else {})
                for name, (w, shared, layout, model) in LAYOUTS.items() if w == world]  # fmt: skip
        for name in REFERENCE_LAYOUTS:
            if LAYOUTS[name][0] == world:
                runs.append((f"reference/{name}", _overrides(str(folder), str(base / "data"), True, LAYOUTS[name][2]),
                             {"reference": str(other), "objectives": ("dpo",)}))  # fmt: skip
        if world == 2:
            ring = _overrides(str(folder), str(base / "data"), True, LAYOUTS["ring-cp2-zero2"][2])
            runs += [("scratch-reference", ring, {"reference": str(other), "scratch": True}),
                     ("scratch", [*ring, "train.objective=simpo"], {"scratch": True})]  # fmt: skip
        results.update(run_ranks(_rank, world, base, runs))
    return {"refs": refs, "runs": results, "pairs": pairs, "root": base / "data", "folder": folder, "other": other}


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


@pytest.mark.parametrize("layout", REFERENCE_LAYOUTS)
def test_a_reference_model_scores_the_table_in_the_models_place(setup: dict[str, Any], layout: str) -> None:
    """``train.preference.reference`` another model folder: the table holds its log-probs of
    every pair the rows keep (transformers' on each pair alone), and the DPO step that follows
    scores the starting weights against them: the starting weights were put back."""
    from ringtrain.train.corpus import PreparedCorpus
    from ringtrain.train.mixture import MixedSamples, SourceSpec

    root = setup["root"]
    samples = MixedSamples([PreparedCorpus(str(root))], [SourceSpec(str(root))], seq_len=SEQ, seed=SEED, packing="doc")
    rows = samples.pair_rows()
    kept = sorted(int(p) for p in rows.pairs)
    samples.close()
    assert kept
    table = setup["runs"][f"reference/{layout}/table"]
    chosen, rejected, _, _ = _pair_sums(setup["other"], setup["pairs"], kept)
    # A completion's sum of up to a few hundred fp32 log-probs: fp32's rounding, relative.
    np.testing.assert_allclose(table[kept, 0], chosen.numpy(), rtol=SUM_RTOL, atol=1e-5)
    np.testing.assert_allclose(table[kept, 1], rejected.numpy(), rtol=SUM_RTOL, atol=1e-5)
    starting, _, _, _ = _pair_sums(setup["folder"], setup["pairs"], kept[:4])
    assert float(np.abs(table[kept[:4], 0] - starting.numpy()).max()) > 1e-2  # another model's, not the policy's

    got, ref = setup["runs"][f"reference/{layout}/dpo"], setup["refs"]["other"]["dpo"]
    assert got["loss"] == pytest.approx(ref["loss"], abs=1e-5, rel=0)
    for key, value in ref["metrics"].items():
        assert got["metrics"][key] == pytest.approx(value, abs=1e-5, rel=1e-6), key
    assert abs(ref["loss"] - setup["refs"][(LLAMA, True)]["dpo"]["loss"]) > 1e-3  # the reference model made a difference


def test_a_model_trained_from_scratch_gets_its_starting_weights_back_after_the_reference(setup: dict[str, Any]) -> None:
    runs = setup["runs"]
    with_reference, plain = runs["scratch-reference"], runs["scratch"]
    assert plain["table"] is None and with_reference["table"] is not None
    np.testing.assert_allclose(with_reference["table"], runs["reference/ring-cp2-zero2/table"], rtol=SUM_RTOL, atol=1e-5)
    assert with_reference["params"].keys() == plain["params"].keys()
    for name, value in plain["params"].items():
        np.testing.assert_array_equal(with_reference["params"][name], value, err_msg=name)


@pytest.mark.parametrize("layout", EVALUATED)
def test_eval_of_preference_pairs_equals_transformers_on_each_pair_alone(setup: dict[str, Any], layout: str) -> None:
    """DPO against another model and SimPO, as `ringtrain eval` reports them: means over every
    pair that fits EVAL_SEQ tokens, each pair scored by transformers alone."""
    from ringtrain.commands.eval_pairs import PairsEval
    from ringtrain.config import PreferenceConfig
    from ringtrain.train.pairs import row_length
    from ringtrain.train.preference import Objective, PairScores, pair_losses

    got = setup["runs"][f"{layout}/eval"]
    pairs = setup["pairs"]
    fits = [j for j, (p, c, _, r, _) in enumerate(pairs) if row_length(len(p), len(c), len(r), True) <= EVAL_SEQ]
    assert 0 < len(fits) < len(pairs)  # some pairs are too long for the rows: left out
    scored = sorted(int(p) for row in got["pairs"].rows for p in row.pairs)
    assert scored == fits
    chosen, rejected, chosen_n, rejected_n = _pair_sums(setup["folder"], pairs, fits)
    ref_chosen, ref_rejected, _, _ = _pair_sums(setup["other"], pairs, fits)
    np.testing.assert_allclose(got["policy"][fits], torch.stack([chosen, rejected], 1).numpy(), rtol=SUM_RTOL, atol=1e-5)
    np.testing.assert_array_equal(got["counts"][fits], torch.stack([chosen_n, rejected_n], 1).numpy())
    np.testing.assert_allclose(got["table"][fits], torch.stack([ref_chosen, ref_rejected], 1).numpy(), rtol=SUM_RTOL, atol=1e-5)

    for name in ("dpo", "simpo"):
        settings = PreferenceConfig(**{k.rsplit(".", 1)[1]: v for k, v in OBJECTIVES[name].items()})
        objective = Objective.of(name, settings)
        result = PairsEval(got["pairs"], name, settings, reference="other" if name == "dpo" else "",
                           table=got["table"] if name == "dpo" else None).result(got["policy"], got["counts"])  # fmt: skip
        ref = (ref_chosen, ref_rejected) if name == "dpo" else (None, None)
        want = pair_losses(objective, PairScores(chosen, rejected, chosen_n, rejected_n, *ref))
        margins = want.chosen_rewards - want.rejected_rewards
        expected = {"pairs": len(fits), "loss": float(want.loss.mean()), "chosen_logps": float(chosen.mean()),
                    "rejected_logps": float(rejected.mean()), "reward_accuracy": float((margins > 0).double().mean()),
                    "reward_margin": float(margins.mean())}  # fmt: skip
        for key, value in expected.items():
            assert result[key] == pytest.approx(value, abs=1e-5, rel=0), (name, key)
        assert result["objective"] == name
