"""The GPU tier's entry points, checked where there is no GPU: what they install and from where,
that they refuse (rather than skip) when what they need is missing, and the time-boxed runner.

- flash-attn is built as its README says: after torch, without build isolation, at one pinned
  2.x version shared by the image (infra/Dockerfile) and ``make test-gpu``. Under isolation
  pip builds it without the installed torch and the build fails.
- ``make test-gpu`` fails where nvidia-smi sees a GPU that torch cannot use, instead of letting
  every GPU test skip; ``make gpu-check`` exits 2 on a machine with no GPU at all, in either mode.
- ``PYTHON_ENV=system`` (an air-gapped node's own CUDA PyTorch) never creates .venv and never
  reaches a package index: it installs only what the Python lacks, from the WHEELS folder (run
  for real here, with the network cut off, on a wheel made in tmp), and without WHEELS it stops
  at once naming what is missing and ``make gpu-wheels``. ``make gpu-wheels`` makes a folder
  from which a fresh venv, with no index, installs and imports the tier (slow: it downloads).
- bench/gpu_check.py streams each part's output and each test's outcome as they come, cuts a
  part at its budget and goes on with the next; tests/gpu/conftest.py writes one line per test,
  under pytest-xdist too.
- tests/gpu/support.py reports a test whose package was left out on purpose as not run, naming
  it, even under RINGTRAIN_GPU_STRICT; anything else missing still fails there.
- bench/train.py exits 2 with a message without CUDA; tests/gpu collects on a CPU machine.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import http.server
import importlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, Optional

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
MAKEFILE = (REPO / "Makefile").read_text()
DOCKERFILE = (REPO / "infra" / "Dockerfile").read_text()
GPU_REQUIREMENTS = REPO / "infra" / "gpu-tier.txt"
CONFTEST = REPO / "tests" / "gpu" / "conftest.py"

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
slow = pytest.mark.slow  # a subprocess that imports torch: seconds


def _makefile_var(name: str) -> str:
    found = re.search(rf"^{name} \?= (\S+)$", MAKEFILE, re.MULTILINE)
    assert found, f"Makefile sets no {name}"
    return found.group(1)


def _docker_runs() -> list[str]:
    joined = re.sub(r"\\\n", " ", DOCKERFILE)
    return [line.strip()[4:] for line in joined.splitlines() if line.strip().startswith("RUN ")]


def _load_runner() -> ModuleType:
    if "gpu_check" not in sys.modules:
        spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["gpu_check"] = module  # dataclasses look their module up while the class is made
        spec.loader.exec_module(module)
    return sys.modules["gpu_check"]


def _records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# -- the image and the .venv mode ------------------------------------------------------------


def test_flash_attn_pinned_once_for_the_image_and_make() -> None:
    version = _makefile_var("FLASH_ATTN_VERSION")
    assert re.fullmatch(r"2\.\d+\.\d+(\.post\d+)?", version), version
    assert re.search(rf"^ARG FLASH_ATTN_VERSION={re.escape(version)}$", DOCKERFILE, re.MULTILINE)


def test_image_builds_flash_attn_after_torch_without_isolation() -> None:
    runs = _docker_runs()
    torch_at = next(i for i, run in enumerate(runs) if 'pip install "torch==${TORCH_VERSION}"' in run)
    flash = [i for i, run in enumerate(runs) if "flash-attn==${FLASH_ATTN_VERSION}" in run]
    ringtrain_at = next(i for i, run in enumerate(runs) if re.search(r"pip install (\.|\"\.\[)", run))
    assert flash and torch_at < flash[0] < ringtrain_at
    assert "--no-build-isolation" in runs[flash[0]]
    assert "ninja" in runs[flash[0]] and "MAX_JOBS" in runs[flash[0]]


def _fake_path(tmp_path: Path, *, gpu_visible: bool) -> str:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if gpu_visible:  # an nvidia-smi that succeeds: the machine claims a GPU
        fake = bin_dir / "nvidia-smi"
        fake.write_text("#!/bin/sh\nexit 0\n")
        fake.chmod(0o755)
    path = os.environ.get("PATH", "")
    if not gpu_visible:  # hide a real one, if any
        path = os.pathsep.join(p for p in path.split(os.pathsep) if not (Path(p) / "nvidia-smi").exists())
    return os.pathsep.join([str(bin_dir), path])


def _make_binary() -> str:
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    return make


def _dry_run(target: str, tmp_path: Path, *args: str) -> str:
    """The commands ``make -n target`` would run, fully expanded."""
    done = subprocess.run(
        [_make_binary(), "-n", "-o", ".venv/.installed", f"PY={sys.executable}", *args, target],
        cwd=REPO, env={**os.environ, "PATH": _fake_path(tmp_path, gpu_visible=True)},
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.replace("\\\n", " ")  # one line per shell command


def test_make_test_gpu_builds_flash_attn_without_isolation_and_runs_the_gpu_marker(tmp_path: Path) -> None:
    recipe = _dry_run("test-gpu", tmp_path)
    version = _makefile_var("FLASH_ATTN_VERSION")
    assert "--no-build-isolation" in recipe and f'"flash-attn=={version}"' in recipe
    assert "torch.cuda.is_available()" in recipe
    assert re.search(r"pytest tests/gpu -m gpu", recipe)


@pytest.mark.parametrize("target", ["test-gpu", "gpu-check"])
def test_offline_mode_installs_from_the_wheel_folder_only(tmp_path: Path, target: str) -> None:
    recipe = _dry_run(target, tmp_path, "PYTHON_ENV=system", "WHEELS=/carried/wheels")
    pip_installs = [line for line in re.split(r"[;&|\n]", recipe) if re.search(r"\bpip\b.* install\b", line)]
    assert pip_installs, recipe
    for line in pip_installs:  # each install from the folder alone, exactly what the list names
        assert "--no-index" in line and '--find-links "/carried/wheels"' in line and "--no-deps" in line, line
    assert "PIP_CONFIG_FILE=/dev/null" in recipe and "-u PIP_FIND_LINKS" in recipe  # no index from pip's config either
    assert "flash-attn==" not in recipe and "-m venv" not in recipe and ".venv/" not in recipe
    assert 'RINGTRAIN_GPU_LEFT_OUT="flash-attn ray"' in recipe


def _make(target: str, tmp_path: Path, *args: str, gpu_visible: bool,
          env: Optional[dict[str, str]] = None, offline: bool = False) -> subprocess.CompletedProcess[str]:
    # The venv is this interpreter's, already installed: -o keeps make from touching it, and
    # PIP=false makes sure nothing is installed should a check let the recipe go on.
    command = [_make_binary(), "-s", "-o", ".venv/.installed", f"PY={sys.executable}", "PIP=false", *args, target]
    if offline:
        command = [*_no_network(), *command]
    return subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300,
        env={**os.environ, **(env or {}), "PATH": _fake_path(tmp_path, gpu_visible=gpu_visible)},
    )


def _no_network() -> list[str]:
    """A prefix that runs a command in a network namespace of its own (loopback down), where the
    machine allows it; otherwise the closed ports in ``CLOSED_INDEX`` stand in."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-rn", "true"], capture_output=True).returncode == 0:
        return [unshare, "-rn"]
    return []


