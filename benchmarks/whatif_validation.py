"""Validate the schedule what-if against real runs of the demo on this machine.

1. Async: predict the throughput (samples/s) of ``dynascope demo --async`` (2 Ray rollout actors, 1 trainer
   actor, staleness bound 2, stale batches dropped) from a synchronous run with the same model and settings
   (``schedule_what_if``'s ``async`` row), then run it and compare (goal: within 20 %).
2. Slow rank: predict from ``--ranks 4 --slow-rank 2 --slow-factor 3`` the step time without the slow rank
   (``what_if_shared(ranks=[2])`` over the RL steps: the four ranks share the cores; ``plain`` is
   ``what_if_steps``, a device per rank; ``saved``: the slow-rank run's measured step less the replay's
   saving), then run ``--ranks 4`` and compare its wall-clock time per RL step (goal: within 15 %).
3. Calibration: the ``sync`` replay against the measured step time of the synchronous and 4-rank runs
   (goal: within 5 %).

The synchronous run copies weights within one process; the Ray run publishes each version to the object
store and every worker loads it from there. Each round therefore also measures that transport on its own
(``transport``: the demo's ``publish_weights`` in one Ray actor and ``load_weights`` in another, the
policy's own model, 30 times), and the async prediction is reported with it as ``publish_ms``/``load_ms``
as well: the cost a user would measure for the transport a schedule is to use.

The replay shares the cores ideally; real time slicing of more processes than cores loses some of their
capacity (each switch, and the caches refilled after it). Each round measures that too (``timeslice``: one
of the demo's processes alone against n of them at once, n = the async run's processes and the 4-rank
runs' ranks, alternating 3 times), and the predictions are also reported with it as
``timeslice_efficiency``.

Devices: the demo's processes share this machine's cores (one torch thread each), so the model gets
``devices`` = the cores, and the other runnable threads on the machine while each run's RL steps ran
(other users, Ray's own daemons, the threads beside each demo process's compute thread: the probe's
writer and resolver, Ray's) as ``background``: a sampler reads /proc every 0.25 s and counts runnable
threads other than the demo processes' main threads. Predictions are reported with and without that load.

    python benchmarks/whatif_validation.py --quick --rounds 3 --dir /tmp/whatif
    python benchmarks/whatif_validation.py --reuse --dir /tmp/whatif     # re-evaluate stored runs

``--snapshot REV`` runs the demo from ``git archive REV``, so that edits in the working tree cannot break a run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import polars as pl

REPO = Path(__file__).resolve().parents[1]
VARIANTS = {"sync": [], "async": ["--async"], "slow": ["--ranks", "4", "--slow-rank", "2", "--slow-factor", "3"],
            "even": ["--ranks", "4"], "even2": ["--ranks", "4"]}
# The target of the slow-rank check is run twice (before and after the slow-rank run in a round): on this
# machine the same 4-rank run's step time differs by up to ~15% from one run to the next (the slow-rank run
# by ~1%), so one target run cannot tell a 15% error from the target's own spread.
TARGETS = ("even", "even2")
OURS = ("dynascope", "distributed.py", "ray::Trainer", "ray::RolloutWorker")


def is_ours(cmd: str) -> bool:
    """Whether a process (by its command line) is one of the demo's modelled devices: a trainer rank or a
    rollout actor. The driver of an ``--async`` run is not: it starts Ray, hands batches from the actors
    to the trainer and prints the report, CPU the model places on no device, so it counts as background."""
    if "whatif_validation" in cmd or (" demo " in f" {cmd} " and "--async" in cmd.split()):
        return False
    return any(k in cmd for k in OURS)


def tally(pid: str, cmd: str, states: dict[str, str]) -> tuple[int, int]:
    """(runnable threads, runnable compute threads) of one process from its threads' states (thread id ->
    /proc state letter). A demo process computes on its main thread (one torch thread; a Ray actor runs its
    methods there too); its other runnable threads (the probe's writer and resolver, Ray's own) are load on
    the cores like any other process's, so they are not compute threads."""
    runnable = sum(st == "R" for st in states.values())
    return runnable, int(states.get(pid) == "R" and is_ours(cmd))


