"""Planted runs written with the real RunWriter: a synchronous 4-rank run with a straggler (rank 2's
backward is 1.5× the others') and a long rollout tail (one sample per rank takes 4× the others), an
asynchronous rollout/trainer pair, and metric series with a spike, a NaN and an entropy collapse.
Every expected figure in the tests that use them follows from the constants here."""

from __future__ import annotations

import math
import random
from pathlib import Path

from dynascope.store import RunWriter

RANKS, STEPS, SAMPLES_PER_RANK, GROUP = 4, 20, 8, 4
SLOW_RANK, SLOW_FACTOR = 2, 1.5
# Planted phase durations in ms (rollout = longest generation; the barrier follows backward).
ROLLOUT_SHORT, ROLLOUT_LONG = 100.0, 400.0
REWARD, FORWARD, BACKWARD, OPTIMIZER, COLLECTIVE, GAP = 20.0, 50.0, 100.0, 30.0, 10.0, 5.0
JITTER = 0.002
T0 = 1_700_000_000_000_000  # µs


def planted_step_ms() -> float:
    return ROLLOUT_LONG + REWARD + FORWARD + BACKWARD * SLOW_FACTOR + COLLECTIVE + OPTIMIZER + GAP


def write_synthetic_run(run_dir: Path, *, steps: int = STEPS, slow_rank: int | None = SLOW_RANK) -> Path:
    """Write the planted run; returns ``run_dir``. Deterministic (seeded)."""
    rng = random.Random(0)
    writers = [RunWriter(run_dir, rank=r, world_size=RANKS, flush_secs=60) for r in range(RANKS)]
    t0 = T0
    for step in range(steps):
        dur = {}  # integer µs, so the step rows equal the sums of their parts exactly
        for r in range(RANKS):
            j = {p: 1 + rng.uniform(-JITTER, JITTER) for p in ("reward", "forward", "backward", "optimizer", "gap")}
            bwd = BACKWARD * (SLOW_FACTOR if r == slow_rank else 1.0)
            ms = {"rollout": ROLLOUT_LONG, "reward": REWARD * j["reward"], "forward": FORWARD * j["forward"],
                  "backward": bwd * j["backward"], "optimizer": OPTIMIZER * j["optimizer"], "gap": GAP * j["gap"]}
            dur[r] = {p: int(round(v * 1000)) for p, v in ms.items()}
        busy = {r: sum(dur[r][p] for p in ("rollout", "reward", "forward", "backward")) for r in range(RANKS)}
        step_us = {}
        for r in range(RANKS):
            d = dict(dur[r])
            d["allreduce"] = max(busy.values()) - busy[r] + int(COLLECTIVE * 1000)
            order = ["rollout", "reward", "forward", "backward", "allreduce", "optimizer"]
            t, rows = t0, {"phase": [], "start_us": [], "dur_us": [], "category": [], "step": step}
            for p in order:
                rows["phase"].append(p)
                rows["start_us"].append(t)
                rows["dur_us"].append(d[p])
                rows["category"].append("wait" if p == "allreduce" else "phase")
                t += d[p]
            step_us[r] = sum(d[p] for p in order) + d["gap"]
            rows["phase"].append("step")
            rows["start_us"].append(t0)
            rows["dur_us"].append(step_us[r])
            rows["category"].append("step")
            writers[r].append("timings", rows)
            # Samples: one long generation per rank (the tail), seven short; groups of 4 share a prompt.
            gen = [ROLLOUT_LONG] + [ROLLOUT_SHORT] * (SAMPLES_PER_RANK - 1)
            rewards = [1.0] * GROUP + [float(i % 2) for i in range(SAMPLES_PER_RANK - GROUP)]
            if r != 0:  # only rank 0's first group has zero reward variance
                rewards[0] = 0.0
            writers[r].append("samples", {
                "step": step, "sample_id": [r * 100 + i for i in range(SAMPLES_PER_RANK)],
                "group_id": [step * 1000 + r * 10 + i // GROUP for i in range(SAMPLES_PER_RANK)],
                "prompt_len": 32, "response_len": [int(g) for g in gen], "reward": rewards,
                "gen_start_us": t0, "gen_end_us": [t0 + int(g * 1000) for g in gen], "gen_ms": gen,
                "policy_version": max(step - (1 if r % 2 else 0), 0), "trainer_version": step})
        t0 += max(step_us.values())
    for w in writers:
        w.close()
    return run_dir


def write_async_run(run_dir: Path) -> Path:
    """Rollout worker and trainer as separate actors: rollout ∪ = [0, 300] ms, train ∪ = [50, 150] + [250, 400]."""
    ms = 1000
    with RunWriter(run_dir, role="rollout") as w:
        w.append("timings", {"phase": "rollout", "category": "phase", "step": [0, 1, 2],
                             "start_us": [T0, T0 + 100 * ms, T0 + 200 * ms], "dur_us": 100 * ms})
        # a forward inside rollout is inference, not training
        w.append("timings", {"phase": "forward", "parent": "rollout", "category": "phase", "step": 2,
                             "start_us": T0 + 350 * ms, "dur_us": 100 * ms})
    with RunWriter(run_dir, role="trainer") as w:
        w.append("timings", {"phase": "train", "category": "phase", "step": [0, 1],
                             "start_us": [T0 + 50 * ms, T0 + 250 * ms], "dur_us": [100 * ms, 150 * ms]})
        w.append("timings", {"phase": "weight_sync", "category": "comm", "step": [0, 1],
                             "start_us": [T0 + 150 * ms, T0 + 400 * ms], "dur_us": 10 * ms})
    return run_dir


def write_series(run_dir: Path) -> None:
    with RunWriter(run_dir, rank=1) as w:
        steps = list(range(40))
        grad = [1.0 + 0.05 * math.sin(s) for s in steps]
        grad[25] = 9.0  # the spike
        loss = [2.0 - 0.01 * s for s in steps]
        loss[33] = float("nan")
        entropy = [1.0] * 20 + [0.05] * 20
        w.append("scalars", {"step": steps * 3, "key": ["grad_norm"] * 40 + ["loss"] * 40 + ["entropy"] * 40,
                             "value": grad + loss + entropy})
        w.append("tensor_stats", {"step": 12, "tensor": ["a.weight", "b.weight"], "grad_nan_count": [3, 0],
                                  "w_inf_count": [0, 1], "numel": 10})