def _index_env(url: str) -> dict[str, str]:
    """Every way the environment can point pip at an index or a page of links."""
    return {"PIP_INDEX_URL": f"{url}/simple", "PIP_EXTRA_INDEX_URL": f"{url}/extra", "PIP_FIND_LINKS": f"{url}/links"}


CLOSED_INDEX = _index_env("http://127.0.0.1:9")  # a port nothing listens on


class _Recorder(http.server.BaseHTTPRequestHandler):
    seen: list[str]

    def do_GET(self) -> None:  # noqa: N802 - the handler's protocol
        self.seen.append(self.path)
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def index_spy() -> Iterator[tuple[str, list[str]]]:
    """A package index on loopback that answers nothing and records every request made to it."""
    seen: list[str] = []
    handler = type("Recorder", (_Recorder,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@needs_no_cuda
@slow
def test_make_test_gpu_fails_when_a_gpu_is_visible_but_torch_cannot_use_it(tmp_path: Path) -> None:
    done = _make("test-gpu", tmp_path, gpu_visible=True)
    assert done.returncode != 0, done.stdout + done.stderr
    assert "cannot use it" in done.stderr and "CUDA build" in done.stderr, done.stderr


@needs_no_cuda
@pytest.mark.parametrize("mode", [[], ["PYTHON_ENV=system"]], ids=["venv", "system"])
def test_make_gpu_check_exits_2_without_a_gpu(tmp_path: Path, mode: list[str]) -> None:
    venv = [f"VENV={tmp_path / 'venv'}"] if mode else []  # the system mode must not make one
    done = _make("gpu-check", tmp_path, *mode, *venv, gpu_visible=False)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "gpu-check: nvidia-smi sees no GPU" in done.stderr, done.stderr
    assert not (tmp_path / "venv").exists()


# -- the offline mode, run ----------------------------------------------------------------------


def _wheel(folder: Path, dist: str, version: str, files: dict[str, str]) -> Path:
    """A minimal, valid pure-Python wheel of ``files`` (path -> text)."""
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"{dist.replace('-', '_')}-{version}"
    contents = {
        **files,
        f"{stem}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n",
        f"{stem}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for name, text in contents.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{name},sha256={digest},{len(text.encode())}")
    record.append(f"{stem}.dist-info/RECORD,,")
    path = folder / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as whl:
        for name, text in contents.items():
            whl.writestr(name, text)
        whl.writestr(f"{stem}.dist-info/RECORD", "\n".join(record) + "\n")
    return path


PROBE = "rt-gpu-tier-probe"
# Loaded as a plugin (-p) by the tier's own pytest: it says where it was imported from, and ends
# the session before any test is collected.
PROBE_PLUGIN = textwrap.dedent("""
    import os
    import pytest

    def pytest_configure(config):
        open(os.environ["RT_PROBE_OUT"], "a").write(__file__ + "\\n")
        pytest.exit("probe loaded", returncode=0)
""")


@needs_no_cuda
@slow
def test_offline_mode_installs_only_what_is_missing_and_never_asks_an_index(
    tmp_path: Path, index_spy: tuple[str, list[str]]
) -> None:
    wheels, site, seen = tmp_path / "wheels", tmp_path / "site", tmp_path / "seen"
    _wheel(wheels, PROBE, "1.0", {"rt_gpu_tier_probe.py": PROBE_PLUGIN})
    requirements = tmp_path / "gpu-tier.txt"
    # pytest is installed here at another version: kept, not installed again.
    requirements.write_text(f"{PROBE}==1.0\npytest==0.0.1  # a pin this Python does not match\n")
    args = ["PYTHON_ENV=system", f"PYTHON={sys.executable}", f"WHEELS={wheels}", f"GPU_REQUIREMENTS={requirements}",
            f"GPU_SITE={site}", f"VENV={tmp_path / 'venv'}", "PYTEST_ARGS=-p rt_gpu_tier_probe"]
    url, asked = index_spy
    env = {**_index_env(url), "RT_PROBE_OUT": str(seen)}

    first = _make("test-gpu", tmp_path, *args, gpu_visible=False, env=env)
    assert first.returncode == 0, first.stdout + first.stderr
    assert f"installing into {site} from {wheels}, no index: {PROBE}==1.0" in first.stdout, first.stdout
    assert f"pytest {importlib.metadata.version('pytest')} is installed (pinned 0.0.1): kept" in first.stderr
    installed = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    assert installed == ["rt_gpu_tier_probe-1.0.dist-info", "rt_gpu_tier_probe.py"], installed
    # The tier's pytest imported the plugin from the folder the wheel went to.
    assert seen.read_text().splitlines() == [str(site / "rt_gpu_tier_probe.py")]
    assert not (tmp_path / "venv").exists()

    again = _make("test-gpu", tmp_path, *args, gpu_visible=False, env=env)
    assert again.returncode == 0, again.stdout + again.stderr
    assert "installing" not in again.stdout  # all there now: nothing to install
    assert asked == []  # the index and links the environment names were never asked


@pytest.mark.parametrize("wheels", [None, "not-a-folder"])
def test_offline_mode_without_wheels_stops_naming_what_is_missing(tmp_path: Path, wheels: Optional[str]) -> None:
    requirements = tmp_path / "gpu-tier.txt"
    requirements.write_text("rt-gpu-tier-absent==1.0\npytest==0.0.1\n")
    args = ["PYTHON_ENV=system", f"PYTHON={sys.executable}", f"GPU_REQUIREMENTS={requirements}",
            f"GPU_SITE={tmp_path / 'site'}", f"VENV={tmp_path / 'venv'}"]
    if wheels is not None:
        args.append(f"WHEELS={tmp_path / wheels}")
    done = _make("test-gpu", tmp_path, *args, gpu_visible=False, env=CLOSED_INDEX)
    assert done.returncode == 2, done.stdout + done.stderr
    if wheels is None:
        assert "lacks rt-gpu-tier-absent==1.0 (of" in done.stderr, done.stderr
        assert "pytest==" not in done.stderr.split("lacks", 1)[1]  # only what is missing is named
        py = "%d.%d" % sys.version_info[:2]
        assert f"make gpu-wheels DEST=<dir> PY={py}" in done.stderr and "WHEELS=<dir>" in done.stderr, done.stderr
    else:
        assert f"WHEELS={tmp_path / wheels} is not a folder" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "tests/gpu" not in done.stdout
    assert not (tmp_path / "venv").exists() and not (tmp_path / "site").exists()


def test_an_unknown_python_env_is_refused(tmp_path: Path) -> None:
    done = _make("gpu-check", tmp_path, "PYTHON_ENV=conda", gpu_visible=False)
    assert done.returncode == 2 and "PYTHON_ENV=conda" in done.stderr, done.stderr


def test_missing_lists_the_lines_whose_distribution_is_absent(tmp_path: Path) -> None:
    runner = _load_runner()
    requirements = tmp_path / "gpu-tier.txt"
    pytest_version = importlib.metadata.version("pytest")
    requirements.write_text(
        f"# a comment\n\nrt-gpu-tier-absent==1.0  # sdist\nPyTest=={pytest_version}\nNumPy==0.0.1\nRT_Other.Absent\n"
    )
    missing, notes = runner.missing_requirements(requirements)
    assert missing == ["rt-gpu-tier-absent==1.0", "RT_Other.Absent"]
    assert notes == [f"NumPy {importlib.metadata.version('numpy')} is installed (pinned 0.0.1): kept"]
    requirements.write_text("==1.0\n")
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--missing", str(requirements)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and f"{requirements}:1: not a requirement" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_the_tier_requirements_are_exact_pins_without_markers() -> None:
    """make gpu-wheels downloads each line for another Python than this one: a marker would be
    judged against the wrong interpreter, and a range would pick whatever is newest."""
    runner = _load_runner()
    lines = [line.split("#", 1)[0].strip() for line in GPU_REQUIREMENTS.read_text().splitlines()]
    pins = [line for line in lines if line]
    assert pins and all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*==[0-9][A-Za-z0-9.+]*", pin) for pin in pins), pins
    names = [runner._canonical(pin.split("==")[0]) for pin in pins]
    assert len(names) == len(set(names))
    assert not {"torch", "flash-attn", "ray"} & set(names)  # the node's, or left out on purpose
    sdists = [line for line in GPU_REQUIREMENTS.read_text().splitlines() if re.search(r"#\s*sdist", line)]
    assert [line.split("==")[0] for line in sdists] == ["deepspeed"]


# -- the runner -------------------------------------------------------------------------------


def _fake_suite(tmp_path: Path, tests: str) -> Path:
    """A folder of tests that logs through the GPU tier's conftest."""
    suite = tmp_path / "suite"
    suite.mkdir()
    shutil.copy(CONFTEST, suite / "conftest.py")
    (suite / "pytest.ini").write_text("[pytest]\n")  # its own root, away from the repository's settings
    (suite / "test_fake.py").write_text(textwrap.dedent(tests))
    return suite


FAKE_TESTS = """
    import time
    import pytest

    def test_passes():
        pass

    def test_fails():
        assert 1 + 1 == 3, "arithmetic"

    def test_skips():
        pytest.skip("not run: needs a fake piece")

    @pytest.mark.xfail(reason="known")
    def test_xfails():
        assert False

    def test_hangs():
        time.sleep(600)
"""


def _wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)


BUDGET_S = 10.0  # room for pytest to start and run four tests on a loaded machine


def test_runner_streams_outcomes_and_goes_on_after_a_part_that_times_out(tmp_path: Path) -> None:
    runner = _load_runner()
    suite = _fake_suite(tmp_path, FAKE_TESTS)
    logs = tmp_path / "logs"
    pytest_argv = (sys.executable, "-m", "pytest", str(suite), "-v", "-p", "no:cacheprovider")
    parts = [
        runner.Part("fake_tests", pytest_argv, BUDGET_S, pytest=True),
        runner.Part("after", (sys.executable, "-c", "print('after ran')"), 30.0),
        runner.Part("absent", (sys.executable, str(tmp_path / "absent.py")), 30.0, needs=tmp_path / "absent.py"),
    ]
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(summary=runner.run_all(parts, logs)))
    thread.start()
    try:
        # While the hung test still runs, the finished ones are already in both logs.
        tests_log, part_log = logs / runner.TESTS_LOG, logs / "fake_tests.log"
        _wait_for(lambda: any(r.get("nodeid", "").endswith("test_hangs") for r in _records(tests_log)),
                  BUDGET_S - 1, "start of test_hangs")
        assert thread.is_alive()
        outcomes = {r["nodeid"].split("::")[1]: r for r in _records(tests_log) if r["event"] == "outcome"}
        assert {name: r["outcome"] for name, r in outcomes.items()} == {
            "test_passes": "passed", "test_fails": "failed", "test_skips": "not run", "test_xfails": "xfailed"}
        assert "arithmetic" in outcomes["test_fails"]["traceback"]
        assert outcomes["test_skips"]["reason"] == "not run: needs a fake piece"
        assert "test_fake.py::test_passes PASSED" in part_log.read_text()
    finally:
        thread.join(timeout=60)
    summary = box["summary"]
    fake, after, absent = summary["parts"]
    assert fake["status"] == "timed out" and BUDGET_S <= fake["seconds"] < BUDGET_S + runner.GRACE_S + 3, fake
    assert fake["tests"] == {"passed": 1, "failed": 1, "not run": 1, "xfailed": 1}
    assert [f.split("::")[1] for f in fake["failing"]] == ["test_fails"]
    assert [f.split("::")[1] for f in fake["running_when_cut"]] == ["test_hangs"]
    assert fake["not_run_reasons"] == {"not run: needs a fake piece": 1}
    assert "KeyboardInterrupt" in part_log.read_text()  # pytest was stopped, and said where
    assert after["status"] == "passed" and (logs / "after.log").read_text() == "after ran\n"
    assert absent["status"] == "not run" and "absent.py is not in this checkout" in absent["note"]
    assert not summary["ok"]
    assert json.loads((logs / runner.SUMMARY).read_text())["parts"] == summary["parts"]
    screen = runner.render(summary)
    assert re.search(r"fake_tests\s+timed out", screen) and "running when cut" in screen
    assert "1 passed, 1 failed, 1 not run, 1 xfailed" in screen and "1 not run: needs a fake piece" in screen


