"""DPO's and IPO's reference table: kept in the checkpoint store under its key, given to every
world, and a reference model that cannot stand in for the model refused before any cluster.

- The store: a table written once reads back as it was, under its own key only; a table of
  another dataset, reference or layout, or one whose bytes were changed, is not used (and why
  is said); the object is the whole table or nothing.
- The keeper: a fresh run's first world is given the weights and hands its table back, which is
  stored once; every later world is given the table, as is a later run of the same store.
- ``train.preference.reference`` of another vocabulary, shape or tokenizer: exit 2 naming the
  key, from ``ringtrain run`` and ``ringtrain eval`` alike (with torch, Ray and DeepSpeed
  refusing to be imported: nothing heavy is loaded first); a preference dataset evaluated under
  ``lm``, or text under ``dpo``, likewise names ``train.objective``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ringtrain import cli, config
from ringtrain.actors import reference_keeper
from ringtrain.actors.reference_keeper import ReferenceKeeper, run_key
from ringtrain.checkpoint import open_store
from ringtrain.checkpoint.reference_table import TABLES_DIR, load_table, object_key, save_table, table_key
from ringtrain.commands.eval_pairs import PairsEval
from ringtrain.commands.reference import initial_identity, resolve_reference
from ringtrain.errors import ConfigError
from ringtrain.train.reference_input import REFERENCE_KEY, Reference, ReferenceWeights
from ringtrain_dev.tiny_tokenizer import save_chat_tokenizer, save_tokenizer

from tests.unit.test_eval_cli_errors import LLAMA, run_cli

VOCAB = 320


def _key(**changes: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"dataset": "d" * 64, "num_pairs": 5, "reference": {"initial": {"seed": 0}},
                              "model": {"dim": 128, "rope_theta": 10000.0, "sliding_window": None}, "seq_len": 64,
                              "prefix_sharing": True, "overlong": "drop", "precision": {"dtype": "auto", "device": "cpu"}}
    fields.update(changes)
    return table_key(**fields)


def test_a_table_reads_back_under_its_own_key_only(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri())
    table = np.arange(10, dtype=np.float64).reshape(5, 2) - 100.5
    uri = save_table(store, _key(), table)
    assert uri.startswith(tmp_path.as_uri()) and f"/{TABLES_DIR}/" in uri
    found = load_table(store, _key())
    np.testing.assert_array_equal(found.table, table)
    assert found.note == ""
    for other in (_key(dataset="e" * 64), _key(reference={"folder": {"path": "/m"}}), _key(model={"dim": 128, "rope_theta": 5e5}),
                  _key(seq_len=128), _key(prefix_sharing=False), _key(precision={"dtype": "bf16", "device": "cuda"})):  # fmt: skip
        assert object_key(other) != object_key(_key())
        assert load_table(store, other).table is None and load_table(store, other).note == ""
    assert store.list() == []  # no checkpoint: the table is no step of the store


def test_a_damaged_or_foreign_table_is_not_used_and_says_why(tmp_path: Path) -> None:
    store = open_store(tmp_path.as_uri())
    save_table(store, _key(), np.ones((5, 2)))
    path = tmp_path / object_key(_key())
    blob = path.read_bytes()
    path.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    assert "fails its sha256 check" in load_table(store, _key()).note
    # Another key's table where this key's belongs (a digest collision, or a copied file).
    save_table(store, _key(seq_len=32), np.ones((5, 2)))
    path.write_bytes((tmp_path / object_key(_key(seq_len=32))).read_bytes())
    found = load_table(store, _key())
    assert found.table is None and "taken for another dataset, reference or layout" in found.note
    path.write_bytes(b"not a table")
    assert "is not a reference table" in load_table(store, _key()).note
    with pytest.raises(ValueError, match="shape"):
        save_table(store, _key(), np.ones((4, 2)))


def test_a_table_keyed_by_a_checkpoint_of_many_shards_reads_back(tmp_path: Path) -> None:
    """A checkpoint reference's key holds every shard's checksum: 2,000 of them make a header
    of ~150 KB, which the read takes whole (its limit is this key's header and values)."""
    store = open_store(tmp_path.as_uri())
    checksums = [f"sha256x64m:{i:064x}" for i in range(2000)]
    key = _key(reference={"checkpoint": "file:///runs/a/checkpoints/step-9", "step": 9, "shards": checksums})
    table = np.linspace(-9.0, -1.0, 10).reshape(5, 2)
    save_table(store, key, table)
    found = load_table(store, key)
    assert found.note == "" and found.table is not None
    np.testing.assert_array_equal(found.table, table)
    path = tmp_path / object_key(key)
    path.write_bytes(path.read_bytes() + b"\0")  # one byte more than this key's table holds: not read
    assert "is larger than a table of 5 pairs" in load_table(store, key).note


def test_a_hostile_table_is_computed_again_with_a_line_saying_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The header is JSON from elsewhere: one nested 20,000 deep is not a table (no traceback);
    an object the store refuses to read (a symbolic link), or a read that fails, costs the
    table's reuse, never the run: the keeper computes it again, saying why in one line."""
    store = open_store(tmp_path.as_uri())
    big = _key(reference={"checkpoint": "file:///runs/a/checkpoints/step-9", "shards": [f"{i:075}" for i in range(500)]})
    deep = tmp_path / object_key(big)  # a header of this key may take 38 KB
    deep.parent.mkdir(parents=True)
    deep.write_bytes(b"[" * 20_000 + b"\n" + bytes(80))
    assert "is not a reference table" in load_table(store, big).note
    path = tmp_path / object_key(_key())
    said: list[str] = []
    (tmp_path / "elsewhere.table").write_bytes(b"anything")
    path.symlink_to(tmp_path / "elsewhere.table")
    keeper = ReferenceKeeper(_key(), None, store=store, say=said.append)
    assert keeper.table is None and keeper.join_input() == Reference()
    evaluated = PairsEval(None, "dpo", config.PreferenceConfig(), reference="initial", store=store,  # type: ignore[arg-type]
                          key=lambda device: _key())  # fmt: skip
    evaluated._look_up("cpu")  # ringtrain eval of the run: the pairs' reference scored instead, and said so
    assert evaluated.table is None and "the run's table not used: could not read" in evaluated.reference
    path.unlink()
    save_table(store, _key(), np.ones((5, 2)))

    def denied(name: str, size_hint: Any = None, limit: Any = None) -> bytes:
        raise PermissionError(13, "Permission denied\nsecond line")

    monkeypatch.setattr(store.backend, "get", denied)
    ReferenceKeeper(_key(), None, store=store, say=said.append)
    assert len(said) == 2 and all(line.startswith(f"reference log-probs: could not read {store.backend.uri(object_key(_key()))}: ")
                                  and line.endswith("; computing them again") for line in said)  # fmt: skip
    assert "UnsafeObject" in said[0] and "PermissionError: [Errno 13] Permission denied;" in said[1]


def test_the_keeper_stores_the_first_worlds_table_once_and_gives_it_to_every_later_world(tmp_path: Path) -> None:
    said: list[str] = []
    store = open_store(tmp_path.as_uri())
    weights = ReferenceWeights("a model", folder="/m")
    keeper = ReferenceKeeper(_key(), weights, store=store, say=said.append)
    assert keeper.join_input() == Reference(weights=weights)  # the first world computes it
    table = np.full((5, 2), -3.0)
    keeper.learned(table)
    keeper.learned(table + 1)  # a later world's would be the same; it is never asked, never stored
    assert keeper.computed == 1 and keeper.uri.endswith(".table")
    given = keeper.join_input()
    assert given.weights is None and given.table is not None
    np.testing.assert_array_equal(given.table, table)
    again = ReferenceKeeper(_key(), weights, store=store, say=said.append)  # the run resumed
    assert again.computed == 0 and again.join_input().weights is None
    np.testing.assert_array_equal(again.join_input().table, table)
    assert any("stored in" in line for line in said) and any("read from" in line for line in said)
    memory = ReferenceKeeper(_key(), None, store=None)  # no store (no snapshots): this run's worlds only
    memory.learned(table)
    np.testing.assert_array_equal(memory.join_input().table, table)


def test_the_group_hands_each_world_the_keepers_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first world is given the weights to compute the table with and rank 0's table is
    taken back; the next world (a resize, a recovery) is given that table."""
    import ray

    from ringtrain.actors import group as group_module
    from ringtrain.actors import world as world_module
    from ringtrain.actors.group import WorkerGroup
    from ringtrain.actors.roster import Member, Slot
    from ringtrain.status import WorkerInfo

    given: list[Reference] = []
    asked: list[str] = []

    def form_world(members: list[Member], job: config.JobConfig, *, reference: Any, **_: Any) -> Any:
        given.append(reference)
        return world_module.World(0, 10, {})

    class Handle:
        class reference_table:  # noqa: N801 - an actor method's handle
            @staticmethod
            def remote() -> str:
                asked.append("reference_table")
                return "table-ref"

    monkeypatch.setattr(ray, "put", lambda value: value)
    monkeypatch.setattr(world_module, "form_world", form_world)
    monkeypatch.setattr(reference_keeper, "pair_rows", lambda job: 3)  # what the first world's join is timed by
    monkeypatch.setattr(group_module, "get", lambda ref, **_: np.full((5, 2), -1.0))
    g = WorkerGroup(config.JobConfig(), "cpu")
    g.reference = ReferenceKeeper(_key(), ReferenceWeights("m", folder="/m"), store=None)
    g.members = [Member(Handle(), Slot("pg", 0), info=WorkerInfo(0, "h", 1, "cpu", "n"))]
    g.form_world(g.members, g.job)
    g.form_world(g.members, g.job)
    assert given[0] == Reference(weights=ReferenceWeights("m", folder="/m"))
    assert given[1].weights is None and given[1].table is not None and asked == ["reference_table"]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pairs")
    tokenizer = save_chat_tokenizer(root / "tok", "chatml", vocab_size=VOCAB)
    records = [{"prompt": "why a ring", "chosen": f"the rank {i}", "rejected": "no"} for i in range(12)]
    (root / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert cli.main(["prepare", str(root / "pairs.jsonl"), "--format", "preference", "--tokenizer", str(tokenizer),
                     "--out", str(root / "data"), "--quiet"]) == 0  # fmt: skip
    return root


def _model(folder: Path, *, vocab: int = VOCAB, tokenizer: Any = None, **changes: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": vocab, **changes}))
    if tokenizer is not None:
        tokenizer(folder)
    return folder


def test_the_key_follows_the_dataset_and_the_starting_weights(pairs: Path, tmp_path: Path) -> None:
    job = config.load(None, [f"data.path={pairs / 'data'}", "data.packing=doc", "train.objective=dpo", "data.seq_len=64",
                             f"model.vocab_size={VOCAB}"])  # fmt: skip
    key = run_key(job, initial_identity(job), "cpu")
    assert key["num_pairs"] == 12 and len(key["dataset"]) == 64
    assert 1 <= reference_keeper.pair_rows(job) < 12  # rows of pairs the pass scores: several pairs to a row
    assert run_key(job, initial_identity(job), "cpu") == key
    assert run_key(config.replace(job, ["train.seed=1"]), initial_identity(config.replace(job, ["train.seed=1"])), "cpu") != key
    assert run_key(job, initial_identity(job), "cuda") != key
    assert run_key(config.replace(job, ["data.seq_len=32"]), initial_identity(job), "cpu") != key
    # The same weights scored under other forward settings: another table.
    for changed in ("model.rope_theta=500000", "model.sliding_window=16", "model.max_position_embeddings=4096",
                    "model.rope_scaling={rope_type: linear, factor: 2.0}", "model.norm_eps=1e-6"):  # fmt: skip
        assert run_key(config.replace(job, [changed]), initial_identity(job), "cpu") != key, changed
    assert run_key(config.replace(job, ["model.rope_theta=10000"]), initial_identity(job), "cpu") == key  # its default
    folder = _model(tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"weights")
    before = initial_identity(config.replace(job, [f"model.hf={folder}"]))
    (folder / "model.safetensors").write_bytes(b"other weights")
    assert initial_identity(config.replace(job, [f"model.hf={folder}"])) != before


def test_a_reference_of_another_tokenizer_is_refused_naming_the_key(tmp_path: Path) -> None:
    from ringtrain.hf import resolve_job

    model = _model(tmp_path / "model", tokenizer=lambda f: save_chat_tokenizer(f, "chatml", vocab_size=VOCAB))
    other = _model(tmp_path / "other", tokenizer=lambda f: save_tokenizer(f))
    job = resolve_job(config.load(None, [f"model.hf={model}", "train.objective=dpo", f"train.preference.reference={other}"]))
    with pytest.raises(ConfigError) as refused:
        resolve_reference(job)
    assert refused.value.key == REFERENCE_KEY and "speaks another tokenizer" in refused.value.reason
    wider = _model(tmp_path / "wider", intermediate_size=128)
    with pytest.raises(ConfigError, match="is another architecture .*ffn_dim=128"):
        resolve_reference(config.replace(job, [f"train.preference.reference={wider}"]))
    with pytest.raises(ConfigError, match="no such run directory, checkpoint or model folder"):
        resolve_reference(config.replace(job, [f"train.preference.reference={tmp_path / 'nowhere'}"]))
    assert resolve_reference(config.replace(job, ["train.objective=simpo", "train.preference.reference=initial"])) is None


def _one_line(proc: Any, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and expected in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


def test_run_refuses_a_reference_of_another_vocabulary_before_anything_heavy(pairs: Path, tmp_path: Path) -> None:
    other = _model(tmp_path / "other", vocab=96)
    proc = run_cli(tmp_path, "run", str(Path(__file__).resolve().parents[2] / "jobs" / "quickstart.yaml"),
                   f"model.vocab_size={VOCAB}", f"data.path={pairs / 'data'}", "data.packing=doc", "data.seq_len=64",
                   "train.objective=dpo", f"train.preference.reference={other}")  # fmt: skip
    _one_line(proc, f"train.preference.reference: {other} has a vocabulary of 96 tokens, the model {VOCAB}")


EVAL_CASES = {
    "pairs-under-lm": ([], "train.objective: lm, but {data} is a preference dataset"),
    "text-under-dpo": (["--data-is-text", "train.objective=dpo"], "train.objective: dpo trains on preference pairs, and "
                       "stdlib holds text (make one with `ringtrain prepare --format preference`); to score its "
                       "next-token loss, pass train.objective=lm"),
    "reference-of-another-vocabulary": (["train.objective=dpo", "train.preference.reference={other}"],
                                        "train.preference.reference: {other} has a vocabulary of 96 tokens"),
    "reference-for-simpo": (["train.objective=simpo", "train.preference.reference={other}"],
                            "train.preference.reference: {other}, but simpo scores against no reference model"),
}  # fmt: skip


@pytest.mark.parametrize(("extra", "expected"), EVAL_CASES.values(), ids=EVAL_CASES.keys())
def test_eval_of_pairs_refuses_bad_input_with_one_line(pairs: Path, tmp_path: Path, extra: list[str], expected: str) -> None:
    model = _model(tmp_path / "model", tokenizer=lambda f: shutil.copy(pairs / "tok" / "tokenizer.json", f))
    other = _model(tmp_path / "other", vocab=96)
    names = {"data": pairs / "data", "other": other}
    data = "stdlib" if "--data-is-text" in extra else str(pairs / "data")
    args = [a.format(**names) for a in extra if a != "--data-is-text"]
    proc = run_cli(tmp_path, "eval", str(model), "--data", data, "--json", *args)
    _one_line(proc, expected.format(**names))


def test_eval_of_pairs_none_fit_names_seq_len(pairs: Path, tmp_path: Path) -> None:
    """eval's rows of pairs are --seq-len long (the job's data.seq_len only its default): a length no
    pair fits names the option."""
    from ringtrain.commands.eval import prepare

    model = _model(tmp_path / "model", tokenizer=lambda f: shutil.copy(pairs / "tok" / "tokenizer.json", f))
    args = cli._parser().parse_args(["eval", str(model), "--data", str(pairs / "data"), "--seq-len", "8", "train.objective=simpo"])
    with pytest.raises(ConfigError) as refused:
        prepare(args)
    assert refused.value.key == "--data" and refused.value.reason == ("no preference pair fits --seq-len 8 (all 12 are longer; "
                                                              "raise --seq-len or set data.chat_overlong: truncate_start)")


def test_a_checkpoint_reference_is_read_only_as_it_is_handed_to_the_workers(tmp_path: Path) -> None:
    """Its shards (with both Adam moments: a 7B model's ~84 GB) are not held on the driver: read
    from the store as they are pickled for the workers, each time, and never by a run whose
    table the store holds. The keeper lets go of the weights once it knows the table."""
    import pickle

    from ringtrain.actors.resume import checkpoint_meta

    shape = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.n_kv_heads=2", f"model.vocab_size={VOCAB}"]
    store_dir = tmp_path / "ref"
    shards = {"rank-0": b"rank 0's state", "rank-1": b"rank 1's state"}
    open_store(store_dir.as_uri()).save(7, shards, checkpoint_meta(config.load(None, shape)))
    job = config.load(None, [*shape, "train.objective=dpo", f"train.preference.reference={store_dir}"])
    step_dir = store_dir / "step-000000007"
    for name, blob in shards.items():  # damaged while it is resolved: the driver reads the manifest alone
        (step_dir / name).write_bytes(bytes(len(blob)))
    resolved = resolve_reference(job)
    for name, blob in shards.items():
        (step_dir / name).write_bytes(blob)
    assert resolved is not None and resolved.weights is not None
    assert resolved.weights.shards == () and resolved.identity["step"] == 7
    handed = pickle.loads(pickle.dumps(Reference(weights=resolved.weights)))  # as ray.put hands it over
    assert handed.weights == ReferenceWeights(resolved.weights.where, shards=(shards["rank-0"], shards["rank-1"]))

    store = open_store((tmp_path / "run").as_uri())
    fresh = ReferenceKeeper(_key(), resolved.weights, store=store)
    assert fresh.join_input().weights is resolved.weights
    fresh.learned(np.ones((5, 2)))
    assert fresh.weights is None
    for name in shards:  # the reference checkpoint's shards gone: a run that has its table never asks
        (store_dir / "step-000000007" / name).unlink()
    resumed = ReferenceKeeper(_key(), resolved.weights, store=store)
    assert resumed.weights is None and pickle.loads(pickle.dumps(resumed.join_input())).table is not None
    with pytest.raises(Exception, match="rank-0"):
        pickle.dumps(resolved.weights)  # a world that would compute the table reads the shards
