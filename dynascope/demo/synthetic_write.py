"""Write a synthetic cluster run (``synthetic.ClusterPlan``) through ``RunWriter``, one writer per simulated rank.

Each rank's writer appends what the probes of a real rank would: its phase timings every step, its FSDP shard
of every tensor's statistics every ``tensor_every`` steps (``tensor_stats`` with ``sharded`` set, whose
rollups the writer derives), checkpoint events, the samples it generated (rollout workers) and, on rank 0,
the run's scalars. Rows are appended at their simulated time and flushed when the writer's thread would
have: once per ``flush_secs`` of simulated time that saw an append (the writer's default is 2 s, so a step
of tens of seconds is one flush, one segment per table it wrote).

Hosts: the writer records ``socket.gethostname()`` in its writer id, its heartbeat and, in the process that
creates the run, the ``runs`` row; here each writer is made while that call answers the simulated node's
name, and every other rank appends a ``runs`` row of its own, so ``runs`` maps each rank to its host.

Ranks are spread over ``processes`` worker processes (several writers each, one at a time); rank 0's
process creates the run and the others join it once its marker exists.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dynascope.core.version import __version__
from dynascope.demo.synthetic import ClusterPlan, ClusterSpec
from dynascope.demo.synthetic_tensors import ShardedModel
from dynascope.store import SCHEMA_VERSION, RunWriter
from dynascope.store.layout import MARKER

PLANTED = "planted.json"  # the truth file, in the run directory (no table reads it)
TRAINER_PHASES = ["weight_sync", "rollout", "forward", "backward", "grad_reduce", "optimizer", "checkpoint", "step"]
TRAINER_CATS = ["comm", "wait", "phase", "phase", "comm", "phase", "phase", "step"]
WORKER_PHASES = ["train_wait", "weight_sync", "rollout", "reward", "step"]
WORKER_CATS = ["wait", "comm", "phase", "phase", "step"]
SCALAR_KEYS = ["loss", "grad_norm", "reward_mean", "kl", "entropy", "lr", "response_len_mean"]


def write_cluster_run(run_dir: str | os.PathLike, spec: ClusterSpec, *, processes: int | None = None,
                      flush_secs: float = 2.0, fsync: bool = False) -> dict:
    """Write the run; returns the planted truth (also written to ``run_dir/planted.json``) with the rows
    written per table, the processes used and the wall seconds it took.

    ``fsync=False`` skips the writer's fsync of each segment (synthetic data need not survive a power cut;
    it halves the cost of a small flush); the files are the same.
    """
    run = Path(run_dir)
    if run.exists() and any(run.iterdir()):
        raise ValueError(f"{run}: exists and is not empty")
    t = time.perf_counter()
    plan = ClusterPlan(spec)
    total = spec.ranks + spec.workers
    n = max(1, min(processes or os.cpu_count() or 1, total))
    chunks = [list(range(total))[i::n] for i in range(n)]  # rank 0 leads the first chunk: it creates the run
    args = [(str(run), spec, chunk, flush_secs, fsync) for chunk in chunks]
    if n == 1:
        counts = [_write_ranks(*args[0], plan=plan)]
    else:
        with ProcessPoolExecutor(n, mp_context=get_context("spawn")) as pool:
            counts = list(pool.map(_write_ranks, *zip(*args, strict=True)))
    rows: Counter = Counter()
    for c in counts:
        rows.update(c)
    truth = {**plan.planted(), "rows": dict(sorted(rows.items())), "processes": n, "flush_secs": flush_secs,
             "generate_s": round(time.perf_counter() - t, 2)}
    tmp = run / f".{PLANTED}.tmp"
    tmp.write_text(json.dumps(truth, indent=1), encoding="utf-8")
    os.replace(tmp, run / PLANTED)
    return truth


def read_planted(run_dir: str | os.PathLike) -> dict:
    """The truth ``write_cluster_run`` wrote beside a run's tables."""
    return json.loads((Path(run_dir) / PLANTED).read_text(encoding="utf-8"))


