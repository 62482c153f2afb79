"""`ringtrain submit|status|logs|stop` and plain `ray job submit` against a real Ray head.

One head is started for the module with the venv's `ray start --head`, on free ports, with its
own HOME and RAY_TMPDIR, and token authentication on (as the chart and the local stack run
Ray): commands get its token from RAY_AUTH_TOKEN (``head.env``), ``--token`` or ``--token-file``.
Its PATH is a user's shell's without the venv, led by a ``python`` that fails (``shell_path``):
jobs run on the venv's Python because they name it (RINGTRAIN_CLUSTER_PYTHON in ``head.env``). At teardown
every process whose environment names that RAY_TMPDIR (the head's daemons, job drivers,
training workers) is ended by PID and none may be left.
"""

from __future__ import annotations

import http.server
import json
import queue
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Iterator

import pytest
import requests

from ringtrain import config
from ringtrain.checkpoint import open_store
from ringtrain.submission import (
    DEFAULT_ADDRESS,
    JobsClient,
    auth_headers,
    base_submission_id,
    entrypoint,
    family_ids,
    next_free_id,
    resolve_address,
    runtime_env,
)
from ringtrain.submission_files import listing
from ringtrain_dev.ray_head import (
    HEAD_START_TIMEOUT_S,
    REPO,
    VENV_BIN,
    describe,
    free_ports,
    head_env,
    processes_of,
    processes_using,
    running_head,
)
from ringtrain_dev.tiny import TINIEST_MODEL
from ringtrain_dev.tiny_tokenizer import save_tokenizer
from tests.tools import missing

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOBS = REPO / "jobs"
QUICKSTART = JOBS / "quickstart.yaml"
TINY = [
    *TINIEST_MODEL,
    "data.seq_len=64",
    "train.global_batch=4",
    "train.steps=3",
    "cluster.num_cpus=2",
    "mesh.dp=2",
    "mesh.cp=2",
    "checkpoint.persist_every=0",
]
# One worker, where what is tested is the job's way to the cluster and back, not its mesh.
ONE_WORKER = [o for o in TINY if not o.startswith("mesh.")] + ["mesh.dp=1", "mesh.cp=1"]
LONG = [o for o in ONE_WORKER if not o.startswith("train.steps=")] + ["train.steps=100000"]
ID_PATTERN = re.compile(r"ringtrain-quickstart-[0-9a-f]{10}")
JOB_TIMEOUT_S = 180.0


TOKEN = "rt-test-" + "0123456789abcdef" * 2


@dataclass(frozen=True)
class Head:
    address: str  # the job API, http://127.0.0.1:<dashboard port>
    gcs_port: int
    temp_dir: Path
    env: dict[str, str]  # for every command run against this head; RAY_AUTH_TOKEN holds the token
    token: str

    def env_without_token(self) -> dict[str, str]:
        """A client that knows no token and does not authenticate on its own (as a laptop
        whose Ray never met this cluster): only ``--token`` can make it send one."""
        env = {k: v for k, v in self.env.items() if k != "RAY_AUTH_TOKEN"}
        env["RAY_AUTH_MODE"] = "disabled"
        return env


def job_api_answers(address: str, env: dict[str, str]) -> bool:
    probe = (
        "import sys; from ray.job_submission import JobSubmissionClient; "
        "JobSubmissionClient(sys.argv[1]).list_jobs()"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe, address], env=env, capture_output=True, text=True, timeout=60
    )
    return result.returncode == 0


@pytest.fixture(scope="module")
def head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Head]:
    # Short on purpose: Ray's unix socket paths live below it and must stay under 107 bytes.
    temp_dir = Path(tempfile.mkdtemp(prefix="rtj-", dir="/tmp"))
    env = head_env(tmp_path_factory.mktemp("home"), temp_dir, token=TOKEN)
    try:
        with running_head(temp_dir, env, dashboard=True, object_store_bytes=200 * 2**20) as (gcs, dashboard):
            address = f"http://127.0.0.1:{dashboard}"
            deadline = time.monotonic() + HEAD_START_TIMEOUT_S
            while not job_api_answers(address, env):
                assert time.monotonic() < deadline, f"the job API at {address} did not answer"
                time.sleep(1)
            yield Head(address=address, gcs_port=gcs, temp_dir=temp_dir, env=env, token=TOKEN)
    finally:
        left = processes_using(temp_dir)
        shutil.rmtree(temp_dir, ignore_errors=True)
    assert left == []


