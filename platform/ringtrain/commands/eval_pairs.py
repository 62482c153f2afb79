"""`ringtrain eval SOURCE --data PREFERENCE_DATASET train.objective=...`: a preference objective's
numbers for SOURCE as the policy, every pair scored on the workers' mesh (``train/pairset.py``,
``train/reference.py``'s pass).

DPO and IPO score against ``train.preference.reference``. A model folder, run directory or
checkpoint named there is put in the model's place after the policy's pass (checked first, as
``ringtrain run`` checks it: ``commands/reference.py``). ``initial`` means SOURCE's own starting
weights: a model folder's are its own (the reference is the policy); a run's are the table its
checkpoint store holds for this dataset, layout and precision when it has one (the values its
training scored against), else the ``model.hf`` it started from, else its seeded initialisation,
scored before the checkpoint is loaded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ringtrain.commands.eval_source import EvalSource
from ringtrain.commands.reference import initial_identity, resolve_reference
from ringtrain.config import REFERENCE_INITIAL, REFERENCE_OBJECTIVES, JobConfig, PreferenceConfig
from ringtrain.errors import ConfigError
from ringtrain.train.reference_input import REFERENCE_KEY, ReferenceWeights

if TYPE_CHECKING:
    import numpy as np

    from ringtrain.actors.group import WorkerGroup
    from ringtrain.checkpoint import CheckpointStore
    from ringtrain.train.pairset import PairSet


@dataclasses.dataclass
class PairsEval:
    pairs: "PairSet"
    objective: str  # config.PREFERENCE_OBJECTIVES
    settings: PreferenceConfig
    reference: str = ""  # what the reference is, for the result ("": the objective needs none)
    weights: Optional[ReferenceWeights] = None  # put in the model's place after the policy's pass
    same: bool = False  # the policy's own weights
    early: bool = False  # the seeded start of a model trained from scratch, before the checkpoint loads
    store: Optional["CheckpointStore"] = None  # where the run keeps its table
    key: Optional[Callable[[str], dict[str, Any]]] = None  # its key on a device
    table: Optional["np.ndarray"] = None
    looked: bool = False

    def before_restore(self, group: "WorkerGroup") -> None:
        """Between the workers' start and the checkpoint's load: the run's stored table, else
        (a model trained from scratch) its starting weights' pass."""
        self._look_up(group.device)
        if self.table is None and self.early:
            self.table = group.score_pairs(self.pairs)[0]

    def score(self, group: "WorkerGroup") -> dict[str, Any]:
        """The policy's pass, then the reference's when it is still to take; the result."""
        self._look_up(group.device)
        policy, counts = group.score_pairs(self.pairs)
        if self.reference and self.table is None:
            self.table = policy if self.same else group.score_pairs(self.pairs, self.weights)[0]
        return self.result(policy, counts)

    def _look_up(self, device: str) -> None:
        if self.looked or self.store is None or self.key is None:
            return
        from ringtrain.checkpoint.reference_table import load_table

        self.looked = True
        found = load_table(self.store, self.key(device))
        if found.table is not None:
            self.table = found.table
            self.reference += f" (the run's table, read from {found.uri})"
        elif found.note:  # damaged, or not handed over: the reference is scored here instead
            self.reference += f" (the run's table not used: {found.note})"

    def result(self, policy: "np.ndarray", counts: "np.ndarray") -> dict[str, Any]:
        """The JSON object of the scored pairs (policy and reference tables ``[pairs, 2]``)."""
        import numpy as np
        import torch

        from ringtrain.train.preference import Objective, PairScores, report

        scored = np.asarray([p for row in self.pairs.rows for p in row.pairs], dtype=np.int64)

        def column(table: Optional[np.ndarray], side: int) -> Optional[torch.Tensor]:
            return None if table is None else torch.as_tensor(table[scored, side], dtype=torch.float64)

        scores = PairScores(column(policy, 0), column(policy, 1), column(counts, 0), column(counts, 1),
                            column(self.table, 0), column(self.table, 1))  # type: ignore[arg-type]  # fmt: skip
        layout = self.pairs.layout
        objective = Objective.of(self.objective, self.settings)
        out: dict[str, Any] = {"objective": self.objective, "pairs": int(len(scored)), "dropped": layout.dropped,
                               "truncated": layout.truncated, **report(objective, scores)}  # fmt: skip
        if self.reference:
            out["reference"] = self.reference
        return out


def plan_pairs(job: JobConfig, source: EvalSource, pairs: "PairSet", seq_len: int) -> PairsEval:
    """How the pairs of ``job``'s eval data are scored; every reference check, no cluster.
    ``job`` is the evaluation's (its objective and reference as overridden), ``seq_len`` the
    rows' length before padding."""
    objective = (job.train.objective, dataclasses.replace(job.train.preference))
    if job.train.objective not in REFERENCE_OBJECTIVES:
        return PairsEval(pairs, *objective)
    text = job.train.preference.reference
    if text != REFERENCE_INITIAL:
        resolved = resolve_reference(job)
        assert resolved is not None and resolved.weights is not None
        return PairsEval(pairs, *objective, reference=text, weights=resolved.weights)
    if source.checkpoint is None:
        return PairsEval(pairs, *objective, reference=f"{REFERENCE_INITIAL}: {source.where} itself", same=True)
    from ringtrain.actors.reference_keeper import run_key
    from ringtrain.checkpoint import open_store
    from ringtrain.checkpoint.layout import split_checkpoint_uri

    folder = _starting_folder(source)
    run_job = dataclasses.replace(source.job, model=dataclasses.replace(source.job.model, hf=folder))
    identity = initial_identity(run_job)
    scored_job = dataclasses.replace(job, data=dataclasses.replace(job.data, path=job.eval.data))
    store = open_store(split_checkpoint_uri(source.checkpoint.uri)[0])
    plan = PairsEval(pairs, *objective, reference=f"{REFERENCE_INITIAL}: the starting weights of {source.where}", store=store,
                     key=lambda device: run_key(scored_job, identity, device, seq_len=seq_len))  # fmt: skip
    if folder:
        plan.weights = ReferenceWeights(f"the run's starting weights ({folder})", folder=folder)
    else:
        plan.early = True
    return plan


def _starting_folder(source: EvalSource) -> str:
    """The Hugging Face folder a run started from: its config's ``model.hf``, else the one its
    checkpoint's meta records; "" for a model trained from scratch."""
    assert source.checkpoint is not None
    folder = source.tokenizer_folder or source.checkpoint.meta.get("hf_source") or ""
    if folder and not Path(folder).is_dir():
        raise ConfigError(REFERENCE_KEY, f"{REFERENCE_INITIAL}: {source.where} started from {folder}, which is not "
                          "here: name the reference model (a folder, run directory or checkpoint)")
    return str(folder)
