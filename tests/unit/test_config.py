"""The job config: defaults, YAML + dotlist merging, derived values, and errors that name the key."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from ringtrain import config
from ringtrain.config import JobConfig, MeshConfig
from ringtrain.errors import ConfigError


def test_defaults_load_and_equal_the_dataclass_defaults() -> None:
    job = config.load()
    expected = JobConfig()
    config.fill_model_defaults(expected)  # a from-scratch model's unset shape keys
    assert job == expected
    assert (job.model.dim, job.model.vocab_size) == (config.MODEL_DEFAULTS["dim"], config.MODEL_DEFAULTS["vocab_size"])
    assert (job.mesh.dp, job.mesh.cp, job.mesh.ulysses) == (1, 1, None)
    assert job.attention.impl == "ring"
    assert job.data.path == config.STDLIB_CORPUS


def test_yaml_file_then_overrides_merge_in_order(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("name: merged\nmesh:\n  dp: 2\ntrain:\n  global_batch: 8\n  steps: 7\n")

    job = config.load(job_file, ["train.global_batch=4", "model.dim=64"])

    assert job.name == "merged"
    assert job.mesh.dp == 2  # from the file
    assert job.train.steps == 7  # from the file
    assert job.train.global_batch == 4  # the override beats the file
    assert job.model.dim == 64  # an override of a key the file does not set
    assert job.model.n_heads == config.MODEL_DEFAULTS["n_heads"]  # untouched: the default


def test_load_accepts_a_string_path(tmp_path: Path) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text("train:\n  steps: 3\n")
    assert config.load(str(job_file)).train.steps == 3


def test_an_empty_yaml_file_means_all_defaults(tmp_path: Path) -> None:
    job_file = tmp_path / "empty.yaml"
    job_file.write_text("")
    assert config.load(job_file) == config.load()


def test_override_values_are_converted_to_the_field_type() -> None:
    job = config.load(None, ["train.lr=1e-4", "telemetry.progress=false", "mesh.ulysses=1", "model.ffn_dim=96"])
    assert job.train.lr == pytest.approx(1e-4) and isinstance(job.train.lr, float)
    assert job.telemetry.progress is False
    assert job.mesh.ulysses == 1
    assert job.model.ffn_dim == 96


@pytest.mark.parametrize(
    ("overrides", "ulysses", "ring"),
    [
        pytest.param(["mesh.cp=4"], 1, 4, id="ring-defaults-to-ulysses-1"),
        pytest.param(["mesh.cp=4", "mesh.ulysses=1"], 1, 4, id="ring-explicit-ulysses-1"),
        pytest.param(["mesh.cp=4", "attention.impl=ulysses"], 4, 1, id="ulysses-defaults-to-cp"),
        pytest.param(["mesh.cp=4", "attention.impl=ulysses", "mesh.ulysses=4"], 4, 1, id="ulysses-explicit"),
        pytest.param(["mesh.cp=4", "attention.impl=hybrid", "mesh.ulysses=2"], 2, 2, id="hybrid-2x2"),
        pytest.param(["mesh.cp=8", "attention.impl=hybrid", "mesh.ulysses=4"], 4, 2, id="hybrid-2x4"),
        pytest.param(["mesh.cp=1"], 1, 1, id="no-cp"),
    ],
)
def test_ulysses_and_ring_degrees(overrides: list[str], ulysses: int, ring: int) -> None:
    job = config.load(None, overrides)
    assert job.ulysses_degree == ulysses
    assert job.ring_degree == ring
    assert job.ring_degree * job.ulysses_degree == job.mesh.cp


@pytest.mark.parametrize(
    ("dp", "cp", "micro_batch", "global_batch", "world", "accum"),
    [
        pytest.param(1, 1, 1, 2, 1, 2, id="single"),
        pytest.param(2, 2, 1, 4, 4, 2, id="dp2-cp2"),
        pytest.param(4, 2, 2, 16, 8, 2, id="dp4-micro2"),
        pytest.param(2, 4, 1, 2, 8, 1, id="no-accumulation"),
    ],
)
def test_world_size_and_grad_accum_steps(
    dp: int, cp: int, micro_batch: int, global_batch: int, world: int, accum: int
) -> None:
    job = config.load(
        None,
        [f"mesh.dp={dp}", f"mesh.cp={cp}", f"train.micro_batch={micro_batch}", f"train.global_batch={global_batch}"],
    )
    assert job.world_size == world
    assert job.grad_accum_steps == accum
    assert job.grad_accum_steps * dp * micro_batch == global_batch


@pytest.mark.parametrize(
    ("overrides", "ffn_dim"),
    [
        pytest.param(["model.dim=128"], 352, id="8/3*128=341-rounds-up-to-352"),
        pytest.param(["model.dim=96"], 256, id="8/3*96=256-already-a-multiple"),
        pytest.param(["model.dim=64"], 192, id="8/3*64=170-rounds-up-to-192"),
        pytest.param(["model.dim=128", "model.ffn_dim=100"], 100, id="explicit-wins"),
    ],
)
def test_ffn_dim(overrides: list[str], ffn_dim: int) -> None:
    assert config.load(None, overrides).ffn_dim == ffn_dim


def test_to_yaml_round_trips_through_load(tmp_path: Path) -> None:
    job = config.load(
        None,
        [
            "name=round-trip",
            "mesh.dp=2",
            "mesh.cp=4",
            "attention.impl=hybrid",
            "mesh.ulysses=2",
            "train.global_batch=8",
            "train.lr=2.5e-4",
            "model.ffn_dim=96",
            "zero.stage=3",
            "zero.offload_params=true",
            "cluster.address=ray://head:10001",
        ],
    )
    job_file = tmp_path / "resolved.yaml"
    job_file.write_text(config.to_yaml(job))
    assert config.load(job_file) == job


def test_replace_returns_a_validated_copy() -> None:
    job = config.load(None, ["mesh.dp=2", "train.global_batch=4"])
    resized = config.replace(job, ["mesh.dp=4"])
    assert resized.mesh.dp == 4
    assert resized.grad_accum_steps == 1
    assert job.mesh.dp == 2  # the original is untouched
    assert dataclasses.replace(resized, mesh=job.mesh) == job  # nothing else changed


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        pytest.param(["mesh.dp=3"], "train.global_batch", id="invalid-value"),
        pytest.param(["mesh.bogus=1"], "mesh.bogus", id="unknown-key"),
        pytest.param(["mesh.dp=two"], "mesh.dp", id="bad-type"),
        pytest.param(["mesh.dp"], "mesh.dp", id="malformed"),
    ],
)
def test_replace_rejects_what_load_rejects(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.replace(JobConfig(), overrides)
    assert err.value.key == key


def test_validate_checks_a_config_built_in_code() -> None:
    with pytest.raises(ConfigError) as err:
        config.validate(JobConfig(mesh=MeshConfig(dp=0)))
    assert err.value.key == "mesh.dp"


BAD_OVERRIDES = [
    pytest.param(["bogus=1"], "bogus", id="unknown-top-level-key"),
    pytest.param(["model.bogus=1"], "model.bogus", id="unknown-nested-key"),
    pytest.param(["model.bogus.deeper=1"], "model.bogus", id="unknown-nested-section"),
    pytest.param(["mesh.dp=abc"], "mesh.dp", id="str-for-int"),
    pytest.param(["model.dim=1.5"], "model.dim", id="float-for-int"),
    pytest.param(["train.lr=fast"], "train.lr", id="str-for-float"),
    pytest.param(["telemetry.progress=maybe"], "telemetry.progress", id="str-for-bool"),
    pytest.param(["mesh.dp=null"], "mesh.dp", id="null-for-required-int"),
    pytest.param(["mesh.dp=0"], "mesh.dp", id="dp-zero"),
    pytest.param(["mesh.cp=0"], "mesh.cp", id="cp-zero"),
    pytest.param(["mesh.cp=-2"], "mesh.cp", id="cp-negative"),
    pytest.param(["mesh.cp=4", "mesh.ulysses=3"], "mesh.ulysses", id="ulysses-does-not-divide-cp"),
    pytest.param(["mesh.cp=4", "mesh.ulysses=0"], "mesh.ulysses", id="ulysses-zero"),
    pytest.param(["mesh.cp=4", "mesh.ulysses=2"], "mesh.ulysses", id="ring-with-ulysses-2"),
    pytest.param(
        ["mesh.cp=4", "attention.impl=ulysses", "mesh.ulysses=2"], "mesh.ulysses", id="ulysses-impl-ulysses-below-cp"
    ),
    pytest.param(
        ["mesh.cp=2", "attention.impl=ulysses", "mesh.ulysses=1"], "mesh.ulysses", id="ulysses-impl-ulysses-1"
    ),
    pytest.param(["mesh.cp=4", "attention.impl=hybrid"], "mesh.ulysses", id="hybrid-without-ulysses"),
    pytest.param(["mesh.cp=4", "attention.impl=hybrid", "mesh.ulysses=4"], "mesh.ulysses", id="hybrid-ulysses-eq-cp"),
    pytest.param(["mesh.cp=4", "attention.impl=hybrid", "mesh.ulysses=1"], "mesh.ulysses", id="hybrid-ulysses-1"),
    pytest.param(
        ["mesh.cp=8", "attention.impl=ulysses", "model.n_heads=4", "model.n_kv_heads=2"],
        "mesh.ulysses",
        id="heads-not-divisible-by-derived-ulysses",
    ),
    pytest.param(
        ["mesh.cp=6", "attention.impl=hybrid", "mesh.ulysses=3", "data.seq_len=1200"],
        "mesh.ulysses",
        id="heads-not-divisible-by-hybrid-ulysses",
    ),
    pytest.param(["mesh.cp=4", "data.seq_len=1028"], "data.seq_len", id="seq-len-not-divisible-by-2cp"),
    pytest.param(["data.seq_len=2047"], "data.seq_len", id="odd-seq-len-without-cp"),
    pytest.param(["data.seq_len=0"], "data.seq_len", id="seq-len-zero"),
    pytest.param(["mesh.dp=2", "train.global_batch=3"], "train.global_batch", id="global-batch-not-divisible-by-dp"),
    pytest.param(
        ["mesh.dp=2", "train.micro_batch=2", "train.global_batch=6"],
        "train.global_batch",
        id="global-batch-not-divisible-by-dp-x-micro",
    ),
    pytest.param(["zero.stage=4"], "zero.stage", id="zero-stage-4"),
    pytest.param(["zero.stage=-1"], "zero.stage", id="zero-stage-negative"),
    pytest.param(["zero.offload_params=true"], "zero.offload_params", id="offload-params-without-stage-3"),
    pytest.param(["zero.stage=0", "zero.offload_optimizer=true"], "zero.offload_optimizer", id="offload-opt-stage-0"),
    pytest.param(["zero.reduce_bucket_size=0"], "zero.reduce_bucket_size", id="reduce-bucket-zero"),
    pytest.param(["zero.reduce_bucket_size=5e8"], "zero.reduce_bucket_size", id="reduce-bucket-not-an-integer"),
    pytest.param(["zero.stage3_prefetch_bucket_size=-1"], "zero.stage3_prefetch_bucket_size", id="prefetch-negative"),
    pytest.param(
        ["zero.stage3_param_persistence_threshold=-1"], "zero.stage3_param_persistence_threshold", id="persistence-negative"
    ),
    pytest.param(["zero.stage3_max_live_parameters=-1"], "zero.stage3_max_live_parameters", id="max-live-negative"),
    pytest.param(["attention.impl=flash"], "attention.impl", id="unknown-attention-impl"),
    pytest.param(["attention.kernel=magic"], "attention.kernel", id="unknown-attention-kernel"),
    pytest.param(["model.n_heads=3"], "model.n_heads", id="dim-not-divisible-by-heads"),
    pytest.param(["model.n_kv_heads=3"], "model.n_kv_heads", id="heads-not-divisible-by-kv-heads"),
    pytest.param(["data.token_dtype=int8"], "data.token_dtype", id="unknown-token-dtype"),
    pytest.param(["data.path="], "data.path", id="empty-data-path"),
    pytest.param(["train.lr=0"], "train.lr", id="lr-zero"),
    pytest.param(["train.min_lr_ratio=1.5"], "train.min_lr_ratio", id="min-lr-ratio-above-1"),
    pytest.param(["train.beta2=1.0"], "train.beta2", id="beta2-one"),
    pytest.param(["train.dtype=fp16"], "train.dtype", id="unknown-dtype"),
    pytest.param(["cluster.device=tpu"], "cluster.device", id="unknown-device"),
    pytest.param(["controllers.step_timeout_s=0"], "controllers.step_timeout_s", id="step-timeout-zero"),
    pytest.param(["name=bad name"], "name", id="name-with-space"),
    pytest.param(["name=../escape"], "name", id="name-with-path"),
    pytest.param(["name=-leading-dash"], "name", id="name-leading-dash"),
    pytest.param(["mesh.dp2"], "mesh.dp2", id="override-without-equals"),
    pytest.param(["=2"], "=2", id="override-without-key"),
    pytest.param(
        ["mesh=3"],
        "mesh",
        id="scalar-for-section",
    ),
]


@pytest.mark.parametrize(("overrides", "key"), BAD_OVERRIDES)
def test_bad_override_raises_config_error_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ")
    assert err.value.reason


def test_malformed_override_says_how_to_write_one() -> None:
    with pytest.raises(ConfigError, match="key=value"):
        config.load(None, ["mesh.dp", "mesh.cp=2"])


def test_unknown_key_reason_says_unknown() -> None:
    with pytest.raises(ConfigError, match="unknown key"):
        config.load(None, ["train.stpes=10"])


@pytest.mark.parametrize(
    ("text", "key"),
    [
        pytest.param("mesh:\n  bogus: 1\n", "mesh.bogus", id="unknown-nested-key"),
        pytest.param("bogus: 1\n", "bogus", id="unknown-top-level-key"),
        pytest.param("mesh:\n  dp: abc\n", "mesh.dp", id="bad-type"),
        pytest.param("mesh:\n  dp: 2\ntrain:\n  global_batch: 3\n", "train.global_batch", id="invalid-relation"),
        pytest.param("mesh: {dp: [1\n", "config", id="invalid-yaml"),
        pytest.param("name: x\n  bad_indent: 1\n", "config", id="invalid-yaml-indentation"),
        pytest.param("- 1\n- 2\n", "config", id="top-level-list"),
        pytest.param("42\n", "config", id="top-level-number"),
        pytest.param(
            "just a string\n",
            "config",
            id="top-level-string",
        ),
        pytest.param(
            "mesh: 3\n",
            "mesh",
            id="scalar-for-section",
        ),
    ],
)
def test_bad_job_file_raises_config_error_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(job_file)
    assert err.value.key == key


def test_invalid_yaml_error_names_the_file(tmp_path: Path) -> None:
    job_file = tmp_path / "broken.yaml"
    job_file.write_text("mesh: {dp: [1\n")
    with pytest.raises(ConfigError, match="not valid YAML") as err:
        config.load(job_file)
    assert str(job_file) in err.value.reason
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "text, where, says",
    [
        # An unclosed list: the problem is found on the next line, and where the list began is said.
        ("name: x\nmodel:\n  dim: 64\n  n_layers: [1, 2\ntrain:\n  steps: 3\n", ":5:6:", "(while parsing a flow sequence at line 4)"),
        ("name: x\nmodel:\n  dim: 64\n   n_layers: 2\n", ":4:12:", "mapping values are not allowed here"),
        ("name: x\n\tmodel: 1\n", ":2:1:", "found character '\\t' that cannot start any token"),
    ],
)
def test_a_yaml_syntax_error_names_the_line_and_column(tmp_path: Path, text: str, where: str, says: str) -> None:
    job_file = tmp_path / "job.yaml"
    job_file.write_text(text)
    with pytest.raises(ConfigError) as err:
        config.load(job_file)
    assert err.value.reason.startswith(f"{job_file}{where} not valid YAML: ") and says in err.value.reason
    assert "\n" not in str(err.value)


def test_missing_job_file_raises_config_error_with_key_config(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="no such job file") as err:
        config.load(missing)
    assert err.value.key == "config"
    assert str(missing) in err.value.reason


def test_a_directory_is_not_a_job_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(tmp_path)
    assert err.value.key == "config"


# --- elasticity and fault handling -------------------------------------------------------


def test_sdc_defaults_and_a_bitflip_fault() -> None:
    c = config.load().controllers
    assert (c.sdc_every_steps, c.sdc_evict_node, c.sdc_cross_rank) == (100, False, True)
    (fault,) = config.load(None, ["chaos.faults=[{kind: bitflip, rank: 0, step: 3, target: gradients, bit: 30}]"]).chaos.faults
    assert (fault.kind, fault.step, fault.target, fault.bit) == ("bitflip", 3, "gradients", 30)
    (fault,) = config.load(None, ["chaos.faults=[{kind: bitflip}]"]).chaos.faults
    assert (fault.target, fault.bit) == ("probe", 22)


def test_elastic_defaults() -> None:
    job = config.load()
    assert (job.mesh.min_dp, job.mesh.max_dp, job.mesh.spares) == (1, None, 0)
    c = job.controllers
    assert (c.heartbeat_s, c.heartbeat_timeout_s, c.max_recoveries, c.on_nan, c.grow_after_s) == (1.0, 10.0, 20, "skip", 10.0)


@pytest.mark.parametrize(
    ("overrides", "max_dp"),
    [
        pytest.param(["mesh.dp=2", "train.global_batch=4"], 2, id="unset-means-dp"),
        pytest.param(["mesh.dp=2", "train.global_batch=4", "mesh.max_dp=2"], 2, id="equal-to-dp"),
        pytest.param(["mesh.dp=2", "train.global_batch=4", "mesh.max_dp=4"], 4, id="above-dp"),
    ],
)
def test_max_dp_defaults_to_dp(overrides: list[str], max_dp: int) -> None:
    assert config.load(None, overrides).max_dp == max_dp


@pytest.mark.parametrize(
    ("overrides", "key", "value"),
    [
        pytest.param(["mesh.dp=2", "train.global_batch=4", "mesh.min_dp=2"], "mesh.min_dp", 2, id="min-dp-equal-to-dp"),
        pytest.param(["mesh.spares=3"], "mesh.spares", 3, id="spares"),
        pytest.param(
            ["controllers.heartbeat_s=2", "controllers.heartbeat_timeout_s=2"],
            "controllers.heartbeat_timeout_s",
            2.0,
            id="timeout-equal-to-heartbeat",
        ),
        pytest.param(["controllers.heartbeat_s=0.25"], "controllers.heartbeat_s", 0.25, id="sub-second-heartbeat"),
        pytest.param(["controllers.max_recoveries=0"], "controllers.max_recoveries", 0, id="no-recoveries"),
        pytest.param(["controllers.grow_after_s=0"], "controllers.grow_after_s", 0.0, id="grow-at-once"),
        pytest.param(["controllers.on_nan=skip"], "controllers.on_nan", "skip", id="on-nan-skip"),
        pytest.param(["controllers.on_nan=retry"], "controllers.on_nan", "retry", id="on-nan-retry"),
        pytest.param(["controllers.on_nan=abort"], "controllers.on_nan", "abort", id="on-nan-abort"),
    ],
)
def test_valid_elastic_settings_load(overrides: list[str], key: str, value: object) -> None:
    section, name = key.split(".")
    assert getattr(getattr(config.load(None, overrides), section), name) == value


BAD_ELASTIC = [
    pytest.param(["mesh.min_dp=0"], "mesh.min_dp", id="min-dp-zero"),
    pytest.param(["mesh.min_dp=-1"], "mesh.min_dp", id="min-dp-negative"),
    pytest.param(["mesh.dp=2", "train.global_batch=4", "mesh.min_dp=3"], "mesh.min_dp", id="min-dp-above-dp"),
    pytest.param(["mesh.dp=2", "train.global_batch=4", "mesh.max_dp=1"], "mesh.max_dp", id="max-dp-below-dp"),
    pytest.param(["mesh.max_dp=two"], "mesh.max_dp", id="max-dp-str"),
    pytest.param(["mesh.spares=-1"], "mesh.spares", id="spares-negative"),
    pytest.param(["mesh.spares=1.5"], "mesh.spares", id="spares-float"),
    pytest.param(["controllers.heartbeat_s=0"], "controllers.heartbeat_s", id="heartbeat-zero"),
    pytest.param(["controllers.heartbeat_s=-1"], "controllers.heartbeat_s", id="heartbeat-negative"),
    pytest.param(["controllers.heartbeat_timeout_s=0"], "controllers.heartbeat_timeout_s", id="heartbeat-timeout-zero"),
    pytest.param(
        ["controllers.heartbeat_s=5", "controllers.heartbeat_timeout_s=4"],
        "controllers.heartbeat_timeout_s",
        id="heartbeat-timeout-below-heartbeat",
    ),
    pytest.param(
        ["controllers.heartbeat_timeout_s=0.5"],
        "controllers.heartbeat_timeout_s",
        id="heartbeat-timeout-below-default-heartbeat",
    ),
    pytest.param(["controllers.max_recoveries=-1"], "controllers.max_recoveries", id="max-recoveries-negative"),
    pytest.param(["controllers.max_recoveries=many"], "controllers.max_recoveries", id="max-recoveries-str"),
    pytest.param(["controllers.on_nan=ignore"], "controllers.on_nan", id="on-nan-unknown"),
    pytest.param(["controllers.on_nan=Skip"], "controllers.on_nan", id="on-nan-case-matters"),
    pytest.param(["controllers.grow_after_s=-0.5"], "controllers.grow_after_s", id="grow-after-negative"),
    pytest.param(["controllers.bogus_s=1"], "controllers.bogus_s", id="unknown-controllers-key"),
    pytest.param(["controllers.sdc_every_steps=-1"], "controllers.sdc_every_steps", id="sdc-every-negative"),
    pytest.param(["controllers.sdc_evict_node=maybe"], "controllers.sdc_evict_node", id="sdc-evict-node-str"),
    pytest.param(["chaos.faults=[{kind: bitflip, target: weights}]"], "chaos.faults[0].target", id="bitflip-target"),
    pytest.param(["chaos.faults=[{kind: bitflip, bit: 32}]"], "chaos.faults[0].bit", id="bitflip-bit-too-high"),
    pytest.param(["chaos.faults=[{kind: bitflip, bit: -1}]"], "chaos.faults[0].bit", id="bitflip-bit-negative"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD_ELASTIC)
def test_bad_elastic_override_raises_config_error_naming_the_key(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as err:
        config.load(None, overrides)
    assert err.value.key == key
    assert str(err.value).startswith(f"{key}: ")
    assert err.value.reason


def test_elastic_errors_say_what_bounds_the_value() -> None:
    with pytest.raises(ConfigError, match="mesh.dp=2"):
        config.load(None, ["mesh.dp=2", "train.global_batch=4", "mesh.min_dp=3"])
    with pytest.raises(ConfigError, match="controllers.heartbeat_s=5"):
        config.load(None, ["controllers.heartbeat_s=5", "controllers.heartbeat_timeout_s=4"])
    with pytest.raises(ConfigError, match="skip, retry, abort"):
        config.load(None, ["controllers.on_nan=ignore"])


def test_the_schema_declares_its_public_names_once_and_the_package_shows_them() -> None:
    """``schema.__all__`` is the one list of the schema's names that ``ringtrain.config`` shows:
    every public name the schema defines is on it (a new one left off would be missing from the
    package), and it names nothing else but the attention names it takes from topology.py."""
    import ast

    from ringtrain import topology
    from ringtrain.config import schema

    tree = ast.parse(Path(schema.__file__).read_text())
    defined = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    defined |= {t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)}
    defined |= {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)}
    public = {name for name in defined if not name.startswith("_")}
    taken = set(schema.__all__) - public
    assert public <= set(schema.__all__) and len(schema.__all__) == len(set(schema.__all__))
    assert all(getattr(schema, name) is getattr(topology, name) for name in taken), taken
    assert all(getattr(config, name) is getattr(schema, name) for name in schema.__all__)


def test_every_name_imported_from_the_package_is_there() -> None:
    """What platform/, tests/, bench/ and jobs/ import from ``ringtrain.config`` (or read as
    ``config.X``) resolves: the package's names come from its parts' lists, not a copy of them."""
    import ast

    repo = Path(__file__).resolve().parents[2]
    wanted: set[str] = set()
    for folder in ("platform", "tests", "bench", "jobs"):
        for path in (repo / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            if "ringtrain.config import" not in text and "ringtrain import" not in text:
                continue
            tree = ast.parse(text)
            aliases = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "ringtrain"
                       for a in n.names if a.name == "config"}  # fmt: skip
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom) and node.module == "ringtrain.config":
                    wanted |= {a.name for a in node.names}
                elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
                    wanted.add(node.attr)
    assert {"JobConfig", "validate", "load", "RUN_CONFIG", "CPLayout"} <= wanted  # the scan sees them
    assert sorted(name for name in wanted if not hasattr(config, name)) == []