@contextlib.contextmanager
def _as_host(host: str) -> Iterator[None]:
    real = socket.gethostname
    socket.gethostname = lambda: host  # type: ignore[assignment]
    try:
        yield
    finally:
        socket.gethostname = real  # type: ignore[assignment]


@contextlib.contextmanager
def _no_fsync(skip: bool) -> Iterator[None]:
    real = os.fsync
    if skip:
        os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def _write_ranks(run_dir: str, spec: ClusterSpec, ranks: list[int], flush_secs: float, fsync: bool,
                 plan: ClusterPlan | None = None) -> dict[str, int]:
    """Write the given global ranks one after another (runs in a worker process); returns rows per table."""
    plan = plan or ClusterPlan(spec)  # deterministic: every process computes the same plan
    model = ShardedModel(spec)
    run = Path(run_dir)
    rows: Counter = Counter()
    with _no_fsync(not fsync):
        for rank in ranks:
            if rank != 0:
                deadline = time.monotonic() + 300
                while not (run / MARKER).exists():  # rank 0 creates the run: its runs row is the creator's
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{run}: rank 0 never created the run")
                    time.sleep(0.05)
            rows.update(_write_rank(run, plan, model, rank, flush_secs))
    return dict(rows)


def _write_rank(run: Path, plan: ClusterPlan, model: ShardedModel, rank: int, flush_secs: float) -> Counter:
    spec = plan.spec
    trainer = rank < spec.ranks
    role, world = ("trainer", spec.ranks) if trainer else ("rollout", spec.workers)
    config = {"model": "llama-synthetic", "n_params": model.n_params, "n_layers": spec.layers,
              "hidden": spec.hidden, "parallelism": "fsdp2", "synthetic": spec.as_dict()}
    with _as_host(spec.host(rank)):
        w = RunWriter(run, rank=rank, role=role, world_size=world, framework="fsdp2", config=config,
                      run_name=run.name, flush_secs=3600, flush_rows=2**40)
    rows: Counter = Counter()

    def put(table: str, cols: dict) -> None:
        w.append(table, cols)
        rows[table] += len(next(v for v in cols.values() if isinstance(v, (list, np.ndarray))))

    if rank != 0:
        put("runs", {"name": [run.name], "start_us": plan.t_start[0, 0], "host": spec.host(rank), "world_size": world,
                     "framework": "fsdp2", "dynascope_version": __version__, "schema_version": SCHEMA_VERSION})
    flush_us = max(int(flush_secs * 1e6), 1)
    window = None
    for i in range(spec.steps):
        at = int(plan.t_end[i, rank] if trainer else plan.w_end[i, rank - spec.ranks])
        if window is not None and at // flush_us != window:
            w.flush()  # the writer's thread flushes what arrived within one interval
        window = at // flush_us
        if trainer:
            _trainer_step(plan, model, rank, i, put)
        else:
            _worker_step(plan, rank - spec.ranks, i, put)
    w.close()
    if w.rows_dropped or w.write_errors:
        raise RuntimeError(f"rank {rank}: the writer dropped {w.rows_dropped} rows, {w.write_errors} write errors")
    rows["runs"] += rank == 0
    rows["events"] += 1  # run_end
    return rows


def trainer_timings(plan: ClusterPlan, r: int, i: int) -> dict:
    """Trainer rank ``r``'s ``timings`` rows of step ``i``, as columns for ``RunWriter.append``."""
    start, sync_end, done = int(plan.t_start[i, r]), int(plan.t_sync_end[i]), int(plan.t_rollout_done[i])
    fwd, bwd, opt, ckpt = (int(a[i, r]) for a in (plan.fwd_us, plan.bwd_us, plan.opt_us, plan.ckpt_us))
    arrive, coll_end, end = int(plan.t_arrive[i, r]), int(plan.t_coll_end[i]), int(plan.t_end[i, r])
    starts = [start, sync_end, done, done + fwd, arrive, coll_end, coll_end + opt, start]
    durs = [sync_end - start, done - sync_end, fwd, bwd, coll_end - arrive, opt, ckpt, end - start]
    keep = [k for k, d in enumerate(durs) if d > 0 or TRAINER_PHASES[k] != "checkpoint"]
    return {"step": i, "phase": [TRAINER_PHASES[k] for k in keep], "category": [TRAINER_CATS[k] for k in keep],
            "start_us": np.array([starts[k] for k in keep], np.int64),
            "dur_us": np.array([durs[k] for k in keep], np.int64), "device": f"cuda:{r % plan.spec.ranks_per_node}"}