def _runnable_threads() -> tuple[int, int]:
    """(all runnable threads on the machine, the demo's runnable compute threads), from /proc."""
    total = ours = 0
    me = os.getpid()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == me:
            continue
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            states = {t: Path(f"/proc/{pid}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()[0]
                      for t in os.listdir(f"/proc/{pid}/task")}
        except OSError:
            continue
        r, o = tally(pid, cmd, states)
        total, ours = total + r, ours + o
    return total, ours


class LoadSampler(threading.Thread):
    """Samples (wall-clock µs, background runnable threads) every ``period`` s until stopped."""

    def __init__(self, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self._stop_evt = period, [], threading.Event()

    def run(self) -> None:
        while not self._stop_evt.wait(self.period):
            total, ours = _runnable_threads()
            self.samples.append((time.time_ns() // 1000, total - ours))

    def stop(self) -> list[tuple[int, int]]:
        self._stop_evt.set()
        self.join()
        return self.samples


def run_demo(run_dir: Path, args: list[str], quick: bool, src: Path, timeout_s: int, tries: int = 3) -> float:
    """One demo run into ``run_dir`` (its load samples beside it); returns the wall time in s. A failed run
    (Ray's start-up can time out on a saturated machine) is removed and tried again."""
    import shutil

    for attempt in range(1, tries + 1):
        try:
            return _run_once(run_dir, args, quick, src, timeout_s)
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            print(f"{run_dir.name}: try {attempt} failed: {exc}", flush=True)
            shutil.rmtree(run_dir, ignore_errors=True)
    raise RuntimeError(f"{run_dir} failed {tries} times")


def _run_once(run_dir: Path, args: list[str], quick: bool, src: Path, timeout_s: int) -> float:
    cmd = [sys.executable, "-c", "import sys; from dynascope.cli import app; sys.argv[0] = 'dynascope'; app()",
           "demo", "--run", str(run_dir), *(["--quick"] if quick else []), *args]
    env = {**os.environ, "PYTHONPATH": str(src)}
    sampler = LoadSampler()
    sampler.start()
    t = time.perf_counter()
    with open(run_dir.with_suffix(".log"), "w") as log:
        done = subprocess.run(cmd, cwd=src, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
    wall = time.perf_counter() - t
    run_dir.with_suffix(".load.json").write_text(json.dumps(sampler.stop()))
    if done.returncode != 0 and not (run_dir / "policy_rl.safetensors").exists():
        raise RuntimeError(f"{run_dir} failed (exit {done.returncode}); see {run_dir.with_suffix('.log')}")
    return wall


TRANSPORT = r"""
import json, os, statistics, sys, tempfile, time
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
import ray, torch
from dynascope.demo.async_ray import _start_ray, load_weights, publish_weights
from dynascope.demo.model import TinyLM
from dynascope.demo.settings import DemoSettings

class Side:
    def __init__(self, js):
        torch.set_num_threads(1)
        self.model = TinyLM(DemoSettings.from_json(js).model)
    def publish(self):
        t = time.perf_counter()
        refs = publish_weights(self.model)
        return time.perf_counter() - t, refs
    def load(self, refs):
        t = time.perf_counter()
        load_weights(self.model, refs)
        return time.perf_counter() - t

js, n = open(sys.argv[1]).read(), int(sys.argv[2])
_start_ray(ray, tempfile.mkdtemp(prefix="dsray", dir="/tmp"), 2)
env = {"env_vars": {"OMP_NUM_THREADS": "1"}}
trainer, worker = (ray.remote(num_cpus=1, runtime_env=env)(Side).remote(js) for _ in range(2))
pub, load = [], []
for i in range(n + 3):  # one after the other, as in a run whose trainer and worker have a core each
    p, refs = ray.get(trainer.publish.remote())
    l = ray.get(worker.load.remote(refs))
    if i >= 3:
        pub.append(p * 1e3); load.append(l * 1e3)
print(json.dumps({"publish_ms": statistics.median(pub), "load_ms": statistics.median(load),
                  "publish_ms_range": [min(pub), max(pub)], "load_ms_range": [min(load), max(load)]}))
ray.shutdown()
"""


def transport(settings: Path, out: Path, src: Path, n: int = 30) -> dict:
    """Median time of the demo's weight publish (one actor) and load (another) through Ray's object store."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    done = subprocess.run([sys.executable, "-c", TRANSPORT, str(settings), str(n)], cwd=src, env=env,
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"transport measurement failed: {done.stderr.strip().splitlines()[-1:]}")
    res = json.loads(done.stdout.strip().splitlines()[-1])
    out.write_text(json.dumps(res))
    return res


# One of the demo's processes at work for a while: a torch thread generating GRPO groups and training on them.
TIMESLICE = r"""
import sys, time, torch
torch.set_num_threads(1)
from dynascope.demo.grpo import generate_groups
from dynascope.demo.model import TinyLM, token_logprobs
from dynascope.demo.settings import DemoSettings
from dynascope.demo.task import CharTokenizer

s = DemoSettings.from_json(open(sys.argv[1]).read())
torch.manual_seed(0)
tok, model = CharTokenizer(), TinyLM(s.model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gen = torch.Generator().manual_seed(1)
seconds, start = float(sys.argv[2]), float(sys.argv[3])
while time.time() < start:  # every process of a block starts at once
    time.sleep(0.001)
n, t0 = 0, time.perf_counter()
while time.perf_counter() - t0 < seconds:
    with torch.no_grad():
        _, r = generate_groups(model, tok, s.task, s.rl, gen)
    token_logprobs(model, r)[0].sum().backward()
    opt.step()
    opt.zero_grad()
    n += 1
print(n / (time.perf_counter() - t0))
"""


def timeslice(settings: Path, out: Path, src: Path, counts: tuple[int, ...], cores: int, repeats: int = 3,
              seconds: float = 6.0) -> dict:
    """The part of the cores' capacity that does work when ``n`` of the demo's processes share them, for each
    n in ``counts``: blocks of one process alone and of n at once alternate ``repeats`` times, and each
    n-block's rate per process over the neighbouring lone rate, over min(1, cores / n), is one sample."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}

    def block(n: int) -> float:
        start = time.time() + 3.0  # after every process has imported torch
        procs = [subprocess.Popen([sys.executable, "-c", TIMESLICE, str(settings), str(seconds), str(start)], cwd=src,
                                  env=env, stdout=subprocess.PIPE, text=True) for _ in range(n)]
        rates = [float(p.communicate(timeout=120)[0].strip().splitlines()[-1]) for p in procs]
        return sum(rates) / n

    res: dict = {}
    for n in counts:
        samples = []
        alone = block(1)
        for _ in range(repeats):
            shared = block(n)
            nxt = block(1)
            samples.append(shared / ((alone + nxt) / 2) / min(1.0, cores / n))
            alone = nxt
        res[str(n)] = {"efficiency": sorted(samples)[len(samples) // 2], "samples": samples}
    out.write_text(json.dumps(res))
    return res


def background(run_dir: Path) -> float:
    """Mean background runnable threads while the run's RL steps ran."""
    from dynascope.store import open_store

    samples = json.loads(run_dir.with_suffix(".load.json").read_text())
    with open_store(run_dir) as s:
        t0, t1 = s.sql("SELECT MIN(start_us), MAX(start_us + dur_us) FROM timings WHERE phase = 'step' "
                            "AND step >= (SELECT MIN(step) FROM samples)").fetchall()[0]
    inside = [b for t, b in samples if t0 <= t <= t1]
    return sum(inside) / len(inside) if inside else 0.0


def evaluate(d: Path, cores: int) -> dict:
    """The three checks on one round's runs in ``d``."""
    import dynascope.analyses as A

    out: dict = {"round": d.name}
    done = [k for k in VARIANTS if (d / k / "policy_rl.safetensors").exists() and (d / f"{k}.load.json").exists()]
    bg = {k: background(d / k) for k in done}
    out.update({f"bg_{k}": v for k, v in bg.items()})
    if "sync" in done and "async" in done:
        settings = json.loads((d / "async" / "demo_settings.json").read_text())
        kw = dict(devices=cores, workers=settings["rollout_workers"], staleness=settings["max_staleness"],
                  staleness_policy="drop", behaviour_logprob_phase="ref_logprob")
        plain = A.schedule_what_if(d / "sync", **kw)
        load = dict(background=bg["sync"], target_background=bg["async"], **kw)
        loaded = A.schedule_what_if(d / "sync", **load)
        sync_row = plain.filter(pl.col("schedule") == "sync").row(0, named=True)
        measured = A.rl_throughput(d / "async")["samples_per_s"][0]
        out.update(sync_measured_sps=A.rl_throughput(d / "sync")["samples_per_s"][0], async_measured_sps=measured,
                   sync_calibration_pct=sync_row["calibration_error_pct"])
        frames = [("plain", plain), ("loaded", loaded)]
        ts = _efficiency(d, 1 + settings["rollout_workers"])
        if (d / "transport.json").exists():  # the object store's publish and load, measured on their own
            tr = json.loads((d / "transport.json").read_text())
            moved = {k: tr[k] for k in ("publish_ms", "load_ms")}
            out.update(moved)
            frames.append(("transport", A.schedule_what_if(d / "sync", **load, **moved)))
            if ts is not None:  # and the cores' time slicing among the async run's processes, measured alone
                out["timeslice_async"] = ts
                out["timeslice_async_clamped"] = ts > 1  # replayed as 1: no loss within the measurement's noise
                frames.append(("timeslice", A.schedule_what_if(d / "sync", **load, **moved, timeslice_efficiency=ts)))
        for tag, df in frames:
            pred = df.filter(pl.col("schedule") == "async")["samples_per_s"][0]
            out[f"async_pred_{tag}_sps"] = pred
            out[f"async_err_{tag}_pct"] = 100 * (pred - measured) / measured
    targets = [k for k in TARGETS if k in done]
    if "slow" in done and targets:
        rl = A.schedule_inputs(d / "slow")["step"].to_list()
        runs = [A.rl_throughput(d / k)["step_ms"][0] for k in targets]  # wall-clock time per RL step
        measured = sum(runs) / len(runs)
        target_bg = sum(bg[k] for k in targets) / len(targets)
        out.update(slow_measured_ms=A.rl_throughput(d / "slow")["step_ms"][0], noslow_measured_ms=measured,
                   noslow_runs=len(runs), noslow_spread_pct=100 * (max(runs) - min(runs)) / measured)
        cases = [("own", {}), ("plain", {"devices": 10**6}),
                 ("loaded", {"background": bg["slow"], "target_background": target_bg})]
        ts = _efficiency(d, 4)  # the four ranks of both runs on the cores
        if ts is not None:
            out["timeslice_ranks"], out["timeslice_ranks_clamped"] = ts, ts > 1
            cases.append(("timeslice", {**cases[2][1], "timeslice_efficiency": ts}))
        for tag, kw in cases:
            steps = A.what_if_shared(d / "slow", ranks=[2], **{"devices": cores, **kw}).filter(pl.col("step").is_in(rl))
            pred = steps["simulated_ms"].mean()
            out[f"noslow_pred_{tag}_ms"] = pred
            out[f"slow_replay_{tag}_ms"] = steps["simulated_base_ms"].mean()
            out[f"noslow_err_{tag}_pct"] = 100 * (pred - measured) / measured
        # The what-if's answer as a user reads it: the slow-rank run's measured step less the saving the
        # replay predicts (saved_ms), so the replay's own error on the measured run does not count twice.
        saved = out["slow_replay_own_ms"] - out["noslow_pred_own_ms"]
        out["noslow_pred_saved_ms"] = out["slow_measured_ms"] - saved
        out["noslow_err_saved_pct"] = 100 * (out["noslow_pred_saved_ms"] - measured) / measured
        for k in ("slow", *targets):  # the sync replay of each 4-rank run against its own measured steps
            row = A.schedule_what_if(d / k, devices=cores).filter(pl.col("schedule") == "sync").row(0, named=True)
            out[f"{k}_calibration_pct"] = row["calibration_error_pct"]
    return out


def _efficiency(d: Path, n: int) -> float | None:
    """The round's measured time-slice efficiency for ``n`` processes (``timeslice.json``), if measured."""
    f = d / "timeslice.json"
    got = json.loads(f.read_text()).get(str(n)) if f.exists() else None
    return None if got is None else got["efficiency"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", type=Path, default=Path("runs/whatif-validation"))
    ap.add_argument("--quick", action="store_true", help="the demo's --quick runs (40 RL steps, 16 prompts)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="evaluate the rounds already in --dir, run nothing")
    ap.add_argument("--snapshot", metavar="REV", help="run the demo from `git archive REV` (e.g. HEAD)")
    ap.add_argument("--timeout-s", type=int, default=900)
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    src = REPO
    if args.snapshot and not args.reuse:
        src = args.dir / "src"
        src.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(REPO), "archive", args.snapshot, "dynascope"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    if not args.reuse:
        for i in range(args.rounds):
            d = args.dir / f"round{i}"
            d.mkdir(parents=True, exist_ok=True)
            # alternate the order; the two target runs sit on either side of the slow-rank run
            order = ["sync", "async", "even", "slow", "even2"] if i % 2 == 0 else ["async", "sync", "even2", "slow", "even"]
            for k in order:
                if not (d / k / "policy_rl.safetensors").exists():  # written at the end of a finished run
                    shutil.rmtree(d / k, ignore_errors=True)
                    try:
                        wall = run_demo(d / k, VARIANTS[k], args.quick, src, args.timeout_s)
                    except RuntimeError as exc:  # reported; the round is evaluated without it
                        print(exc, flush=True)
                        continue
                    print(f"{d.name}/{k}: {wall:.0f} s, load average {os.getloadavg()[0]:.1f}", flush=True)
            if not (d / "transport.json").exists() and (d / "sync" / "demo_settings.json").exists():
                try:  # the synchronous run's model, so the same bytes cross the object store
                    tr = transport(d / "sync" / "demo_settings.json", d / "transport.json", src)
                    print(f"{d.name}/transport: publish {tr['publish_ms']:.1f} ms, load {tr['load_ms']:.1f} ms",
                          flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    print(exc, flush=True)
            if not (d / "timeslice.json").exists() and (d / "sync" / "demo_settings.json").exists():
                settings = json.loads((d / "sync" / "demo_settings.json").read_text())
                counts = (1 + settings["rollout_workers"], 4)  # the async run's processes, the 4-rank runs'
                try:
                    got = timeslice(d / "sync" / "demo_settings.json", d / "timeslice.json", src, counts, cores)
                    print(f"{d.name}/timeslice: " + ", ".join(f"{n} processes {v['efficiency']:.3f}"
                                                              for n, v in got.items()), flush=True)
                except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
                    print(f"time-slice measurement failed: {exc}", flush=True)
    rounds = sorted(p for p in args.dir.glob("round*") if p.is_dir())
    res = pl.DataFrame([evaluate(d, cores) for d in rounds])
    pl.Config.set_tbl_cols(-1)
    pl.Config.set_tbl_width_chars(250)
    print(f"\ncores: {cores}; runs: {'--quick' if args.quick else 'default'} demo settings\n")
    print(res.select(pl.col(pl.Float64).round(2), pl.exclude(pl.Float64)).select(res.columns))
    summary = res.select([pl.col(c) for c in res.columns if c.endswith("_pct")])
    print("\nerrors (%): median, mean, min, max over rounds")
    for c in summary.columns:
        s = summary[c].drop_nulls()
        print(f"  {c:<28} {s.median():7.2f} {s.mean():7.2f} {s.min():7.2f} {s.max():7.2f}")
    (args.dir / "validation.json").write_text(res.write_json())


if __name__ == "__main__":
    main()
