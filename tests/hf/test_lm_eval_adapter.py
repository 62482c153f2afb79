"""ringtrain as lm-evaluation-harness' model against lm-eval's own Hugging Face model, in one
process: local YAML tasks of each request kind (tests/hf/lm_eval_tasks.py) give the same metrics,
and the same generated text sample by sample, with the requests answered by a CP group of one rank
and by a ring of two (emulated: every rank a thread, tests/emulated_cp.py, the real decode and
scoring code), where ``ringtrain eval --tasks`` answers them from its workers (the Ray tier's
tests/ray/test_eval_e2e.py runs the command itself on a ring of two)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from ringtrain_dev.emulated_cp import EmulatedGroups
from tests.hf.lm_eval_tasks import MAX_LENGTH, OFFLINE, TASKS, assert_same_results, hf_reference, require_lm_eval, write_tasks
from tests.hf_models import save_model
from ringtrain_dev.tiny_tokenizer import save_tokenizer

pytestmark = [pytest.mark.slow]


class EmulatedMesh:
    """The workers' ``score`` and ``generate`` on one emulated CP group of ``ring`` ranks."""

    def __init__(self, folder: Path, ring: int) -> None:
        from ringtrain import config
        from ringtrain.hf import resolve_job
        from ringtrain.hf.weights import PretrainedWeights, load_full
        from ringtrain.topology import CPLayout
        from ringtrain.train.model import ModelArgs, Transformer

        job = resolve_job(config.load(None, [f"model.hf={folder}", f"data.seq_len={MAX_LENGTH}"]))
        self.groups = EmulatedGroups(CPLayout(ring, 1, "ring"), timeout_s=120.0)
        self.models = []
        for rank in range(ring):
            attention = self.groups.attention(rank)
            model = Transformer(ModelArgs.from_job(job), attention_fn=attention, init_std=None)
            load_full(model, PretrainedWeights(folder))
            self.models.append((model.eval(), attention))
        from ringtrain.evaluation.tokenizer import find_tokenizer

        tokenizer = find_tokenizer(str(folder))
        assert tokenizer is not None
        self.decode = tokenizer.decode

    def _run(self, call: Callable[[Any], Any]) -> Any:
        from ringtrain.train.decode import Decoder

        def rank_main(rank: int) -> Any:
            model, attention = self.models[rank]
            with torch.no_grad():
                return call(Decoder(model, attention, torch.device("cpu")))

        done = self.groups.run(rank_main)
        assert all(d == done[0] for d in done)
        return done[0]

    def score(self, request: Any) -> list[tuple[float, bool]]:
        return self._run(lambda d: d.score(request.sequences, request.scored))  # type: ignore[no-any-return]

    def generate(self, request: Any) -> list[list[int]]:
        return self._run(lambda d: d.generate(request.prompts, request.max_new, sampling=request.sampling,  # type: ignore[no-any-return]
                                              stop=request.stop, decode=self.decode))


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict[str, Any]]:
    require_lm_eval()
    root = tmp_path_factory.mktemp("lm-eval")
    with pytest.MonkeyPatch.context() as env:
        for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(root / "cache")}.items():
            env.setenv(name, value)
        model = save_tokenizer(save_model(root / "model", "llama"))
        tasks = write_tasks(root / "tasks")
        return model, tasks, hf_reference(model, tasks)


@pytest.mark.parametrize("ring", [1, 2], ids=["cp1", "ring-cp2"])
def test_tasks_give_lm_eval_hf_metrics(ring: int, setup: tuple[Path, Path, dict[str, Any]],
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    from transformers import AutoTokenizer

    from ringtrain.commands.lm_eval_model import RingtrainLM

    model, tasks, want = setup
    for name, value in {**OFFLINE, "HF_DATASETS_CACHE": str(tasks.parent / "cache")}.items():
        monkeypatch.setenv(name, value)
    lm = RingtrainLM(EmulatedMesh(model, ring), AutoTokenizer.from_pretrained(model), MAX_LENGTH)
    got = simple_evaluate(model=lm, tasks=list(TASKS), task_manager=TaskManager(include_path=str(tasks)),
                          log_samples=True)
    assert_same_results(got, want)
    for task in ("tiny_gen", "tiny_mc"):
        mine = [s["filtered_resps"] for s in got["samples"][task]]
        theirs = [s["filtered_resps"] for s in want["samples"][task]]
        if task == "tiny_gen":
            assert mine == theirs
            assert any(r[0] for r in theirs), "the model wrote something before its stop"
        else:
            assert [[bool(g) for _, g in r] for r in mine] == [[bool(g) for _, g in r] for r in theirs]
            assert all(abs(a[0] - b[0]) < 1e-4 for rm, rt in zip(mine, theirs) for a, b in zip(rm, rt))
