"""One writer per node against one writer per rank, side by side: metadata operations, CPU, and reads.

Each rank is a forked process with watch()'s journal writer (``RunWriter(seal_secs=...)``, its own fold on),
time-compressed: a flush every ``--flush-s`` and a seal every ``--seal-s`` (watch()'s 10 s and 300 s). Each
step it records watch()'s kind of rows: four phase rows in ``timings`` and ``--tensors`` ``tensor_stats``
rows. The two arms differ in one setting: ``node=False`` (each rank writes its own files) or ``node=<key>``
with ``--per-node`` ranks a key (``store.node``: one of them writes the node's files, the others hand it
their flushes). The arms alternate round by round.

- **Metadata operations** (create, rename, unlink, mkdir, rmdir) on the FUSE pass-through of the fault
  tests (``tests/helpers/faultfs.py``): while the ranks train, per rank-hour at watch()'s rates (the steps
  span ``steps · step_s · 10 / flush_s`` seconds of such a run), and per rank over the run's whole life.
- **CPU per step** of each rank's process (``time.process_time`` over its steps, writer thread included),
  by what the process is: a rank's own writer, the node's writer, or a sender; and the training thread's
  ``append``, median ns.
- **Open + count at cluster scale**: ``--scale-ranks`` ranks' live files, written once per rank and once
  per node of ``--per-node`` with the same rows, four flushes each (``write_side.open_vs_files``'s model:
  a live writer holds up to 8 segments), opened and counted in a fresh process, alternating.

    python benchmarks/node_writer.py --ranks 16 --steps 300 --rounds 5 --scale-ranks 1280
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_side import META, PHASES, _med, _open_count  # noqa: E402

from dynascope.store import RunWriter  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "helpers"))
WRITES = META[:5]  # create, rename, unlink, mkdir, rmdir: what a metadata server serializes


def _rank(run: str, rank: int, a: argparse.Namespace, node: bool, begin, go, out) -> None:
    key = f"node{rank // a.per_node}" if node else False
    w = RunWriter(run, rank=rank, world_size=a.ranks, flush_secs=a.flush_s, seal_secs=a.seal_s, node=key)
    kind = {"NodeServer": "node writer", "NodeLink": "sender"}.get(type(w.node).__name__, "own writer")
    names = [f"layers.{i // 4}.w{i % 4}" for i in range(a.tensors)]
    rng = np.random.default_rng(rank)
    out.put("ready")
    begin.wait(600)  # every writer made: the parent counts the steps' metadata operations from here
    costs, cpu0, t_next = [], time.process_time(), time.monotonic()
    for step in range(a.steps):
        t0 = time.perf_counter_ns()
        w.append("timings", {"step": step, "phase": PHASES, "dur_us": [1000, 2000, 500, 3600],
                             "category": ["phase", "phase", "phase", "step"]})
        w.append("tensor_stats", {"step": step, "tensor": names, "numel": 4096, "w_norm": rng.random(a.tensors),
                                  "update_norm": rng.random(a.tensors), "update_ratio": rng.random(a.tensors)})
        costs.append(time.perf_counter_ns() - t0)
        t_next = max(t_next + a.step_s, time.monotonic() - a.step_s)
        time.sleep(max(t_next - time.monotonic(), 0))
    cpu = (time.process_time() - cpu0) / a.steps * 1e3  # the process's CPU while it trains: writer thread too
    out.put("live")
    go.wait(600)  # every rank closes together, once the parent has seen them all live
    w.close(timeout_s=60)
    out.put((rank, kind, cpu, statistics.median(costs) / 1e3))
    out.close()
    out.join_thread()
    os._exit(0)


def _live_files(run: Path) -> int:
    """Parquet files and journals of ``timings`` outside the schema and merged directories."""
    return sum(n.endswith((".parquet", ".jsonl")) for d, _, names in os.walk(run / "timings")
               if not d.endswith(("writer=_schema", "writer=_merged")) for n in names)


def run_arm(run: Path, a: argparse.Namespace, node: bool, ops=lambda: collections.Counter()) -> dict:
    ctx = mp.get_context("fork")
    begin, go, out = ctx.Event(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(run), r, a, node, begin, go, out)) for r in range(a.ranks)]
    before = ops()
    for p in procs:
        p.start()
    for _ in procs:
        out.get(timeout=900)
    started = ops()
    begin.set()
    for _ in procs:
        out.get(timeout=900)
    live, files_live = ops(), _live_files(run)
    go.set()
    got = [out.get(timeout=900) for _ in procs]
    for p in procs:
        p.join(timeout=300)
    after = ops()
    cpu: dict[str, list[float]] = collections.defaultdict(list)
    for _, kind, ms, _ in got:
        cpu[kind].append(ms)
    return {"files_live": files_live, "cpu_ms_per_step": dict(cpu), "append_us": [g[3] for g in got],
            "node_cpu_ms_per_step": sum(g[2] for g in got) / (a.ranks / a.per_node),
            "steps_writes": sum((live - started)[k] for k in WRITES), "life_writes": sum((after - before)[k] for k in WRITES)}


def metadata(a: argparse.Namespace) -> dict:
    """Both arms on the FUSE mount, alternating: metadata writes per rank-hour, CPU per step."""
    from faultfs import Mount

    root = Path(tempfile.mkdtemp(prefix="dynascope-node-"))
    m = Mount(root)
    hours = a.steps * a.step_s * (10.0 / a.flush_s) / 3600  # the run's length at watch()'s flush interval
    res: dict = {"own": [], "node": []}
    try:
        def ops() -> collections.Counter:
            return collections.Counter(m.ops.read_text().split()) if m.ops.exists() else collections.Counter()
        for r in range(a.rounds):
            for arm in ("own", "node")[:: 1 if r % 2 == 0 else -1]:
                one = run_arm(m.path / f"{arm}-{r}", a, arm == "node", ops)
                one["writes_per_rank_hour"] = one["steps_writes"] / a.ranks / hours
                one["life_writes_per_rank"] = one["life_writes"] / a.ranks
                res[arm].append(one)
                print(f"{arm} round {r}: {one['writes_per_rank_hour']:.0f} metadata writes per rank-hour while "
                      f"training, {one['life_writes_per_rank']:.0f} per rank in all, {one['files_live']} live files",
                      flush=True)
    finally:
        m.close()
        shutil.rmtree(root, ignore_errors=True)
    return res


def _write_layout(run: Path, ranks: int, per_node: int, flushes: int, steps: int) -> None:
    """``ranks`` ranks' live timings as one writer each (``per_node`` 1) or one per node: the same rows."""
    for first in range(0, ranks, per_node):
        w = RunWriter(run, rank=first, world_size=ranks, flush_secs=3600, flush_rows=10**9, fold=False, node=False)
        for f in range(flushes):
            for rank in range(first, first + per_node):
                for step in range(f * steps, (f + 1) * steps):
                    w.append("timings", {"step": step, "phase": PHASES, "rank": rank, "dur_us": [1000, 2000, 500, 3600]})
            w.flush()
        w.close()


