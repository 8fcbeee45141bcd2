"""Planted timing rows written with the real RunWriter: a synchronous RL run with fixed phase durations (each
schedule's step time follows in closed form), random runs with rank-dependent phase orders, and a store of
several runs and roles with the shapes a what-if replay has to get right."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

from dynascope.analyses.steps import REMAINDER
from dynascope.store import RunWriter

T0 = 1_700_000_000_000_000  # µs
MS = 1000
STEPS = 10


def timing_rows(t: int, phases: list[tuple[str, int, str]]) -> tuple[dict, int]:
    """Consecutive top-level rows from ``t`` for (phase, µs, category) triples; returns them and the end."""
    rows = {"phase": [], "start_us": [], "dur_us": [], "category": []}
    for phase, us, cat in phases:
        for k, v in zip(rows, (phase, t, us, cat), strict=True):
            rows[k].append(v)
        t += us
    return rows, t


def plant(run: Path, *, ranks: int = 1, rollout_ms: float = 100.0, train_ms: float = 40.0, opt_ms: float = 10.0,
          sync_ms: float = 5.0, gap_ms: float = 5.0, slow: dict[int, float] | None = None, eval_ms: float = 0.0,
          gens_ms: list[float] | None = None, allreduce_ms: float = 4.0) -> Path:
    """A synchronous RL run: per step weight_sync → rollout (samples' generation from its start) → train →
    [grad_allreduce] → optimizer → an un-instrumented gap; ``slow`` multiplies a rank's train time.
    ``eval_ms`` puts an evaluation before the first step's rollout."""
    gens = gens_ms or [rollout_ms * 0.4] * 6 + [rollout_ms * 0.8, rollout_ms]
    writers = [RunWriter(run, rank=r, world_size=ranks, flush_secs=60) for r in range(ranks)]
    t0 = T0
    for step in range(STEPS):
        train = {r: train_ms * (slow or {}).get(r, 1.0) for r in range(ranks)}
        ends = {}
        for r, w in enumerate(writers):
            order = [("eval", eval_ms if step == 0 else 0.0, "phase"), ("weight_sync", sync_ms, "phase"),
                     ("rollout", rollout_ms, "phase"), ("train", train[r], "phase")]
            if ranks > 1:  # fast ranks wait for the slowest one, then the collective costs allreduce_ms
                order.append(("grad_allreduce", max(train.values()) - train[r] + allreduce_ms, "comm"))
            order.append(("optimizer", opt_ms, "phase"))
            planted = [(p, int(ms * MS), cat) for p, ms, cat in order if ms > 0]
            gen0 = t0 + sum(us for _, us, _ in itertools.takewhile(lambda x: x[0] != "rollout", planted))
            tr, t = timing_rows(t0, planted)
            end = t + int(gap_ms * MS)
            w.append("timings", {**tr, "step": step})
            w.append("timings", {"phase": "step", "category": "step", "step": step, "start_us": t0, "dur_us": end - t0})
            w.append("samples", {"step": step, "sample_id": [r * 100 + i for i in range(len(gens))],
                                 "response_len": [int(g) for g in gens], "gen_start_us": gen0,
                                 "gen_end_us": [gen0 + int(g * MS) for g in gens], "policy_version": step,
                                 "trainer_version": step})
            ends[r] = end
        t0 = max(ends.values())
    for w in writers:
        w.close()
    return run


def random_run(path: Path, n_ranks: int, seed: int) -> Path:
    """Ranks with two sync points, rank-dependent phase orders, repeated phases and a gap nobody timed."""
    rng = random.Random(seed)
    for r in range(n_ranks):
        with RunWriter(path, rank=r) as w:
            for step in range(8):
                order = ["a", "b", "sync1", "c", "a", "sync2", "d"] if r % 2 else ["b", "a", "sync1", "c", "sync2", "d"]
                rows, t = timing_rows(T0 + step * 10**7, [(p, rng.randint(1_000, 90_000), "wait" if p.startswith("sync")
                                                           else "phase") for p in order])
                w.append("timings", {**rows, "step": step})
                if step != 3 or r == 0:  # one rank-step without a step row is left out
                    w.append("timings", {"phase": "step", "category": "step", "step": step,
                                         "start_us": T0 + step * 10**7, "dur_us": t - T0 - step * 10**7 + rng.randint(0, 20_000)})
    return path


def plant_two_busy_ranks(run: Path) -> None:
    """One step of two ranks: rank 0 computes 100 ms and waits 104 in the all-reduce, rank 1 computes 200
    and waits 4 (the collective's own cost)."""
    for r, (busy, wait) in enumerate(((100, 104), (200, 4))):
        with RunWriter(run, rank=r, world_size=2) as w:
            tr, end = timing_rows(T0, [("train", busy * MS, "phase"), ("grad_allreduce", wait * MS, "comm")])
            w.append("timings", {**tr, "step": 0})
            w.append("timings", {"phase": "step", "category": "step", "step": 0, "start_us": T0, "dur_us": end - T0})


def mixed_store(root: Path) -> Path:
    """Two runs in one root; the second has two roles, uneven ranks, a phase named like the remainder, a
    rank-step whose phases start together with its sync row, and samples without an end."""
    random_run(root / "a", 3, seed=7)
    rng = random.Random(3)
    for role, ranks in (("trainer", 3), ("rollout", 2)):
        for r in range(ranks):
            with RunWriter(root / "b", rank=r, role=role) as w:
                for step in range(6):
                    names = ["rollout", "train", REMAINDER, "allreduce", "optimizer"]
                    if (r + step) % 3 == 0:
                        names = ["rollout", "allreduce", "train", "train", "optimizer"]
                    rows, t = timing_rows(T0 + step * 10**7, [(p, rng.randint(1_000, 50_000),
                                                               "comm" if p == "allreduce" else "phase") for p in names])
                    if step == 3 and r == 1:  # a phase starting with the sync row counts before it
                        rows["start_us"][4] = rows["start_us"][3]
                    w.append("timings", {**rows, "step": step})
                    if step != 4 or r != 2:
                        w.append("timings", {"phase": "step", "category": "step", "step": step,
                                             "start_us": T0 + step * 10**7, "dur_us": t - T0 - step * 10**7 + 7_000})
                    gens = [rng.randint(1_000, 30_000) for _ in range(5)]
                    w.append("samples", {"step": step, "sample_id": list(range(5)), "gen_start_us": T0,
                                         "gen_end_us": [T0 + g if i != 2 or step != 1 else None
                                                        for i, g in enumerate(gens)]})
    return root


def write_phase_rows(run_dir: Path, phases: list[str], ranks: int, steps: int, dur_ms, step_us: int = 10**7) -> Path:
    """One row per (rank, step, phase), back to back, no step rows, through the real writer; the phase's
    duration is ``dur_ms(rank, step, phase)``."""
    for r in range(ranks):
        with RunWriter(run_dir, rank=r, world_size=ranks) as w:
            for step in range(steps):
                t, rows = T0 + step * step_us, {"phase": [], "start_us": [], "dur_us": []}
                for phase in phases:
                    d = max(1, int(1000 * dur_ms(r, step, phase)))
                    rows["phase"].append(phase)
                    rows["start_us"].append(t)
                    rows["dur_us"].append(d)
                    t += d
                w.append("timings", {**rows, "category": "phase", "step": step})
    return run_dir