def ringtrain(
    head: Head, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ringtrain", *args],
        env=env or head.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def submitted_ids(head: Head) -> set[str]:
    """Every submission id the cluster knows, straight from Ray's job SDK."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(head.address, headers=auth_headers(head.token))
    return {j.submission_id for j in client.list_jobs() if j.submission_id}


def status_of(head: Head, submission_id: str) -> str:
    result = ringtrain(head, "status", submission_id, "--address", head.address)
    assert result.returncode == 0, result.stderr[-2000:]
    first = result.stdout.splitlines()[0]
    assert first.startswith(f"{submission_id}: "), result.stdout
    return first.split(": ", 1)[1]


def wait_until_ended(head: Head, submission_id: str, timeout: float = JOB_TIMEOUT_S) -> str:
    """The job's final status as `ringtrain status` prints it, once the job API says it ended.
    The polling runs in this process: a `ringtrain status` every second would cost a core."""
    client = JobsClient(head.address, head.token)
    deadline = time.monotonic() + timeout
    while not (state := client.state(submission_id)).terminal:
        assert time.monotonic() < deadline, f"{submission_id} still {state.status} after {timeout:g} s"
        time.sleep(1)
    return status_of(head, submission_id)


def pump(stream: IO[str] | None, lines: queue.Queue[str]) -> None:
    for line in stream or []:
        lines.put(line)


def wait_for_line(lines: queue.Queue[str], pattern: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no line matching {pattern!r} after {timeout:g} s"
        try:
            if re.match(pattern, lines.get(timeout=remaining)):
                return
        except queue.Empty:
            continue


def no_training_workers(head: Head, timeout: float) -> bool:
    """Whether every TrainWorker process of the head is gone within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while any("TrainWorker" in describe(p) for p in processes_of(head.temp_dir)):
        if time.monotonic() > deadline:
            return False
        time.sleep(1)
    return True


def test_the_id_is_the_job_name_and_a_hash_of_the_resolved_config() -> None:
    plain = base_submission_id(config.load(QUICKSTART))
    assert re.fullmatch(r"ringtrain-quickstart-[0-9a-f]{10}", plain)
    # An override equal to the file's value resolves to the same config, hence the same id.
    assert base_submission_id(config.load(QUICKSTART, ["zero.stage=2"])) == plain
    assert base_submission_id(config.load(QUICKSTART, ["train.steps=3"])) != plain


def test_an_ended_submission_is_resubmitted_under_the_next_suffix() -> None:
    base = "ringtrain-quickstart-0123456789"
    assert next_free_id(base, set()) == base
    assert next_free_id(base, {base}) == f"{base}-2"
    assert next_free_id(base, {base, f"{base}-2"}) == f"{base}-3"
    known = {base, f"{base}-2", f"{base}-x", f"{base}-2-0123456789", "raysubmit_abc"}
    assert family_ids(base, known) == [base, f"{base}-2"]


def test_the_job_runs_its_file_from_its_working_dir_with_this_ringtrain(tmp_path: Path) -> None:
    assert entrypoint(QUICKSTART, ["train.steps=3", "run_dir=/tmp/a b"]) == (
        "python -m ringtrain run quickstart.yaml train.steps=3 'run_dir=/tmp/a b'"
    )
    assert entrypoint(QUICKSTART, [], "/opt/my env/bin/python") == "'/opt/my env/bin/python' -m ringtrain run quickstart.yaml"
    env = runtime_env(tmp_path)
    assert env["working_dir"] == str(tmp_path)
    assert env["py_modules"] == [str(REPO / "platform" / "ringtrain")]
    assert "py_modules" not in runtime_env(tmp_path, ship_package=False)


def test_the_address_is_the_flag_then_ray_variables_then_local(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_API_SERVER_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert resolve_address(None) == DEFAULT_ADDRESS == "http://127.0.0.1:8265"
    monkeypatch.setenv("RAY_ADDRESS", "http://b:8265")
    assert resolve_address(None) == "http://b:8265"
    monkeypatch.setenv("RAY_API_SERVER_ADDRESS", "http://a:8265")
    assert resolve_address(None) == "http://a:8265"
    assert resolve_address("http://c:8265") == "http://c:8265"


def job_folder(root: Path) -> Path:
    """A job file beside what must never leave the machine (a .env, AWS keys, notes) and the
    corpus folder it names by a relative path (with a hidden file of its own)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny-job.yaml").write_text(QUICKSTART.read_text())
    (root / ".env").write_text("AWS_SECRET_ACCESS_KEY=do-not-ship\n")
    (root / ".aws").mkdir()
    (root / ".aws" / "credentials").write_text("[default]\naws_secret_access_key = do-not-ship\n")
    (root / "notes.txt").write_text("not declared by the job\n")
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(3):
        (corpus / f"part-{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog. " * 60)
    (corpus / ".cache").write_text("hidden\n")
    return root / "tiny-job.yaml"


def unpacked_working_dirs(head: Head, job_name: str) -> list[Path]:
    """The working_dirs Ray unpacked on the head for jobs whose file is ``job_name``."""
    found = head.temp_dir.glob(f"session_*/runtime_resources/working_dir_files/*/{job_name}")
    return sorted({p.parent.resolve() for p in found})  # session_latest links to the session


def test_submit_with_the_token_flag_runs_the_job_and_ships_only_what_it_declares(
    head: Head, tmp_path: Path, fake_tracker: tuple[str, list[str]]
) -> None:
    """The job also takes an MLflow token with --secret: its driver sends it to the (fake)
    tracking server, and neither the job API nor any file of Ray's holds it afterwards."""
    tracker_uri, tracker_requests = fake_tracker
    job = job_folder(tmp_path / "job")
    secret = "mlflow-token-" + uuid.uuid4().hex
    submitted = ringtrain(
        head, "submit", str(job), *ONE_WORKER, "data.path=corpus", f"telemetry.mlflow.tracking_uri={tracker_uri}",
        "--address", head.address, "--token", head.token, "--no-wait", "--secret", "MLFLOW_TRACKING_TOKEN",
        env={**head.env_without_token(), "MLFLOW_TRACKING_TOKEN": secret},
    )  # fmt: skip
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    submission_id = submitted.stdout.strip()
    assert ID_PATTERN.fullmatch(submission_id), submitted.stdout
    assert f"ringtrain logs {submission_id} --follow" in submitted.stderr
    assert f"ray job logs {submission_id} --follow" in submitted.stderr
    assert "--token" in submitted.stderr and head.token not in submitted.stderr + submitted.stdout
    assert "warning" not in submitted.stderr  # loopback: no plain-http warning

    # RAY_ADDRESS names the cluster when --address is not given, RAY_AUTH_TOKEN the token.
    assert wait_until_ended(head, submission_id) == "SUCCEEDED"
    by_env = ringtrain(head, "status", submission_id, env={**head.env, "RAY_ADDRESS": head.address})
    assert by_env.returncode == 0 and "SUCCEEDED" in by_env.stdout, by_env.stderr[-2000:]

    logs = ringtrain(head, "logs", submission_id, "--address", head.address)
    assert logs.returncode == 0, logs.stderr[-2000:]
    assert "run finished: 3/3 steps" in logs.stdout
    # The driver joined this head (Ray sets RAY_ADDRESS for it) instead of starting its own.
    assert "embedded Ray" not in logs.stdout
    # ONE_WORKER's mesh, not the job file's: the overrides went with the submission.
    assert re.search(rf"ringtrain: quickstart: dp 1 x cp 1 .*:{head.gcs_port}$", logs.stdout, re.M), logs.stdout

    token_file = tmp_path / "token"
    token_file.write_text(head.token + "\n")
    followed = ringtrain(
        head, "logs", submission_id, "--follow", "--address", head.address, "--token-file", str(token_file),
        env=head.env_without_token(),
    )  # fmt: skip
    assert followed.returncode == 0, followed.stderr[-2000:]
    assert "run finished: 3/3 steps" in followed.stdout

    # What the cluster unpacked for the job: its file and the corpus it declared, nothing hidden.
    unpacked = unpacked_working_dirs(head, job.name)
    assert len(unpacked) == 1, unpacked
    shipped = [f for f in listing(unpacked[0]) if not f.startswith("runs/")]  # runs/: the job's own output
    assert shipped == ["corpus/part-0.txt", "corpus/part-1.txt", "corpus/part-2.txt", "tiny-job.yaml"]

    # The secret reached the driver, which gave it to MLflow, and stays nowhere on the cluster.
    assert tracker_requests and all(r.endswith(f"Bearer {secret}") for r in tracker_requests), tracker_requests
    listed = requests.get(f"{head.address}/api/jobs/", headers=auth_headers(head.token), timeout=30)
    assert listed.status_code == 200 and submission_id in listed.text and secret not in listed.text
    for path in head.temp_dir.rglob("*"):
        if path.is_file() and not path.is_symlink():
            assert secret.encode() not in path.read_bytes(), path
    job_env = next(j for j in listed.json() if j["submission_id"] == submission_id)["runtime_env"]["env_vars"]
    sealed = job_env["RINGTRAIN_SECRETS"].removeprefix("gcs://")
    assert requests.get(f"{head.address}/api/packages/gcs/{sealed}", headers=auth_headers(head.token), timeout=30).status_code == 404


@pytest.fixture
def fake_tracker() -> Iterator[tuple[str, list[str]]]:
    """A tracking server on loopback that answers every request and records its Authorization."""
    try:
        import mlflow  # noqa: F401 - the job's driver needs MLflow's client
    except ImportError:
        missing("mlflow is not installed (pip install -e '.[test]')")
    from tests.unit.test_tracker_destinations import FakeTracker

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), FakeTracker)
    FakeTracker.requests = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", FakeTracker.requests
    finally:
        server.shutdown()
        server.server_close()


