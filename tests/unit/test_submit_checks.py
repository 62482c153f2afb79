"""`ringtrain submit` calls a job started only once the job's own input checks passed on the
cluster: its S3 URIs are tried with the cluster's credentials and endpoint, and a job that
refuses them is reported with its own line and the --env that would pass this shell's."""

from __future__ import annotations

from ringtrain.commands.submit_checks import CHECKED, Verdict, await_checks, env_hints
from ringtrain.errors import ClusterError, ConfigError, DataError, ending
from ringtrain.submission_secrets import check_env_names

NO_CREDENTIALS = (
    "ringtrain: config error: checkpoint.uri: s3://ringtrain/q: no AWS credentials were found: set AWS_ACCESS_KEY_ID "
    "and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or AWS_SHARED_CREDENTIALS_FILE naming a credentials file)"
)


class Job:
    """A job's status and log as the job API would answer them, one answer a poll."""

    def __init__(self, answers: list[tuple[str, str]]) -> None:
        self.answers = answers
        self.polls = 0

    def status(self, submission_id: str) -> str:
        return self.answers[min(self.polls, len(self.answers) - 1)][0]

    def logs(self, submission_id: str) -> str:
        logs = self.answers[min(self.polls, len(self.answers) - 1)][1]
        self.polls += 1
        return logs


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def _await(job: Job, environ: dict[str, str], timeout_s: float = 600.0) -> Verdict:
    clock = Clock()
    return await_checks(job, "ringtrain-q-1", timeout_s=timeout_s, environ=environ, sleep=clock.sleep, clock=clock)


def test_a_job_whose_inputs_pass_on_the_cluster_is_started() -> None:
    job = Job([("PENDING", ""), ("RUNNING", "importing\n"), ("RUNNING", f"importing\n{CHECKED}\n")])
    assert _await(job, {}) == Verdict(True, "RUNNING", (), False) and job.polls == 3


def test_a_job_refusing_its_s3_uri_on_the_cluster_names_the_variables_and_the_flags_to_pass() -> None:
    """The flags submit takes: --secret for credentials holding a secret-looking name (submit
    refuses it with --env), all of them alike, since a key id on the workers without its secret
    would stop boto3 there; no credentials file nor profile, which name this machine's files."""
    job = Job([("RUNNING", ""), ("FAILED", f"some Ray line\n{NO_CREDENTIALS}\n")])
    verdict = _await(job, {"AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s", "AWS_SESSION_TOKEN": "t",
                           "AWS_SHARED_CREDENTIALS_FILE": "/home/me/.aws/credentials", "AWS_PROFILE": "dev",
                           "HOME": "/h"})  # fmt: skip
    assert not verdict.passed and verdict.bad_input and verdict.status == "FAILED"
    assert verdict.lines == (
        NO_CREDENTIALS,
        "ringtrain: this shell sets AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN: give them to the job with "
        "--secret AWS_ACCESS_KEY_ID --secret AWS_SECRET_ACCESS_KEY --secret AWS_SESSION_TOKEN (a --secret reaches the job's "
        "driver only, which writes the checkpoints; a dataset on s3:// is read by the workers with the cluster's own "
        "credentials), or set them on the cluster",
    )
    flags = verdict.lines[1].split(" give them to the job with ")[1].split(" (")[0].split()
    check_env_names([name for flag, name in zip(flags[::2], flags[1::2]) if flag == "--env"])  # submit takes them
    assert env_hints((NO_CREDENTIALS,), {"AWS_PROFILE": "dev"}) == []
    # Nothing of it here either: the job's own line (which names the variables) is all there is to say.
    assert _await(Job([("FAILED", NO_CREDENTIALS)]), {}).lines == (NO_CREDENTIALS,)


def test_an_endpoint_the_cluster_cannot_reach_offers_this_shells_endpoint() -> None:
    line = "ringtrain: config error: checkpoint.uri: s3://b/q: cannot reach the S3 endpoint AWS's own endpoint (after retries)"
    assert env_hints((line,), {"AWS_ENDPOINT_URL": "http://127.0.0.1:9000"}) == [
        "ringtrain: this shell sets AWS_ENDPOINT_URL: give them to the job with --env AWS_ENDPOINT_URL, or set them on the cluster"
    ]
    assert env_hints(("ringtrain: error: rank 0 on h: died",), {"AWS_ENDPOINT_URL": "x"}) == []


def test_a_job_that_fails_otherwise_or_takes_its_time() -> None:
    failed = _await(Job([("FAILED", "ringtrain: error: the cluster cannot place 4 workers\n")]), {})
    assert not failed.passed and not failed.bad_input
    # Still starting after the bound: it runs, slowly; the user follows it as any other.
    slow = _await(Job([("RUNNING", "")]), {}, timeout_s=5.0)
    assert slow.passed and slow.status == "RUNNING"


def test_the_line_a_job_ends_with_on_bad_input_is_what_submit_calls_bad_input() -> None:
    """The job's `ringtrain run` ends through errors.ending, and submit reads that line back."""
    refused = ending(ConfigError("data.path", "no such file or directory: /data/x")).line
    too_little = ending(DataError("/data/x.jsonl: 12 tokens, fewer than data.seq_len + 1")).line
    failed = ending(ClusterError("cannot reach ray://head:10001")).line
    assert _await(Job([("FAILED", f"some Ray line\n{refused}\n")]), {}).bad_input
    assert _await(Job([("FAILED", f"{too_little}\n")]), {}).bad_input
    assert not _await(Job([("FAILED", f"{failed}\n")]), {}).bad_input