def test_a_part_that_ignores_sigint_is_killed_and_its_output_kept(tmp_path: Path) -> None:
    runner = _load_runner()
    stubborn = textwrap.dedent("""
        import signal, time
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        print('started', flush=True)
        time.sleep(600)
    """)
    part = runner.Part("stubborn", (sys.executable, "-c", stubborn), 2.0)
    start = time.monotonic()
    result = runner.run_part(part, tmp_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, grace_s=1.0)
    assert result.status == "timed out" and time.monotonic() - start < 2.0 + 1.0 + 3
    assert result.tail[0] == "started"
    assert (tmp_path / "stubborn.log").read_text().startswith("started\n")


def test_a_part_gets_its_budgets_sigint_when_the_runner_started_with_sigint_ignored(tmp_path: Path) -> None:
    # As a shell starts a background job (`nohup make gpu-check &`): SIGINT ignored, which every
    # process the runner starts would inherit.
    runner = _load_runner()
    sleeper = textwrap.dedent("""
        import time
        print('started', flush=True)
        try:
            time.sleep(600)
        except KeyboardInterrupt:
            print('interrupted', flush=True)
    """)
    part = runner.Part("sleeper", (sys.executable, "-c", sleeper), 2.0)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        result = runner.run_part(part, tmp_path, {**os.environ, "PYTHONUNBUFFERED": "1"}, grace_s=5.0)
    finally:
        signal.signal(signal.SIGINT, before)
    assert result.status == "timed out" and result.tail[:2] == ["started", "interrupted"], result.tail