def test_a_run_that_joins_the_cluster_reads_its_relative_inputs_from_its_own_folder(head: Head, tmp_path: Path) -> None:
    # RAY_ADDRESS makes `ringtrain run` join this head instead of starting one. Its workers start
    # in Ray's folders, not the driver's: the relative data path must still name the job's corpus.
    job = job_folder(tmp_path / "job")
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", "run", job.name, *ONE_WORKER, "data.path=corpus"],
        env={**head.env, "RAY_ADDRESS": f"127.0.0.1:{head.gcs_port}"}, cwd=job.parent,
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    assert "run finished: 3/3 steps" in output
    assert "embedded Ray" not in output and f":{head.gcs_port}" in output


def test_a_prepare_that_joins_the_cluster_reads_its_relative_sources_and_tokenizer(head: Head, tmp_path: Path) -> None:
    job = job_folder(tmp_path / "job")
    save_tokenizer(job.parent / "tok")
    done = subprocess.run(
        [sys.executable, "-m", "ringtrain", "prepare", "corpus", "--tokenizer", "tok", "--out", "prepared"],
        env={**head.env, "RAY_ADDRESS": f"127.0.0.1:{head.gcs_port}"}, cwd=job.parent,
        capture_output=True, text=True, timeout=JOB_TIMEOUT_S,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    manifest = json.loads((job.parent / "prepared" / "manifest.json").read_text())
    assert [Path(s["uri"]).name for s in manifest["sources"]] == ["part-0.txt", "part-1.txt", "part-2.txt"]


def test_without_the_right_token_every_command_exits_2_naming_what_to_pass(head: Head) -> None:
    before = submitted_ids(head)
    no_token = head.env_without_token()
    cases = [
        (["submit", str(QUICKSTART), *TINY, "--no-wait"], no_token, "requires a token"),
        (["submit", str(QUICKSTART), *TINY, "--no-wait", "--token", "wrong-" + head.token], no_token, "refused the token"),
        (["submit", str(QUICKSTART), *TINY, "--no-wait"], {**no_token, "RAY_AUTH_TOKEN": "wrong"}, "refused the token"),
        (["status"], no_token, "requires a token"),
        (["logs", "ringtrain-x-0000000000"], no_token, "requires a token"),
        (["stop", "ringtrain-x-0000000000"], no_token, "requires a token"),
    ]
    for args, env, reason in cases:
        result = ringtrain(head, *args, "--address", head.address, env=env)
        assert result.returncode == 2, (args, result.stderr[-2000:])
        line = result.stderr.strip()
        assert len(line.splitlines()) == 1 and "Traceback" not in line, result.stderr
        assert reason in line and head.address in line, line
        assert "--token" in line and "RAY_AUTH_TOKEN" in line, line
        assert head.token not in line
        assert result.stdout == ""
    assert submitted_ids(head) == before


def test_the_shipped_package_is_what_the_job_imports(head: Head) -> None:
    """py_modules puts this ringtrain ahead of any installed one, on the driver and on workers."""
    probe = (
        "import ray, ringtrain; ray.init(); print('driver', ringtrain.__file__); "
        "print('worker', ray.get(ray.remote(lambda: __import__('ringtrain').__file__).remote()))"
    )
    code = (
        "import sys\n"
        "from pathlib import Path\n"
        "from ray.job_submission import JobSubmissionClient\n"
        "from ringtrain import config, submission, submission_files\n"
        "client = JobSubmissionClient(sys.argv[1])\n"
        "job = Path(sys.argv[2])\n"
        "with submission_files.working_dir(job, config.load(job)) as folder:\n"
        "    print(client.submit_job(entrypoint=sys.argv[3], runtime_env=submission.runtime_env(folder)))\n"
    )
    submitted = subprocess.run(
        [sys.executable, "-c", code, head.address, str(QUICKSTART), f"{shlex.quote(sys.executable)} -c {shlex.quote(probe)}"],
        env=head.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    probe_id = submitted.stdout.strip().splitlines()[-1]
    assert wait_until_ended(head, probe_id) == "SUCCEEDED"
    logs = ringtrain(head, "logs", probe_id, "--address", head.address).stdout
    paths = dict(line.split(" ", 1) for line in logs.splitlines() if line.startswith(("driver ", "worker ")))
    assert set(paths) == {"driver", "worker"}, logs
    for path in paths.values():
        assert "py_modules_files" in path and not path.startswith(str(REPO)), logs


def test_plain_ray_job_submit_runs_the_job(head: Head) -> None:
    result = subprocess.run(
        [
            str(VENV_BIN / "ray"), "job", "submit",
            "--address", head.address,
            "--working-dir", "jobs",
            "--", head.env["RINGTRAIN_CLUSTER_PYTHON"], "-m", "ringtrain", "run", "quickstart.yaml", *ONE_WORKER,
        ],  # fmt: skip
        env=head.env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=JOB_TIMEOUT_S + 60,
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-3000:]
    assert "run finished: 3/3 steps" in result.stdout
    assert "embedded Ray" not in result.stdout


def test_stop_ends_a_training_job_and_the_same_config_is_not_run_twice(head: Head, tmp_path: Path) -> None:
    # Without --no-wait, submit prints the id, then follows the job's output until it ends.
    with open(tmp_path / "submit.err", "w+") as err:
        follower = subprocess.Popen(
            [sys.executable, "-m", "ringtrain", "submit", str(QUICKSTART), *LONG, "--address", head.address],
            env=head.env,
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
        try:
            lines: queue.Queue[str] = queue.Queue()
            threading.Thread(target=pump, args=(follower.stdout, lines), daemon=True).start()
            submission_id = lines.get(timeout=120).strip()
            assert ID_PATTERN.fullmatch(submission_id), submission_id
            # The step counter is padded to the width of the total: "step      1/100000".
            wait_for_line(lines, r"step +1/100000 ", JOB_TIMEOUT_S)

            # The same config again while it trains: refused, nothing submitted.
            before = submitted_ids(head)
            again = ringtrain(head, "submit", str(QUICKSTART), *LONG, "--address", head.address, "--no-wait")
            assert again.returncode == 1, again.stderr[-3000:]
            assert "already running" in again.stderr and submission_id in again.stderr
            assert len(again.stderr.strip().splitlines()) == 1 and "Traceback" not in again.stderr
            taken = ringtrain(
                head, "submit", str(QUICKSTART), *LONG,
                "--submission-id", submission_id, "--address", head.address, "--no-wait",
            )  # fmt: skip
            assert taken.returncode == 1 and "already used" in taken.stderr, taken.stderr[-3000:]
            assert submitted_ids(head) == before

            stopped = ringtrain(head, "stop", submission_id, "--address", head.address)
            assert stopped.returncode == 0, stopped.stderr[-3000:]
            assert stopped.stdout.strip() == f"{submission_id}: STOPPED"
            assert status_of(head, submission_id) == "STOPPED"
            # The follower sees the job end and reports it as not succeeded.
            assert follower.wait(timeout=60) == 1
            err.seek(0)
            assert f"{submission_id} STOPPED" in err.read()
        finally:
            if follower.poll() is None:
                follower.kill()
                follower.wait()
    assert no_training_workers(head, timeout=30)

    # Once it has ended, the same config may run again under the next suffix.
    resubmitted = ringtrain(head, "submit", str(QUICKSTART), *LONG, "--address", head.address, "--no-wait")
    assert resubmitted.returncode == 0, resubmitted.stderr[-3000:]
    assert resubmitted.stdout.strip() == f"{submission_id}-2"
    stopped = ringtrain(head, "stop", f"{submission_id}-2", "--address", head.address)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"{submission_id}-2: STOPPED", stopped.stderr[-3000:]


def test_stop_of_a_submitted_run_saves_its_newest_snapshot(head: Head, tmp_path: Path) -> None:
    """`ringtrain stop`: Ray's job supervisor sends SIGTERM and, told so by the submission
    (RAY_JOB_STOP_WAIT_TIME_S), waits for the run's stop to save the newest in-memory snapshot
    (no durable checkpoint before: persist_every 0) before it would SIGKILL it."""
    store = tmp_path / "store"
    args = [*LONG, f"checkpoint.uri={store.as_uri()}", "--address", head.address, "--no-wait"]
    submitted = ringtrain(head, "submit", str(QUICKSTART), *args)
    assert submitted.returncode == 0, submitted.stderr[-3000:]
    submission_id = submitted.stdout.strip()
    client = JobsClient(head.address, head.token)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not re.search(r"^step +3/100000 ", client.logs(submission_id), re.M):
        assert time.monotonic() < deadline, f"no step 3 within {JOB_TIMEOUT_S:g} s: {client.logs(submission_id)[-3000:]}"
        time.sleep(1)
    stopped = ringtrain(head, "stop", submission_id, "--address", head.address)
    assert stopped.returncode == 0 and stopped.stdout.strip() == f"{submission_id}: STOPPED", stopped.stderr[-3000:]
    logs = client.logs(submission_id)
    last = max(int(m) for m in re.findall(r"^step +(\d+)/100000 ", logs, re.M))
    saved = [line for line in logs.splitlines() if line.startswith("stop: ")]
    assert saved and saved[0].startswith(f"stop: saved step {last} to {(store / f'step-{last:09d}').as_uri()} in "), logs[-3000:]
    assert [ref.step for ref in open_store(store.as_uri()).list()] == [last]  # the last step it printed: none lost
    assert not (store / "writer.lease").exists()
    assert no_training_workers(head, timeout=30)
    from ray.job_submission import JobSubmissionClient

    info = JobSubmissionClient(head.address, headers=auth_headers(head.token)).get_job_info(submission_id)
    assert info.runtime_env["env_vars"]["RAY_JOB_STOP_WAIT_TIME_S"] == "35"  # the default 20 s bound + 15 s


def test_bad_override_is_refused_before_anything_is_submitted(head: Head) -> None:
    before = submitted_ids(head)
    result = ringtrain(head, "submit", str(QUICKSTART), *TINY, "mesh.dpx=2", "--address", head.address)
    assert result.returncode == 2
    assert "mesh.dpx" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert result.stdout == ""
    assert submitted_ids(head) == before


def test_unknown_id_and_unreachable_cluster_are_one_line(head: Head) -> None:
    unknown = ringtrain(head, "status", "ringtrain-nope-0000000000", "--address", head.address)
    assert unknown.returncode == 2
    assert "ringtrain-nope-0000000000" in unknown.stderr and len(unknown.stderr.strip().splitlines()) == 1

    (closed,) = free_ports(1)
    for args in (["status", "x"], ["submit", str(QUICKSTART), *TINY]):
        unreachable = ringtrain(head, *args, "--address", f"http://127.0.0.1:{closed}")
        assert unreachable.returncode == 1, unreachable.stderr[-2000:]
        assert f"127.0.0.1:{closed}" in unreachable.stderr
        assert len(unreachable.stderr.strip().splitlines()) == 1 and "Traceback" not in unreachable.stderr