def _trainer_step(plan: ClusterPlan, model: ShardedModel, r: int, i: int, put) -> None:
    spec = plan.spec
    ckpt, coll_end, opt = int(plan.ckpt_us[i, r]), int(plan.t_coll_end[i]), int(plan.opt_us[i, r])
    end = int(plan.t_end[i, r])
    put("timings", trainer_timings(plan, r, i))
    if ckpt:
        put("events", {"step": [i], "time_us": coll_end + opt + ckpt, "event": "checkpoint_save", "severity": "info",
                       "message": f"sharded checkpoint of step {i}", "dur_us": ckpt,
                       "fields_json": json.dumps({"path": f"ckpt/step-{i}/rank-{r}.distcp"})})
    if i % spec.tensor_every == 0:
        put("tensor_stats", {"step": i, "time_us": end, "stage": "rl", **model.shard_rows(r, i)})
    if r == 0:
        reward = float(plan.reward[i].mean())
        tokens = float(plan.response_len[i].mean())
        values = [0.7 - 0.2 * reward, 0.9 + 0.1 * np.sin(i / 7), reward, 0.002 * (1 + i / spec.steps),
                  1.2 - 0.4 * i / spec.steps, 1e-6, tokens]
        put("scalars", {"step": i, "time_us": end, "stage": "rl", "key": SCALAR_KEYS, "value": np.array(values)})


def worker_timings(plan: ClusterPlan, w: int, i: int) -> dict:
    """Rollout worker ``w``'s ``timings`` rows of step ``i``, as columns for ``RunWriter.append``."""
    start, sync_start, sync_end = int(plan.w_start[i, w]), int(plan.w_sync_start[i]), int(plan.t_sync_end[i])
    span, reward, end = int(plan.gen_span_us[i, w]), int(plan.reward_us[i, w]), int(plan.w_end[i, w])
    starts = [start, sync_start, sync_end, sync_end + span, start]
    durs = [sync_start - start, sync_end - sync_start, span, reward, end - start]
    keep = [k for k, d in enumerate(durs) if d > 0]
    return {"step": i, "phase": [WORKER_PHASES[k] for k in keep], "category": [WORKER_CATS[k] for k in keep],
            "start_us": np.array([starts[k] for k in keep], np.int64),
            "dur_us": np.array([durs[k] for k in keep], np.int64), "device": f"cuda:{w % plan.spec.ranks_per_node}"}


def _worker_step(plan: ClusterPlan, w: int, i: int, put) -> None:
    spec = plan.spec
    sync_end, span = int(plan.t_sync_end[i]), int(plan.gen_span_us[i, w])
    put("timings", worker_timings(plan, w, i))
    n, groups = spec.samples_per_worker, spec.samples_per_worker // spec.group_size
    first = (i * spec.workers + w)
    gen_start = sync_end + plan.admit_us
    gen_us = plan.gen_us[i, w]
    put("samples", {"step": i, "time_us": sync_end + span, "sample_id": first * n + np.arange(n),
                    "group_id": first * groups + np.arange(n) // spec.group_size,
                    "prompt_len": plan.prompt_len[i, w], "response_len": plan.response_len[i, w],
                    "reward": plan.reward[i, w], "gen_start_us": gen_start, "gen_end_us": gen_start + gen_us,
                    "gen_ms": gen_us / 1000.0, "policy_version": i, "trainer_version": i})