@pytest.mark.parametrize("flags", [["--only", "tests,nope"], ["--budget", "tests=abc"], ["--budget", "nope=3"],
                                   ["--budget", "train=-1"], ["--missing", "/nonexistent/gpu-tier.txt"]])
def test_runner_refuses_bad_flags(flags: list[str]) -> None:
    done = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), *flags],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.startswith("gpu_check: ") and flags[1].split("=")[0].split(",")[-1] in done.stderr
    assert "Traceback" not in done.stderr


def test_default_parts_fit_the_time_box_in_order() -> None:
    runner = _load_runner()
    parts = runner.default_parts()
    assert [p.name for p in parts] == ["timing", "tests", "attention", "launches", "train", "max_context",
                                       "train_baselines", "nccl_abort"]
    chosen = runner.select_parts(parts, None, {})
    assert [p.name for p in chosen] == ["timing", "tests", "attention", "launches", "train", "max_context"]
    assert sum(p.budget_s + runner.GRACE_S for p in chosen) <= runner.TIME_BOX_S == 480
    for outside in ("nccl_abort", "train_baselines"):  # --only runs a part the box leaves out
        assert [p.name for p in runner.select_parts(parts, outside, {})] == [outside]
    timing, tests = parts[0], parts[1]
    assert all(t in timing.argv for t in runner.TIMING_TESTS) and "-n" not in timing.argv
    assert all(f"--ignore={t}" in tests.argv for t in runner.TIMING_TESTS)
    assert ("--dist", "worksteal") == tests.argv[tests.argv.index("--dist"):][:2]
    assert ("-p", runner.SLOW_FIRST) == tests.argv[tests.argv.index(runner.SLOW_FIRST) - 1:][:2]
    chosen = runner.select_parts(parts, "train,tests", runner.parse_budgets(["train=300,tests=50"], ["train", "tests"]))
    assert [(p.name, p.budget_s) for p in chosen] == [("tests", 50.0), ("train", 300.0)]