def open_at_scale(a: argparse.Namespace) -> dict:
    d = Path(tempfile.mkdtemp(prefix="dynascope-node-scale-"))
    try:
        runs = {"own": d / "own", "node": d / "node"}
        for arm, run in runs.items():
            _write_layout(run, a.scale_ranks, 1 if arm == "own" else a.per_node, 4, 5)
        res: dict = {arm: {"files": sum(1 for _ in run.rglob("*.parquet")), "open": []} for arm, run in runs.items()}
        for r in range(a.rounds):
            for arm in ("own", "node")[:: 1 if r % 2 == 0 else -1]:
                res[arm]["open"] += _open_count("dynascope", runs[arm], 1, {"DYNASCOPE_FOLD": "0"})
        assert res["own"]["open"][0]["rows"] == res["node"]["open"][0]["rows"] == a.scale_ranks * 4 * 5 * 4
        return res
    finally:
        shutil.rmtree(d, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=16)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--step-s", type=float, default=0.02)
    ap.add_argument("--flush-s", type=float, default=0.2, help="stands for watch()'s 10 s")
    ap.add_argument("--seal-s", type=float, default=6.0, help="stands for watch()'s 300 s")
    ap.add_argument("--tensors", type=int, default=8, help="tensor_stats rows a step: 400 rows a second, as a 400-tensor model at a step a second")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--scale-ranks", type=int, default=1280)
    a = ap.parse_args()
    print(f"cores {len(os.sched_getaffinity(0))}, load average {os.getloadavg()}", flush=True)
    meta = metadata(a)
    scale = open_at_scale(a)
    print(f"\n{a.ranks} ranks, {a.per_node} a node, {a.steps} steps; medians (min–max) of {a.rounds} rounds; "
          f"load average after {os.getloadavg()}\n")
    print("| arm | metadata writes per rank-hour, training | per rank, whole run | live timings files | CPU ms per step: own writer | "
          "node writer | sender | all ranks of a node | append µs (training thread) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm, rounds in meta.items():
        cpu = {k: [statistics.median(r["cpu_ms_per_step"][k]) for r in rounds if k in r["cpu_ms_per_step"]]
               for k in ("own writer", "node writer", "sender")}
        print(f"| {arm} | {_med([r['writes_per_rank_hour'] for r in rounds], '{:,.0f}')} | "
              f"{_med([r['life_writes_per_rank'] for r in rounds], '{:.0f}')} | "
              f"{_med([r['files_live'] for r in rounds], '{:.0f}')} | "
              + " | ".join(_med(cpu[k]) for k in cpu) + f" | {_med([r['node_cpu_ms_per_step'] for r in rounds])} | "
              f"{_med([statistics.median(r['append_us']) for r in rounds])} |")
    print(f"\nopen + count of {a.scale_ranks} ranks' live timings (4 segments a writer), fresh process each:")
    for arm, r in scale.items():
        print(f"  {arm}: {r['files']} Parquet files, {_med([x['s'] for x in r['open']])} s, "
              f"{_med([x['rss_mb'] for x in r['open']], '{:.0f}')} MB")
    ratio = [n["s"] / o["s"] for n, o in zip(scale["node"]["open"], scale["own"]["open"], strict=True)]
    print(f"  node / own, per round: {_med(ratio)}")


if __name__ == "__main__":
    main()
