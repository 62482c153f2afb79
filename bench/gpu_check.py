"""The GPU tier in a time box: each part in a subprocess with a wall-clock budget of its own,
its output streamed to a log as it runs, every test's outcome logged as it finishes, and one
summary at the end.

Parts, in order (``--only`` picks some, ``--budget part=seconds`` resizes one):

- timing: the timing-sensitive tests (a survivor's NCCL abort, the collective stall timing),
  alone on the GPU, one after another;
- tests: the rest of tests/gpu, on several pytest-xdist workers where xdist is installed (one
  GPU, small tests; its slow tests lead the workers' shares, tests/gpu/slow_first.py), each test
  held to its own timeout where pytest-timeout is installed;
- attention: bench/attention.py at short blocks, 2K, 4K and 8K tokens a rank on rings of 2, 4
  and 8 (and auto's threshold at 16K): the worst rank against one monolithic call, both K/V
  exchanges, packed documents, and ``attention.kv_exchange=auto``'s pick against the best;
- launches: bench/attention_launches.py at 2K, 4K and 8K tokens a rank: the worst rank's wall,
  GPU-busy and CUDA-graph-replayed time, and auto's pick against the best as run;
- train: bench/train.py --check, the Trainer on both shapes (MFU) and its per-step snapshot
  variant (the snapshot's cost);
- max_context: bench/max_context.py, the longest sequence one GPU trains for a 1B and an
  8B-shaped Llama, ringtrain against transformers', the planner's prediction beside each, under
  a memory cap that keeps the lengths short;
- train_baselines: bench/train.py --check against plain PyTorch and transformers on both shapes,
  and the per-step snapshot on the Qwen3 shape; only when ``--only`` names it (outside the box:
  see its budget's comment);
- nccl_abort: bench/nccl_abort.py, where the checkout has it; only when ``--only`` names it (its
  ~50 s do not fit the box, and the timing part already holds a survivor's abort to its bound).

The default parts' budgets fit, with each part's grace for stopping, in 8 minutes, sized
from each part's time on one H200 (the arithmetic beside them in ``default_parts``). A part past
its budget gets SIGINT (pytest then prints what it has, a bench its stack and what it measured),
SIGKILL after a grace, and is reported as timed out; the next part runs. Everything a part
starts shares a process group, ended with it.

Under ``--log-dir`` (default runs/gpu-check-<UTC time>/): ``<part>.log``, each part's output,
written line by line as it comes (and echoed here with the part's name); ``tests.jsonl``, the
tests' starts and outcomes (tests/gpu/conftest.py, through RINGTRAIN_GPU_LOG), failures with
their tracebacks; ``summary.json``, the summary printed at the end: per part its status (passed,
failed, not run, timed out), seconds, tests passed / failed / not run, the failing test ids, what
was running when a part was cut, and why tests did not run. Benches write their results under
bench/results/ themselves. Exit 0 when no part failed or timed out, 1 otherwise, 2 on bad flags.

``--missing FILE`` instead prints the lines of a requirements file whose distribution this
Python lacks (``make gpu-check PYTHON_ENV=system`` installs those from its wheel folder).

Python 3.10+ and the standard library only: it runs before anything is installed.

    python bench/gpu_check.py [--log-dir DIR] [--only tests,train] [--budget train=300 ...]
    python bench/gpu_check.py --missing infra/gpu-tier.txt
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Optional

ROOT = Path(__file__).resolve().parents[1]
LOG_ENV = "RINGTRAIN_GPU_LOG"  # read by tests/gpu/conftest.py
TESTS_LOG = "tests.jsonl"
SUMMARY = "summary.json"
EXIT_BAD_INPUT = 2
GRACE_S = 5.0  # from SIGINT to SIGKILL
TAIL_LINES = 8  # of a timed-out or failed part's output, in the summary
TEST_TIMEOUT_S = 90  # one test: a hung one fails alone, with its stack, instead of eating its part's budget
XDIST_WORKERS = 4
SLOW_FIRST = "tests.gpu.slow_first"  # the plugin that starts each xdist worker on a slow test
WORKSTEAL_SINCE = (3, 2)  # the pytest-xdist release that brought --dist worksteal
# Timing-sensitive tests: alone on the GPU, before anything else loads it.
TIMING_TESTS = ("tests/gpu/test_nccl_abort_gpu.py", "tests/gpu/test_collective_timing_gpu.py")
TIME_BOX_S = 480.0  # what the default budgets, with a grace each, must fit in
OUTCOMES = ("passed", "failed", "error", "not run", "xfailed", "xpassed")  # tests/gpu/conftest.py's words


@dataclasses.dataclass(frozen=True)
class Part:
    """One step of the tier: a command run from the repository root within ``budget_s``."""

    name: str
    argv: tuple[str, ...]
    budget_s: float
    pytest: bool = False  # its tests report to tests.jsonl
    needs: Optional[Path] = None  # not run where this file is missing
    default: bool = True  # run without --only


@dataclasses.dataclass
class PartResult:
    name: str
    status: str  # passed, failed, not run, timed out
    seconds: float
    budget_s: float
    returncode: Optional[int]
    log: Optional[str]
    note: str = ""
    tests: dict[str, int] = dataclasses.field(default_factory=dict)
    failing: list[str] = dataclasses.field(default_factory=list)
    running_when_cut: list[str] = dataclasses.field(default_factory=list)
    not_reached: Optional[int] = None
    not_run_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    tail: list[str] = dataclasses.field(default_factory=list)


def _pytest(paths: Sequence[str], *, parallel: bool) -> tuple[str, ...]:
    argv = [sys.executable, "-m", "pytest", *paths, "-m", "gpu", "-v", "-p", "no:cacheprovider"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={TEST_TIMEOUT_S}")
    if parallel and importlib.util.find_spec("xdist") is not None:
        argv += ["-n", str(XDIST_WORKERS)]
        # worksteal came with pytest-xdist 3.2; a node's older xdist would refuse the flag (and
        # kept at any version, it is the node's own): there the workers take tests as load hands them.
        argv += ["--dist", "worksteal", "-p", SLOW_FIRST] if _has_worksteal() else ["--dist", "load"]
    return tuple(argv)


def _has_worksteal() -> bool:
    try:
        version = importlib.metadata.version("pytest-xdist")
    except importlib.metadata.PackageNotFoundError:
        return False
    major_minor = tuple(int(n) for n in re.findall(r"\d+", version)[:2])
    return major_minor >= WORKSTEAL_SINCE


def default_parts() -> list[Part]:
    bench = ROOT / "bench"
    py = sys.executable
    return [
        # Budgets against each part's time on one H200 at 9e77f89 (bench/results/gpu-check-h200/,
        # bench/results/*-nvidia-h200.json); with a grace each they add up to TIME_BOX_S:
        #   55 + 95 + 28 + 25 + 135 + 112 = 450 s, + 6 x 5 s of grace = 480 s.
        # timing: 49.5 s (rerun.log: the survivor's abort 40.5 s, the stall 5.5 s).
        Part("timing", _pytest(TIMING_TESTS, parallel=False), 55, pytest=True),
        # tests: 119 s on four workers (rerun.log), of which the four snapshot round trips took
        # 47-49 s each, two of them one after the other on one worker. Led by them
        # (tests/gpu/slow_first.py) a worker needs one of them plus a quarter of the other
        # tests' 63 s (gpu-check-h100/tests.jsonl): about 70 s with the workers' start.
        Part("tests", _pytest(["tests/gpu", *(f"--ignore={t}" for t in TIMING_TESTS)], parallel=True), 95,
             pytest=True),
        # attention: 37 s for 16K-128K tokens on rings of 2-8, of which 128K took about half
        # (0.9 s a monolithic forward+backward, x 7 calls, and the rings' ranks after it); short
        # blocks only: 4K-64K, where each size takes milliseconds, about 22 s with the start.
        Part("attention", (py, str(bench / "attention.py"), "--seq", "4096", "8192", "16384", "32768", "65536"),
             28),
        # launches: 19 s at its three default sizes (attention_launches-nvidia-h200.json), + 6 s.
        Part("launches", (py, str(bench / "attention_launches.py")), 25),
        # train: the Trainer on both shapes (MFU: 29.8 s and 30.8 s) and with a snapshot every
        # step (54.1 s), train-nvidia-h200.json's variants, 115 s, + 4 s of the bench's start, and
        # TinyLlama's two steps under torch.profiler, with and without snapshots (a few s each).
        # Its plain and hf variants (92.6 s) are train_baselines', outside the box.
        # Cut by SIGINT, the bench still writes what it measured.
        # The snapshot variant runs first: a cut then costs the Qwen3 shape's Trainer alone, which
        # train_baselines measures again, not the TinyLlama snapshot measured nowhere else.
        Part("train", (py, str(bench / "train.py"), "--check", "--variants", "trainer_snapshots,trainer",
                       "--snapshot-every", "1"), 135),
        # max_context: a 26 GB cap with no host memory to offload to leaves a 1B model's states a
        # few GB of activations (the planner's max 40-45K tokens for ringtrain, 3.8K for
        # transformers, steps under 3 s), no headroom so that the planner's memory model alone is
        # held to the measured max; two tries a search at the 10% tolerance's edges decide the
        # prediction. A try spends about 15 s (transformers) and 23 s (the Trainer) outside its
        # steps (train-nvidia-h200.json): the GPU's probe (~6 s), 2 x 16.2 s (transformers, their
        # steps included) and the Trainer's 23 s + 2 steps at 44.5K and at 49.7K tokens, each
        # step 20% over the planner's 2.37 s and 2.79 s (the first step compiles), add up to
        # 96.8 s: --budget-s 100, past which the bench starts no try; 12 s for its own start
        # (imports) and JSON. The 8B's states exceed the cap (and, offloaded, the H200 node's
        # 128 GiB host): its searches end at the planner's word, without a try.
        Part("max_context", (py, str(bench / "max_context.py"), "--shapes", "llama3.2-1b,llama3-8b",
                             "--memory-gb", "26", "--host-memory-gb", "0", "--headroom", "0", "--granule", "512",
                             "--max-tries", "2", "--tolerance-edges", "--budget-s", "100", "--try-timeout", "60"),
             112),
        # train_baselines: the Trainer, plain PyTorch and transformers on both shapes, 153 s in
        # train-nvidia-h200.json (+ the bench's start), and the Qwen3 shape's snapshot variant
        # (about 70 s: its Trainer's 31 s, four 20.65 GB host buffers page-locked at its first
        # snapshot, about 33 s at the 2.5 GB/s TinyLlama's took on the H100, and its two
        # profiled steps): 227 s.
        # Its own JSON (--name), so that the train part's, the TinyLlama snapshot's profile in it, stays.
        Part("train_baselines", (py, str(bench / "train.py"), "--check", "--variants", "trainer,trainer_snapshots,plain,hf",
                                 "--snapshot-shapes", "qwen3", "--name", "train-baselines"), 250, default=False),
        Part("nccl_abort", (py, str(bench / "nccl_abort.py")), 90, needs=bench / "nccl_abort.py",
             default=False),
    ]


# -- running a part -----------------------------------------------------------------------


def _stream(source: IO[bytes], log: IO[str], name: str, tail: collections.deque[str]) -> None:
    for raw in iter(source.readline, b""):
        text = raw.decode("utf-8", "replace")
        try:
            log.write(text)
            log.flush()
        except ValueError:  # closed: a process that left the part's group still holds its output
            return
        sys.stdout.write(f"[{name}] {text}" if text.endswith("\n") else f"[{name}] {text}\n")
        sys.stdout.flush()
        tail.append(text.rstrip("\n"))


def _sigint_as_default() -> None:
    """In a part's process, before it runs the part: SIGINT back to its default. A shell starts a
    background job (``nohup make gpu-check &``) with SIGINT ignored, and every process the job
    starts inherits that: the budget's SIGINT would stop no part, and pytest would not say where
    it was."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def run_part(part: Part, log_dir: Path, env: dict[str, str], grace_s: float = GRACE_S) -> PartResult:
    """Run ``part`` within its budget (then ``grace_s`` to stop), its output streamed to
    ``<log_dir>/<name>.log`` and stdout."""
    if part.needs is not None and not part.needs.exists():
        return PartResult(part.name, "not run", 0.0, part.budget_s, None, None,
                          note=f"{os.path.relpath(part.needs, ROOT)} is not in this checkout")
    log_path = log_dir / f"{part.name}.log"
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    print(f"== {part.name}: {' '.join(part.argv)} (budget {part.budget_s:g} s)", flush=True)
    start = time.monotonic()
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(part.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=_sigint_as_default)
        assert proc.stdout is not None
        reader = threading.Thread(target=_stream, args=(proc.stdout, log, part.name, tail), daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=part.budget_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _signal_group(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        seconds = time.monotonic() - start
        _signal_group(proc.pid, signal.SIGKILL)  # whatever the part left behind
        proc.wait()
        reader.join(timeout=grace_s)
        if timed_out:
            log.write(f"\n[gpu_check] cut at its budget of {part.budget_s:g} s\n")
    if timed_out:
        status = "timed out"
    else:
        status = "passed" if proc.returncode == 0 else "failed"
    return PartResult(part.name, status, seconds, part.budget_s, proc.returncode, str(log_path), tail=list(tail))


# -- the tests' log -------------------------------------------------------------------------


def read_records(path: Path, offset: int) -> list[dict[str, Any]]:
    """The JSON lines of ``path`` from byte ``offset`` on (a torn last line is left out)."""
    if not path.exists():
        return []
    with open(path, "rb") as f:
        f.seek(offset)
        lines = f.read().splitlines()
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return records


def add_test_outcomes(result: PartResult, records: list[dict[str, Any]]) -> None:
    """Fill ``result``'s test counts from the records its pytest run wrote."""
    counts: collections.Counter[str] = collections.Counter()
    reasons: collections.Counter[str] = collections.Counter()
    started: dict[str, None] = {}
    settled: set[str] = set()
    collected = 0
    for record in records:
        event = record.get("event")
        if event == "collected":
            collected += int(record.get("count", 0))
        elif event == "start":
            started[record["nodeid"]] = None
        elif event == "outcome":
            nodeid, outcome = record["nodeid"], record["outcome"]
            counts[outcome] += 1
            settled.add(nodeid)
            if outcome in ("failed", "error") and nodeid not in result.failing:
                result.failing.append(nodeid)
            if outcome == "not run":
                reasons[record.get("reason", "")] += 1
    result.tests = dict(counts)
    result.not_run_reasons = dict(reasons.most_common())
    if result.status == "timed out":
        result.running_when_cut = [nodeid for nodeid in started if nodeid not in settled]
        result.not_reached = max(0, collected - len(settled) - len(result.running_when_cut)) if collected else None
    elif result.status == "passed" and not counts.get("passed") and counts.get("not run"):
        result.status = "not run"  # every test skipped: nothing was checked
    elif result.status == "failed" and result.returncode == 5:
        result.status = "not run"
        result.note = "no tests collected"


# -- the run ----------------------------------------------------------------------------------


def _probe(argv: list[str]) -> Optional[str]:
    try:
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def run_all(parts: Sequence[Part], log_dir: Path) -> dict[str, Any]:
    """Run ``parts`` in order; the summary (also written to ``<log_dir>/summary.json``)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    tests_log = log_dir / TESTS_LOG
    # The parts import ringtrain from this checkout, run by make or not.
    path = os.pathsep.join(p for p in (str(ROOT / "platform"), os.environ.get("PYTHONPATH", "")) if p)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, LOG_ENV: str(tests_log.resolve())}
    started_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    start = time.monotonic()
    results = []
    for part in parts:
        offset = tests_log.stat().st_size if tests_log.exists() else 0
        result = run_part(part, log_dir, env)
        if part.pytest and result.status != "not run":
            add_test_outcomes(result, read_records(tests_log, offset))
        results.append(result)
        print(f"== {part.name}: {result.status} in {result.seconds:.1f} s", flush=True)
    summary = {
        "device": _probe(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]),
        "commit": _probe(["git", "rev-parse", "HEAD"]),
        "started_utc": started_utc,
        "wall_s": round(time.monotonic() - start, 1),
        "log_dir": str(log_dir),
        "tests_log": str(tests_log),
        "ok": all(r.status in ("passed", "not run") for r in results),
        "parts": [dataclasses.asdict(r) for r in results],
    }
    (log_dir / SUMMARY).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def render(summary: dict[str, Any]) -> str:
    """The summary screen."""
    lines = [f"GPU tier on {summary['device'] or 'an unnamed device'} at {(summary['commit'] or 'no commit')[:12]}: "
             f"{'OK' if summary['ok'] else 'NOT OK'} in {summary['wall_s']:.0f} s; logs in {summary['log_dir']}"]
    lines.append(f"  {'part':<12}{'status':<11}{'seconds':>8}{'budget':>8}  tests")
    for part in summary["parts"]:
        counted = sorted(part["tests"].items(), key=lambda item: OUTCOMES.index(item[0]) if item[0] in OUTCOMES else 99)
        tests = ", ".join(f"{n} {outcome}" for outcome, n in counted)
        if part["not_reached"]:
            tests += f", {part['not_reached']} not reached"
        lines.append(f"  {part['name']:<12}{part['status']:<11}{part['seconds']:>8.1f}{part['budget_s']:>8.0f}  "
                     f"{tests or part['note']}")
    for part in summary["parts"]:
        if part["failing"]:
            lines.append(f"{part['name']}: failed (tracebacks in {summary['tests_log']}):")
            lines += [f"  {nodeid}" for nodeid in part["failing"]]
        if part["running_when_cut"]:
            lines.append(f"{part['name']}: running when cut at {part['budget_s']:g} s:")
            lines += [f"  {nodeid}" for nodeid in part["running_when_cut"]]
        if part["status"] in ("failed", "timed out") and not part["failing"] and part["tail"]:
            lines.append(f"{part['name']}: {part['status']} (exit {part['returncode']}); "
                         f"its last lines ({part['log']}):")
            lines += [f"  | {line}" for line in part["tail"]]
        for reason, n in part["not_run_reasons"].items():
            lines.append(f"{part['name']}: {n} not run: {reason.removeprefix('not run: ')}")
    return "\n".join(lines)


# -- requirements this Python lacks ------------------------------------------------------------

_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:==\s*([^\s;]+))?")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def missing_requirements(path: Path) -> tuple[list[str], list[str]]:
    """The requirement lines of ``path`` whose distribution is not installed, and a note for each
    one installed at another version than its pin (kept: a node's own stack is deliberate)."""
    installed: dict[str, str] = {}
    for dist in importlib.metadata.distributions():  # sys.path order: the first found is the one imported
        name = dist.metadata["Name"]
        if name:
            installed.setdefault(_canonical(name), dist.version)
    missing, notes = [], []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        requirement = line.split("#", 1)[0].strip()
        if not requirement:
            continue
        parsed = _REQUIREMENT.match(requirement)
        if parsed is None:
            raise ValueError(f"{path}:{number}: not a requirement: {requirement!r}")
        name, pin = parsed.groups()
        have = installed.get(_canonical(name))
        if have is None:
            missing.append(requirement)
        elif pin is not None and have != pin:
            notes.append(f"{name} {have} is installed (pinned {pin}): kept")
    return missing, notes


# -- command line ------------------------------------------------------------------------------


class BadInput(Exception):
    pass


def parse_budgets(values: Sequence[str], names: Sequence[str]) -> dict[str, float]:
    budgets: dict[str, float] = {}
    for item in (piece for value in values for piece in value.split(",") if piece):
        name, sep, seconds = item.partition("=")
        if not sep or name not in names:
            raise BadInput(f"--budget {item}: expected part=seconds with a part among {', '.join(names)}")
        try:
            budgets[name] = float(seconds)
        except ValueError:
            raise BadInput(f"--budget {item}: {seconds!r} is not a number of seconds") from None
        if budgets[name] <= 0:
            raise BadInput(f"--budget {item}: the budget must be positive")
    return budgets


def select_parts(parts: list[Part], only: Optional[str], budgets: dict[str, float]) -> list[Part]:
    names = [p.name for p in parts]
    chosen = [p.name for p in parts if p.default]
    if only is not None:
        chosen = [name for name in only.split(",") if name]
        unknown = [name for name in chosen if name not in names]
        if unknown or not chosen:
            raise BadInput(f"--only {only}: no part named {', '.join(unknown) or '(none given)'}; "
                           f"parts: {', '.join(names)}")
    return [dataclasses.replace(p, budget_s=budgets.get(p.name, p.budget_s)) for p in parts if p.name in chosen]


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=" ".join((__doc__ or "").split("\n\n", 1)[0].split()))
    p.add_argument("--log-dir", type=Path, default=None, help="default: runs/gpu-check-<UTC time>/")
    p.add_argument("--only", default=None, help="comma-separated parts to run, in their order")
    p.add_argument("--budget", action="append", default=[], help="part=seconds (repeatable, or comma-separated)")
    p.add_argument("--missing", type=Path, default=None, metavar="REQUIREMENTS",
                   help="print the lines of REQUIREMENTS this Python lacks, and exit")
    return p.parse_args(argv)


def main(argv: Sequence[str]) -> int:
    args = parse_args(argv)
    try:
        if args.missing is not None:
            if not args.missing.is_file():
                raise BadInput(f"--missing {args.missing}: no such file")
            try:
                missing, notes = missing_requirements(args.missing)
            except ValueError as err:
                raise BadInput(str(err)) from None
            for note in notes:
                print(note, file=sys.stderr)
            print("\n".join(missing))
            return 0
        parts = default_parts()
        parts = select_parts(parts, args.only, parse_budgets(args.budget, [p.name for p in parts]))
    except BadInput as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d-%H%M%S")
    log_dir = args.log_dir or ROOT / "runs" / f"gpu-check-{stamp}"
    boxed = sum(p.budget_s + GRACE_S for p in parts)
    left = [p.name for p in default_parts() if p.name not in {c.name for c in parts}]
    print(f"gpu_check: {', '.join(f'{p.name} {p.budget_s:g} s' for p in parts)}: at most {boxed:.0f} s "
          f"({'within' if boxed <= TIME_BOX_S else 'over'} the {TIME_BOX_S:.0f} s box); logs in {log_dir}"
          + (f"; not run: {', '.join(left)} (--only names parts)" if left else ""), flush=True)
    summary = run_all(parts, log_dir)
    print("\n" + render(summary), flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