def _bench_args(part: Any) -> argparse.Namespace:
    """A bench part's flags as its own script parses them (argparse exits on one it does not take)."""
    script = Path(part.argv[1])
    assert part.argv[0] == sys.executable and script.parent == REPO / "bench" and script.is_file(), part.argv
    module = importlib.import_module(f"bench.{script.stem}")
    return module.parse_args(list(part.argv[2:]))


def test_each_bench_part_names_a_script_and_flags_it_takes_and_measures_what_the_tier_is_for() -> None:
    """Every bench part's argv, parsed by its script's own parser: each measures what the tier
    is for, and the max_context part stops starting tries before its budget ends."""
    runner = _load_runner()
    parts = {p.name: p for p in runner.default_parts() if not p.pytest}
    assert set(parts) == {"attention", "launches", "train", "max_context", "train_baselines", "nccl_abort"}
    assert parts["nccl_abort"].argv[2:] == ()  # it takes no flags here, only its script
    attention = _bench_args(parts["attention"])
    sizes = {(seq // ring, ring) for seq in attention.seq for ring in attention.ring}
    assert {(tokens, ring) for tokens in (2048, 4096, 8192) for ring in (2, 4, 8)} <= sizes
    launches = _bench_args(parts["launches"])
    assert sorted(seq // ring for seq, ring in launches.sizes) == [2048, 4096, 8192]
    train = _bench_args(parts["train"])
    assert train.check and train.snapshot_every == 1 and train.shapes == ["tinyllama", "qwen3"]
    # The snapshot first: a cut costs the Qwen3 Trainer's MFU, which train_baselines measures again.
    assert train.variants == ["trainer_snapshots", "trainer"]
    baselines = _bench_args(parts["train_baselines"])
    assert {"trainer", "trainer_snapshots", "plain", "hf"} == set(baselines.variants) and baselines.shapes == train.shapes
    assert baselines.name != train.name  # two JSONs: the second run keeps the first's
    # The per-step snapshot on both shapes, TinyLlama's in the box and Qwen3's beside the baselines.
    assert train.snapshot_shapes == ["tinyllama"] and baselines.snapshot_shapes == ["qwen3"]
    context = _bench_args(parts["max_context"])
    assert context.shapes == ["llama3.2-1b", "llama3-8b"] and context.systems == ["hf", "ringtrain"]
    assert context.memory_gb and context.host_memory_gb == 0 and context.tolerance_edges and context.max_tries >= 2
    # A try ends within its search's share of --budget-s: the rest of the part's budget is the
    # bench's own start (imports) and end (its JSON).
    assert context.budget_s + 10 <= parts["max_context"].budget_s


# -- the conftest's log -----------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2], ids=["one-process", "xdist"])
def test_conftest_writes_one_line_per_test_as_it_finishes(tmp_path: Path, workers: int) -> None:
    if workers and importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    suite = _fake_suite(tmp_path, FAKE_TESTS.replace("time.sleep(600)", "pass"))
    (suite / "test_broken.py").write_text("raise ImportError('no such kernel')\n")
    expected = {"test_fake.py::test_passes": "passed", "test_fake.py::test_fails": "failed",
                "test_fake.py::test_skips": "not run", "test_fake.py::test_xfails": "xfailed",
                "test_fake.py::test_hangs": "passed", "test_broken.py": "error"}
    log = tmp_path / "tests.jsonl"
    argv = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider",
            "--continue-on-collection-errors"]
    if workers:
        argv += ["-n", str(workers)]
        # A worker that dies mid-test: the controller logs the test it was running.
        (suite / "test_crash.py").write_text("import os\n\ndef test_crash():\n    os._exit(3)\n")
        expected["test_crash.py::test_crash"] = "failed"
    done = subprocess.run(argv, env={**os.environ, "RINGTRAIN_GPU_LOG": str(log)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    records = _records(log)
    outcomes = [r for r in records if r["event"] == "outcome"]
    by_test = {r["nodeid"].split("/")[-1]: r["outcome"] for r in outcomes}
    assert by_test == expected, outcomes
    assert len(outcomes) == len(by_test)  # one line each: the xdist controller repeats none
    tracebacks = {r["nodeid"].split("/")[-1]: r.get("traceback", "") for r in outcomes}
    assert "no such kernel" in tracebacks["test_broken.py"] and "arithmetic" in tracebacks["test_fake.py::test_fails"]
    starts = [r["nodeid"] for r in records if r["event"] == "start"]
    num_tests = len(expected) - 1  # the broken module has none
    assert len(starts) == len(set(starts)) == num_tests
    assert [r["count"] for r in records if r["event"] == "collected"] == [num_tests]
    ran = {r["worker"] for r in outcomes if r["nodeid"].count("::") and r["when"] != "???"}
    # On workers, not the controller: gw0, gw1, or the worker xdist starts in the crashed one's place.
    assert ran and all(re.fullmatch(r"gw\d+", w) for w in ran) if workers else ran == {"main"}, ran
    if workers:
        crash = next(r for r in outcomes if r["nodeid"].endswith("test_crash"))
        assert crash["worker"] == "main" and "crashed" in crash["traceback"], crash


def test_after_a_sticky_cuda_error_the_process_runs_no_more_tests_and_says_where_it_was_lost(tmp_path: Path) -> None:
    """A rank's error that a test re-raises leaves the test's own context whole: the tests after
    it run. One that this process's context answers every call with ends its tests there."""
    suite = _fake_suite(tmp_path, """
        import sys
        import types

        class Cuda:  # torch.cuda as the conftest asks it, in a process whose CUDA is started
            lost = False

            @staticmethod
            def is_initialized():
                return True

            @classmethod
            def synchronize(cls):
                if cls.lost:
                    raise RuntimeError("CUDA error: an illegal memory access was encountered")

        sys.modules["torch"] = types.SimpleNamespace(cuda=Cuda)

        def test_before():
            pass

        def test_a_rank_failed():
            raise RuntimeError("rank 1: CUDA error: an illegal memory access was encountered")

        def test_between():
            pass

        def test_poisons():
            Cuda.lost = True
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        def test_after():
            pass
    """)
    log = tmp_path / "tests.jsonl"
    done = subprocess.run([sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider"],
                          env={**os.environ, "RINGTRAIN_GPU_LOG": str(log)}, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout[-2000:]
    outcomes = {r["nodeid"].split("::")[-1]: r for r in _records(log) if r["event"] == "outcome"}
    assert {name: r["outcome"] for name, r in outcomes.items()} == {
        "test_before": "passed", "test_a_rank_failed": "failed", "test_between": "passed", "test_poisons": "failed",
        "test_after": "not run"}
    assert outcomes["test_after"]["reason"].endswith("CUDA context was lost in test_fake.py::test_poisons")


# -- tests/gpu/slow_first.py: the slow tests lead the workers' shares ---------------------------


def test_the_slow_tests_lead_each_share_of_worksteals_first_split() -> None:
    from tests.gpu.slow_first import first_shares, slow_first

    assert first_shares(10, 4) == [2, 2, 3, 3] and first_shares(3, 4) == [0, 1, 1, 1]
    items = [f"t{i}" for i in range(10)] + ["s0", "s1", "s2", "s3", "s4"]  # the slow ones last, as collected
    ordered = slow_first(items, lambda item: item.startswith("s"), 4)
    assert sorted(ordered) == sorted(items)
    heads = [sum(first_shares(len(items), 4)[:k]) for k in range(4)]
    assert [ordered[h] for h in heads] == ["s0", "s1", "s2", "s3"]
    assert ordered[heads[0] + 1] == "s4"  # one more than the workers: the first share's second
    assert [item for item in ordered if item.startswith("t")] == items[:10]  # the rest keep their order


@slow
def test_under_xdist_each_worker_starts_with_a_slow_test(tmp_path: Path) -> None:
    """The plugin as the tests part loads it: with worksteal on two workers, the two tests marked
    slow, collected last, are the first each worker starts (tests/gpu/conftest.py's log)."""
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed")
    runner = _load_runner()
    suite = _fake_suite(tmp_path, "import pytest\n\n" + "".join(f"def test_quick_{i}():\n    pass\n\n" for i in range(6))
                        + "".join(f"@pytest.mark.slow\ndef test_slow_{i}():\n    pass\n\n" for i in range(2)))
    log = tmp_path / "tests.jsonl"
    argv = [sys.executable, "-m", "pytest", str(suite), "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
            "worksteal", "-p", runner.SLOW_FIRST]
    done = subprocess.run(argv, cwd=REPO, env={**os.environ, "RINGTRAIN_GPU_LOG": str(log)}, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    first: dict[str, str] = {}
    for record in _records(log):
        if record["event"] == "start":
            first.setdefault(record["worker"], record["nodeid"].split("::")[1])
    assert sorted(first.values()) == ["test_slow_0", "test_slow_1"], first


# -- tests/gpu/support.py: left out on purpose -------------------------------------------------


@pytest.fixture
def support(monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    from tests.gpu import support as module

    monkeypatch.setenv(module.STRICT_ENV, "1")
    monkeypatch.delenv(module.LEFT_OUT_ENV, raising=False)
    yield module


def test_a_package_left_out_on_purpose_is_not_run_even_when_strict(
    support: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    absent = "rt-gpu-tier-absent"
    with pytest.raises(pytest.fail.Exception, match="RINGTRAIN_GPU_STRICT is set"):
        support.missing("kernel x is not available here", absent)
    monkeypatch.setenv(support.LEFT_OUT_ENV, f"flash-attn {absent.replace('-', '_')}")
    with pytest.raises(pytest.skip.Exception, match=rf"^not run: needs {absent}: kernel x is not available here"):
        support.missing("kernel x is not available here", absent)
    # Listed but installed: it must work, so strict still fails a test that cannot use it.
    monkeypatch.setenv(support.LEFT_OUT_ENV, "pytest")
    with pytest.raises(pytest.fail.Exception):
        support.missing("pytest is broken", "pytest")


def test_the_ray_mark_reports_not_run_naming_ray_only_where_it_may(
    support: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    mark = support.needs_module("rt_gpu_tier_absent", "rt-gpu-tier-absent", "Ray")
    assert mark.args == (False,)  # strict and expected: the test runs, and its import fails
    monkeypatch.setenv(support.LEFT_OUT_ENV, "rt-gpu-tier-absent")
    mark = support.needs_module("rt_gpu_tier_absent", "rt-gpu-tier-absent", "Ray")
    assert mark.args == (True,) and mark.kwargs["reason"].startswith("not run: needs Ray: rt_gpu_tier_absent")
    assert support.needs_module("pytest", "pytest", "pytest").args == (False,)  # installed: runs

    from tests.gpu import test_placement_gpu

    # pytest reports the first true skipif: Ray is named before the GPU count.
    reasons = [m.kwargs.get("reason", "") for m in test_placement_gpu.pytestmark if m.name == "skipif"]
    assert len(reasons) == 3 and reasons[0] == "needs CUDA", reasons
    assert reasons[1].startswith("not run: needs Ray: ray is not installed here")
    assert reasons[2].startswith("needs 2 GPUs")


# -- the wheel folder, end to end (downloads from the package index) ----------------------------


def _torch_only(folder: Path) -> Path:
    """A folder of links to torch and the distributions it requires (and nothing else of this
    venv): a stand-in for a node's preinstalled CUDA PyTorch."""
    from packaging.requirements import Requirement

    folder.mkdir()
    todo, done = ["torch"], set()
    while todo:
        name = todo.pop()
        dist = importlib.metadata.distribution(name)
        key = dist.metadata["Name"].lower()
        if key in done:
            continue
        done.add(key)
        for file in dist.files or []:
            top = file.parts[0]
            if top != ".." and not (folder / top).exists():
                (folder / top).symlink_to(Path(str(dist.locate_file(top))))
        for text in dist.requires or []:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    return folder


@slow
def test_gpu_wheels_folder_installs_and_imports_the_tier_in_a_fresh_venv(tmp_path: Path) -> None:
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    py = "%d.%d" % sys.version_info[:2]  # this Python's wheels, so that a venv here can install them
    made = subprocess.run(
        [_make_binary(), "-s", f"PYTHON={sys.executable}", f"DEST={wheels}", f"PY={py}", "gpu-wheels"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    names = {p.name.split("-")[0].lower() for p in wheels.glob("*.whl")}
    assert {"deepspeed", "ringtrain", "pydantic_core", "liger_kernel", "pip"} <= names, names

    # A venv with no pip and nothing but torch: pip runs from its wheel in the folder.
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(fresh)], check=True, timeout=120)
    python = fresh / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "node_torch.pth").write_text(f"{_torch_only(tmp_path / 'node-torch')}\n")

    offline = _make("test-gpu", tmp_path, "PYTHON_ENV=system", f"PYTHON={python}", f"WHEELS={wheels}",
                    f"GPU_SITE={site}", f"VENV={tmp_path / 'venv'}", "PYTEST_ARGS=--collect-only -q",
                    gpu_visible=False, env=CLOSED_INDEX, offline=True)
    assert offline.returncode == 0, offline.stdout[-3000:] + offline.stderr[-3000:]
    assert re.search(r"^\d+ tests? collected", offline.stdout, re.MULTILINE), offline.stdout[-2000:]
    assert "deepspeed==" in offline.stdout and "pip==" in offline.stdout  # installed from the folder

    # ringtrain's own wheel, installed like the rest: the tier imports from it, outside the checkout.
    pip_wheel = next(wheels.glob("pip-*.whl"))
    subprocess.run([str(python), f"{pip_wheel}/pip", "install", "-q", "--no-index", "--find-links", str(wheels),
                    "--no-deps", "ringtrain"], check=True, timeout=300, capture_output=True,
                   # Without this checkout on the path: pip would take its egg-info for ringtrain installed.
                   env={**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **CLOSED_INDEX,
                        "PIP_CONFIG_FILE": os.devnull})
    probe = textwrap.dedent("""
        import importlib.metadata, importlib.util, sys
        import ringtrain.train.trainer, ringtrain.train.sdc_probes, deepspeed, omegaconf, pydantic, pytest, xdist
        import ringtrain.hf.hfconfig
        from transformers import LlamaForCausalLM, Qwen3ForCausalLM  # bench/train.py's hf variant
        assert ringtrain.__file__.startswith(sys.prefix), ringtrain.__file__
        if importlib.util.find_spec("triton") is None:  # liger-kernel's kernels are Triton: check it is there
            print("liger-kernel", importlib.metadata.version("liger-kernel"), "installed; not imported: no triton here")
        else:
            import liger_kernel.transformers.functional
        print("imported")
    """)
    done = subprocess.run([str(python), "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          # Its own extension folder: a build against this venv's paths must not
                          # replace the one every other test's DeepSpeed loads.
                          env={**os.environ, "PYTHONPATH": str(site), "DS_ACCELERATOR": "cpu",
                               "TORCH_EXTENSIONS_DIR": str(tmp_path / "torch-extensions")})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.strip().endswith("imported")


@needs_no_cuda
@slow
def test_train_bench_refuses_to_run_without_cuda() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "bench" / "train.py")],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO / "platform")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "needs a CUDA GPU" in done.stderr


@slow
@pytest.mark.parametrize("part", ["timing", "tests"])
def test_gpu_tier_collects_on_any_machine_with_the_flags_its_parts_give(part: str) -> None:
    runner = _load_runner()
    argv = next(p.argv for p in runner.default_parts() if p.name == part)
    done = subprocess.run([*argv, "--collect-only", "-qq"], cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO / "platform")})  # -qq after the part's -v: ids
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^\d+ tests? collected", done.stdout, re.MULTILINE), done.stdout[-2000:]
