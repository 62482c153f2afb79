"""Benchmark: what the collective recorder and the SDC probes cost a training step.

Four ranks (dp=2 x cp=2, ZeRO-2 by default) train the quickstart model (jobs/quickstart.yaml:
dim 128, 4 layers, 4 heads, 2 KV heads, seq 2048, global batch 4) through ringtrain's Trainer in
spawned processes (FileStore rendezvous), as bench/checkpoint.py does.

- Recorder overhead: in the same processes, blocks of steps with the recorder installed
  alternate with blocks without it (``probes.uninstall()`` restores torch.distributed and
  DeepSpeed's cached functions), in an on/off/off/on order so a linear drift weighs on both
  alike. A step's time is the wall time of ``train_step()``, maximum over ranks (they meet in
  collectives every step). Also reported: the median of neighbouring on/off block ratios
  (robust to bursts of outside load) and the CPU time of a step summed over ranks.
- SDC probes: the wall time of one probe round (GEMM, attention block, all-reduce; maximum over
  ranks, since the all-reduce makes them meet), as a fraction of the steps between rounds at a
  cadence of one round every ``--sdc-every`` steps.
- Recorder cost per call: small all-reduces on a one-rank group, recorded and not (fastest of
  five runs each); times the calls per step, over the step time, it gives the ratio the wall
  clock cannot resolve on a shared machine.
- Diagnostics: the time ``recorder.diagnostics()`` takes with a full buffer (what a hang
  report costs a rank, off the training thread).
- SDC false alarms: ``--clean-rounds`` probe rounds on healthy devices, judged round by round
  by the SdcScanner as the Controller judges them; every alarm would be a false one.
- SDC detection latency: with scans every ``--latency-every`` steps, the last rank's device goes
  bad (its probes show a flipped bit, as chaos ``bitflip`` makes them) at each step between two
  scans in turn; measured from the start of the bad step to the verdict naming the rank. At the
  default cadence it follows from the step and round times: the verdict comes with the first
  scan after the bad step, at most ``--sdc-every`` steps later.

Targets: recorder <= 1.01x step time; probes <= 1% of step time at the default cadence.

    PYTHONPATH=platform python bench/probes.py [--blocks 12] [--steps 4] [--sdc-every 100]

Writes bench/results/probes-<cpu|cuda>.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TARGET_RECORDER, TARGET_SDC = 1.01, 0.01
sys.path.insert(0, str(ROOT / "bench"))
from checkpoint import children_cpu_s, machine_busy_s, schedule, use_cuda  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, default=2, help="ZeRO stage (0-3)")
    p.add_argument("--blocks", type=int, default=12, help="timed blocks, half with the recorder on")
    p.add_argument("--steps", type=int, default=4, help="steps per block")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per mode before the blocks")
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--dp", type=int, default=2)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--sdc-every", type=int, default=100, help="steps between SDC probe rounds")
    p.add_argument("--sdc-rounds", type=int, default=10, help="timed probe rounds (median reported)")
    p.add_argument("--calls", type=int, default=2000, help="calls per run of the per-call cost measurement")
    p.add_argument("--latency-every", type=int, default=4, help="scan cadence of the detection-latency trials")
    p.add_argument("--clean-rounds", type=int, default=2000, help="probe rounds of the false-alarm run")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=None, help="default: bench/results/probes-<device>.json")
    args = p.parse_args(argv)
    if args.blocks < 2 or args.steps < 1 or args.sdc_every < 1:
        p.error("--blocks must be >= 2, --steps and --sdc-every >= 1")
    return args


def overrides(args: argparse.Namespace) -> list[str]:
    total = 2 * args.warmup + args.blocks * args.steps + args.latency_every**2 + 8
    return [
        "model.vocab_size=256", f"model.dim={args.dim}", f"model.n_layers={args.layers}", "model.n_heads=4",
        "model.n_kv_heads=2", f"data.seq_len={args.seq_len}", f"mesh.dp={args.dp}", f"mesh.cp={args.cp}",
        "attention.impl=ring", f"zero.stage={args.stage}", "train.global_batch=4", "train.micro_batch=1",
        "train.lr=3e-3", f"train.warmup_steps={min(15, total // 4)}", f"train.steps={total}",
        "checkpoint.snapshot_every=0", "checkpoint.persist_every=0",
    ]


def _rank_main(rank: int, world: int, rendezvous: str, args: argparse.Namespace, results: Any) -> None:
    import logging

    import torch
    import torch.distributed as dist

    from ringtrain import config
    from ringtrain.train.trainer import set_rank_env

    torch.set_num_threads(1)
    cuda = use_cuda(world)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(ROOT / ".ringtrain-cache" / "torch_extensions"))
    set_rank_env(rank=rank, world_size=world, device=device)
    dist.init_process_group("nccl" if cuda else "gloo", store=dist.FileStore(rendezvous, world), rank=rank,
                            world_size=world)
    try:
        from deepspeed.utils import logger as ds_logger

        ds_logger.setLevel(logging.WARNING)
        out = _measure(config.load(None, overrides(args)), rank, device, args)
        gathered: list[Any] = [None] * world if rank == 0 else []
        dist.gather_object(out, gathered if rank == 0 else None, dst=0)
        if rank == 0:
            results.put(gathered)
    except BaseException as exc:  # surface the rank's failure instead of a queue timeout
        results.put(exc)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _measure(job: Any, rank: int, device: Any, args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from ringtrain.train import probes, sdc_probes
    from ringtrain.train.trainer import Trainer

    probes.install()  # before the engine, as a worker does
    trainer = Trainer(job, rank=rank, device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def timed_step() -> tuple[float, float]:
        sync()
        t0, cpu0 = time.perf_counter(), time.process_time()
        trainer.train_step()
        sync()
        return time.perf_counter() - t0, time.process_time() - cpu0

    def set_mode(on: bool) -> None:
        if on:
            probes.install()
        else:
            probes.uninstall()

    for on in (True, False):
        set_mode(on)
        for _ in range(args.warmup):
            timed_step()
    steps: list[dict[str, Any]] = []
    calls_per_step = 0
    for block, on in enumerate(schedule(args.blocks)):
        set_mode(on)
        for _ in range(args.steps):
            before = probes.active().state()["num_issued"] if on else 0  # type: ignore[union-attr]
            wall, cpu = timed_step()
            if on:
                calls_per_step = probes.active().state()["num_issued"] - before  # type: ignore[union-attr]
            steps.append({"block": block, "on": on, "wall_s": wall, "cpu_s": cpu})

    # The recorder's own cost per call, away from the step's noise: the fastest of several runs of
    # small all-reduces on this rank's one-rank group, recorded and not.
    tiny = torch.zeros(1, device=device)
    fastest = {True: float("inf"), False: float("inf")}
    for _ in range(5):
        for on in (True, False):
            set_mode(on)
            sync()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                dist.all_reduce(tiny, group=trainer.mesh.self_group)
            sync()
            fastest[on] = min(fastest[on], (time.perf_counter() - t0) / args.calls)

    recorder = probes.install()
    sdc: list[float] = []
    for _ in range(args.sdc_rounds + 1):  # the first round fills the input caches
        sync()
        t0 = time.perf_counter()
        sdc_probes.run_probes(device)
        sync()
        sdc.append(time.perf_counter() - t0)
    # Fill the buffer with small all-reduces for the diagnostics timing (the same count on every
    # rank: they all issued the same calls so far).
    filler = torch.zeros(1, device=device)
    for _ in range(recorder.capacity - recorder.state()["num_issued"]):
        dist.all_reduce(filler)
    t0 = time.perf_counter()
    report = recorder.diagnostics()
    diagnostics_s = time.perf_counter() - t0
    probes.uninstall()
    clean = [sdc_probes.digests(sdc_probes.run_probes(device, kernel=job.attention.kernel)) for _ in range(args.clean_rounds)]
    latency = _detection_latency(trainer, rank, device, every=args.latency_every)
    return {"rank": rank, "steps": steps, "sdc_s": sdc[1:], "calls_per_step": calls_per_step,
            "per_call_s": fastest[True] - fastest[False],
            "diagnostics_s": diagnostics_s, "diagnostics_bytes": len(json.dumps(report)), "latency": latency,
            "clean_rounds": clean}


def _detection_latency(trainer: Any, rank: int, device: Any, *, every: int) -> list[dict[str, Any]]:
    """Scan every ``every`` steps as the Controller does (each rank's digests gathered, judged by
    the SdcScanner); in trial k the last rank's device goes bad at the k-th step after a scan.
    Returns per trial the steps and seconds from the bad step's start to the verdict."""
    import torch
    import torch.distributed as dist

    from ringtrain.chaos import FaultSpec
    from ringtrain.controllers.sdc import SdcScanner

    world = dist.get_world_size()
    scanner = SdcScanner()

    def scan(step: int) -> Any:
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, trainer.probe_round())
        return scanner.check(step, dict(enumerate(everyone)))

    assert scan(0) is None, "the baseline round disagrees"
    trials = []
    for offset in range(1, every + 1):
        bad_since = 0.0
        for k in range(1, every + 1):
            if k == offset:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                bad_since = time.perf_counter()
                if rank == world - 1:
                    trainer.bad_device = FaultSpec(kind="bitflip", rank=rank)
            trainer.train_step()
        verdict = scan(trainer.step)
        trials.append({"bad_step_offset": offset, "steps": every - offset + 1,
                       "seconds": time.perf_counter() - bad_since,
                       "named": list(verdict.ranks) if verdict is not None else []})
        trainer.bad_device = None  # the next trial starts on a healthy device
    return trials


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    world = args.dp * args.cp
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory(prefix="ringtrain-bench-probes-") as tmp:
        procs = [ctx.Process(target=_rank_main, args=(r, world, str(Path(tmp) / "rendezvous"), args, results))
                 for r in range(world)]
        for p in procs:
            p.start()
        try:
            got = results.get(timeout=args.timeout)
        except queue.Empty:
            got = RuntimeError(f"no result from the ranks within {args.timeout} s")
        finally:
            for p in procs:
                p.join(timeout=60)
                if p.is_alive():
                    p.kill()
    if isinstance(got, BaseException):
        raise got
    return sorted(got, key=lambda r: r["rank"])


