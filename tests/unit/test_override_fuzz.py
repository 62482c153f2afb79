"""Fuzzed ``key=value`` overrides: every one loads or is refused with one ConfigError line.

The command line turns a ConfigError into one stderr line and exit 2, and any other exception
into a traceback; so "never a traceback, always exit 0 or 2" is: ``config.load`` (and
``config.merge``, which ``ringtrain eval`` applies to its source's job) returns a job or raises
a ConfigError whose text is one line. Overrides are drawn by a seeded generator from keys and
values users write and mistype: list elements in both index forms, nested keys, quotes, empty
values, unknown keys, brackets, '=' in values, unicode.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from ringtrain import cli, config
from ringtrain.config.keys import schema_keys
from ringtrain.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
JOBS = (REPO / "jobs" / "quickstart.yaml", REPO / "jobs" / "your-own-data.yaml")  # no list / a 2-source list
LIST_KEYS = (
    "data.sources[0].path", "data.sources.0.path", "data.sources[1].weight", "data.sources.1.long_doc_tokens",
    "data.sources[-1].path", "data.sources[2].path", "data.sources[0]", "data.sources.0", "data.sources",
    "train.skip_batches[0]", "eval.passkey_depths[1]", "eval.passkey_depths.4", "chaos.faults[0].kind",
    "model.layer_types[0]", "data.sources[x].path", "data.sources[0][1]", "data.sources[0].path.more",
    "data.sources[", "data.sources]0[", "data.sources[]", "data.sources[0", "data.sources..0",
)  # fmt: skip
ODD_KEYS = (
    "", " ", ".", "..", "a..b", "[0]", "mesh..dp", " mesh.dp", "mesh.dp ", "ünï.côdé", "model.rope_scaling.factor",
    "name.sub", "-x", "--train.steps", "train", "mesh", "model.rope_scaling", "telemetry.mlflow.tags.team",
    "telemetry.mlflow.tags", "cluster.address", "model.hf", "a=b", "日本.語",
)  # fmt: skip
VALUES = (
    "", "0", "-1", "1", "2", "3.5", "1e-3", "nan", "inf", "-inf", "true", "null", "~", "'quoted'", '"dq"',
    "'unterminated", '"', "a=b", "=", "==", "x=y=z", "[1,2]", "[]", "[", "]", "{}", "{", "}", "{path: /x}",
    "[{path: /x, weight: 2}]", "[{bogus: 1}]", "/x", "ünïcödé", "日本語", "${train.lr}", "${nope}",
    "${oc.env:HOME}", "\\${x}", "???", "a b c", "#comment", "&a [1]", "*a", "- 1", ": x", "[[[[1]]]]",
    "{rope_type: linear, factor: 2.0}", "{factor: [1]}", "\t", "[full_attention, sliding_attention]",
    "[" * 50 + "]" * 50, "&a [&b [*b]]", "{a: {b: {c: {d: 1}}}}", "0x10", "1_000", "2024-01-01", "!!python/name:os.system",
)  # fmt: skip
# Overrides that load on both jobs, mixed in so that cases also reach a job that loads.
GOOD = (
    "train.steps=20", "train.lr=1e-3", "mesh.dp=1", "name=fuzz", "data.seq_len=1024", "train.skip_batches=[3]",
    "model.rope_scaling={rope_type: linear, factor: 2.0}", "telemetry.mlflow.tags.team=ünï", "data.cache_dir=a=b",
    "eval.passkey_depths=[0, 1]", "cluster.address=", "run_dir='/tmp/x y'", "eval.passkey_depths[1]=0.5",
)  # fmt: skip
NUM_CASES = 100


def _key(rng: random.Random) -> str:
    pick = rng.random()
    if pick < 0.4:
        return rng.choice(LIST_KEYS)
    if pick < 0.6:
        return rng.choice(ODD_KEYS)
    key = rng.choice(schema_keys()).replace("[]", f"[{rng.randint(-1, 2)}]")
    if pick < 0.75 and key:  # a typo: a letter dropped, doubled or swapped
        i = rng.randrange(len(key))
        key = rng.choice([key[:i] + key[i + 1 :], key[:i] + key[i] + key[i:], key[:i] + "x" + key[i + 1 :]])
    return key


def _override(rng: random.Random) -> str:
    if rng.random() < 0.4:
        return rng.choice(GOOD)
    if rng.random() < 0.05:
        return _key(rng)  # no '=' at all
    return f"{_key(rng)}={rng.choice(VALUES)}"


def _cases(seed: int = 46, num_cases: int = NUM_CASES) -> list[tuple[Path, list[str], bool]]:
    rng = random.Random(seed)
    return [
        (rng.choice(JOBS), [_override(rng) for _ in range(rng.randint(1, 3))], rng.random() < 0.25)
        for _ in range(num_cases)
    ]


def _exit_code(job: Path, overrides: list[str], via_merge: bool) -> int:
    """What the command line would exit with: 0 loaded, 2 a ConfigError of one line; any other
    exception propagates (a traceback, which fails the test)."""
    try:
        if via_merge:
            config.replace(config.load(job), overrides)
        else:
            config.load(job, overrides)
    except ConfigError as exc:
        assert "\n" not in str(exc), (overrides, str(exc))
        assert exc.key, (overrides, str(exc))
        return cli.EXIT_USAGE
    return 0


def test_fuzzed_overrides_load_or_fail_in_one_line() -> None:
    codes = [_exit_code(job, overrides, via_merge) for job, overrides, via_merge in _cases()]
    # The generator reaches both outcomes, so the test says something about each.
    assert codes.count(0) >= 10 and codes.count(cli.EXIT_USAGE) >= 10


@pytest.mark.parametrize(
    ("overrides", "path", "weight"),
    [
        (["data.sources[0].path=/x"], "/x", 3.0),
        (["data.sources.0.path=/x"], "/x", 3.0),
        (["data.sources[0].weight=5", "data.sources[0].path=/y"], "/y", 5.0),
        (["data.sources.0={path: /z}"], "/z", 3.0),  # merged into the element: its weight stays
        (["data.sources[-2].path=/x"], "/x", 3.0),
    ],
)
def test_one_list_element_is_overridden_in_place(overrides: list[str], path: str, weight: float) -> None:
    job = config.load(JOBS[1], overrides)
    first, second = job.data.sources
    assert (first.path, first.weight, first.long_doc_upsample) == (path, weight, 2.0)
    assert second.path.endswith("docs") and second.weight == 1.0


@pytest.mark.parametrize(
    ("job", "overrides", "expected"),
    [
        (JOBS[0], ["data.sources[0].path=/x"], "data.sources[0]: data.sources has 0 elements, so there is no [0]"),
        (JOBS[1], ["data.sources.2.path=/x"], "data.sources[2]: data.sources has 2 elements, so there is no [2]"),
        (JOBS[1], ["data.sources.first.path=/x"], "data.sources: is a list: name an element by its index"),
        (JOBS[1], ["data.sources[0].pth=/x"], "data.sources[0].pth: unknown key (did you mean data.sources[0].path?)"),
        (JOBS[0], ["train.step=20"], "train.step: unknown key (did you mean train.steps?)"),
        (JOBS[0], ["--train.steps=20"], "no leading dashes"),
        (JOBS[0], ["model.hf="], "model.hf: needs a value"),
    ],
)
def test_list_and_key_mistakes_are_one_line_naming_the_key(job: Path, overrides: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        config.load(job, overrides)
    assert expected in str(caught.value) and "\n" not in str(caught.value)