def summarize(ranks: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    num_steps = len(ranks[0]["steps"])
    rows = [{"on": ranks[0]["steps"][i]["on"], "block": ranks[0]["steps"][i]["block"],
             "wall_s": max(r["steps"][i]["wall_s"] for r in ranks), "cpu_s": sum(r["steps"][i]["cpu_s"] for r in ranks)}
            for i in range(num_steps)]
    modes = {}
    for name, on in (("on", True), ("off", False)):
        walls = [row["wall_s"] for row in rows if row["on"] == on]
        modes[name] = {"num_steps": len(walls), "mean_s": statistics.fmean(walls), "median_s": statistics.median(walls),
                       "cpu_mean_s": statistics.fmean(row["cpu_s"] for row in rows if row["on"] == on)}
    blocks: dict[int, tuple[bool, list[float]]] = {}
    for row in rows:
        blocks.setdefault(row["block"], (row["on"], []))[1].append(row["wall_s"])
    means = [(on, statistics.fmean(walls)) for _, (on, walls) in sorted(blocks.items())]
    # Neighbouring blocks share the machine's load of the moment; their ratio cancels it.
    pairs = [(a / b) if a_on else (b / a) for (a_on, a), (b_on, b) in zip(means[0::2], means[1::2]) if a_on != b_on]
    sdc_round = statistics.median(max(r["sdc_s"][i] for r in ranks) for i in range(len(ranks[0]["sdc_s"])))
    step_s = modes["off"]["median_s"]
    per_call = statistics.median(r["per_call_s"] for r in ranks)
    return {
        # Calls per step times the recorder's cost per call: what the step ratio is made of,
        # measured where outside load cannot hide it.
        "recorder_ratio_from_per_call_cost": 1 + ranks[0]["calls_per_step"] * per_call / step_s,
        "recorder_per_call_s": per_call,
        "recorder_ratio_mean": modes["on"]["mean_s"] / modes["off"]["mean_s"],
        "recorder_ratio_median": modes["on"]["median_s"] / modes["off"]["median_s"],
        "recorder_ratio_paired_blocks": statistics.median(pairs) if pairs else None,
        "recorder_ratio_cpu": modes["on"]["cpu_mean_s"] / modes["off"]["cpu_mean_s"],
        "collectives_per_step": ranks[0]["calls_per_step"],
        "step_time": modes,
        "sdc_round_s": sdc_round,
        "sdc_round_over_step": sdc_round / step_s,
        "sdc_overhead_at_cadence": sdc_round / (args.sdc_every * step_s),
        "sdc_every": args.sdc_every,
        "diagnostics_s_max": max(r["diagnostics_s"] for r in ranks),
        "diagnostics_bytes": ranks[0]["diagnostics_bytes"],
        "false_alarms": _false_alarms(ranks),
        "detection": _detection_summary(ranks, args, step_s=step_s, round_s=sdc_round),
    }


def _false_alarms(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    from ringtrain.controllers.sdc import SdcScanner

    scanner = SdcScanner()
    rounds = len(ranks[0]["clean_rounds"])
    alarms = [v.explanation for i in range(rounds) if (v := scanner.check(i, {r["rank"]: r["clean_rounds"][i] for r in ranks}))]
    return {"rounds": rounds, "ranks": len(ranks), "alarms": len(alarms), "first": alarms[:3]}


def _detection_summary(ranks: list[dict[str, Any]], args: argparse.Namespace, *, step_s: float, round_s: float) -> dict[str, Any]:
    trials = [{**t, "seconds": max(r["latency"][i]["seconds"] for r in ranks)} for i, t in enumerate(ranks[0]["latency"])]
    bad = len(ranks) - 1
    every = args.sdc_every
    return {
        "measured_every": args.latency_every,
        "trials": trials,
        "all_named": all(t["named"] == [bad] for t in trials),
        "max_steps": max(t["steps"] for t in trials),
        "mean_s": statistics.fmean(t["seconds"] for t in trials),
        "max_s": max(t["seconds"] for t in trials),
        # At the default cadence: the bad step is equally likely to be any of the ``every``.
        "at_default_cadence": {"sdc_every": every, "max_steps": every, "mean_s": (every + 1) / 2 * step_s + round_s,
                               "max_s": every * step_s + round_s},
    }


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    import torch

    world = args.dp * args.cp
    device = "cuda" if use_cuda(world) else "cpu"
    started = time.perf_counter()
    busy0, ours0, wall0 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    ranks = run(args)
    busy1, ours1, wall1 = machine_busy_s(), children_cpu_s(), time.perf_counter()
    outside = None
    if busy0 is not None and busy1 is not None:
        outside = max(0.0, (busy1 - busy0) - (ours1 - ours0)) / ((wall1 - wall0) * (os.cpu_count() or 1))
    s = summarize(ranks, args)
    on, off = s["step_time"]["on"], s["step_time"]["off"]
    paired = s["recorder_ratio_paired_blocks"]
    print(f"step: recorder on {on['mean_s']:.4f} s mean ({on['median_s']:.4f} median), "
          f"off {off['mean_s']:.4f} s ({off['median_s']:.4f}); {s['collectives_per_step']} collectives per step")
    print(f"recorder overhead: {s['recorder_ratio_mean']:.3f}x (median {s['recorder_ratio_median']:.3f}x, "
          f"paired blocks {'n/a' if paired is None else f'{paired:.3f}x'}, CPU time {s['recorder_ratio_cpu']:.3f}x; "
          f"target <= {TARGET_RECORDER})")
    print(f"recorder cost per call: {s['recorder_per_call_s'] * 1e6:.1f} us x {s['collectives_per_step']} calls "
          f"= {s['recorder_ratio_from_per_call_cost']:.5f}x step time")
    print(f"SDC probe round: {s['sdc_round_s'] * 1e3:.1f} ms = {s['sdc_round_over_step']:.2%} of a step; every "
          f"{args.sdc_every} steps: {s['sdc_overhead_at_cadence']:.3%} (target <= {TARGET_SDC:.0%})")
    print(f"diagnostics() with a full buffer: {s['diagnostics_s_max'] * 1e3:.1f} ms, "
          f"{s['diagnostics_bytes'] / 1e6:.2f} MB")
    f = s["false_alarms"]
    print(f"SDC false alarms: {f['alarms']} in {f['rounds']} clean probe rounds on {f['ranks']} ranks")
    d = s["detection"]
    print(f"SDC detection, scans every {d['measured_every']} steps: {'every' if d['all_named'] else 'NOT every'} "
          f"bad rank named, within {d['max_steps']} steps; {d['mean_s']:.2f} s mean, {d['max_s']:.2f} s max from the "
          f"bad step's start; every {args.sdc_every} steps: {d['at_default_cadence']['mean_s']:.1f} s mean, "
          f"{d['at_default_cadence']['max_s']:.1f} s max")
    if outside is not None:
        print(f"other processes used {outside:.0%} of the machine's {os.cpu_count()} CPUs during the run")
    record = {
        "bench": "probes",
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if device == "cuda"
        else f"cpu {platform.processor() or platform.machine()}",
        "device_type": device, "torch": torch.__version__, "python": platform.python_version(),
        "config": {"world_size": world, "dp": args.dp, "cp": args.cp, "zero_stage": args.stage, "dim": args.dim,
                   "n_layers": args.layers, "seq_len": args.seq_len, "blocks": args.blocks,
                   "steps_per_block": args.steps, "sdc_rounds": args.sdc_rounds, "clean_rounds": args.clean_rounds,
                   "threads_per_rank": 1},
        "targets": {"recorder_ratio": TARGET_RECORDER, "sdc_overhead_at_cadence": TARGET_SDC},
        "machine_load": {"outside_cpu_fraction": outside, "num_cpus": os.cpu_count(), "num_ranks": world},
        **s,
        "wall_s": round(time.perf_counter() - started, 1),
    }
    out = args.out or ROOT / "bench" / "results" / f"probes-{device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {out.relative_to(ROOT) if out.is_relative_to(ROOT) else out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
