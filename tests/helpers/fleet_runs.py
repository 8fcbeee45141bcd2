"""Small synthetic runs for fleet tests and benchmarks/fleet_summary.py, written through ``RunWriter``.

A run has ``ranks`` data-parallel ranks and ``steps`` steps, the first third SFT and the rest RL (with a
rollout phase). Every rank writes timings (step rows, top-level phases, an all-reduce), identical
tensor_stats rows (as DDP replicas do: PULSE S₁ and Mukherjee's drift sparsity among them), and rank 0
writes spectra, samples and scalars. Rank ``ranks - 1`` runs ``slow`` times slower, so there is a
straggler to find. Values are drawn from a seeded generator.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dynascope.core.clock import now_us
from dynascope.store import RunWriter

TENSORS = [("embed.weight", None, "embed", (64, 16))] + [
    (f"layers.{i}.{k}.weight", i, k, (16, 16)) for i in range(2) for k in ("q", "v", "mlp")
] + [("head.weight", None, "head", (64, 16))]


def write_synthetic_run(run_dir: Path, *, ranks: int = 2, steps: int = 12, seed: int = 0, slow: float = 1.5,
                        flush_every: int | None = None) -> Path:
    """Write the run (``flush_every``: flush every that many steps, so tables hold several segments)."""
    rng = np.random.default_rng(seed)
    writers = [RunWriter(run_dir, rank=r, world_size=ranks, flush_secs=3600,
                         config={"seed": seed, "ranks": ranks}) for r in range(ranks)]
    try:
        t = now_us() - 3_600_000_000
        for step in range(1, steps + 1):
            write_step(writers, rng, step, steps, t, slow)
            t += 2_000_000
            if flush_every and step % flush_every == 0:
                for w in writers:
                    w.flush()
    finally:
        for w in writers:
            w.close()
    return run_dir


def write_step(writers: list[RunWriter], rng: np.random.Generator, step: int, steps: int, t: int, slow: float) -> None:
    """One synchronous step of every rank."""
    stage = "sft" if step <= max(1, steps // 3) else "rl"
    phases = ([("rollout", 300.0)] if stage == "rl" else []) + [("forward", 40.0), ("backward", 80.0), ("optimizer", 10.0)]
    factors = [slow if r == len(writers) - 1 and len(writers) > 1 else 1.0 for r in range(len(writers))]
    busy = [[int(ms * 1000 * f * rng.uniform(0.9, 1.1)) for _, ms in phases] for f in factors]
    barrier = max(sum(b) for b in busy)
    tensor_rows = _tensor_rows(rng, step, stage)
    for w, durs in zip(writers, busy, strict=True):
        comm = barrier - sum(durs) + int(rng.uniform(5, 8) * 1000)
        names = [p for p, _ in phases] + ["allreduce"]
        ds = [*durs, comm]
        starts = list(t + np.concatenate([[0], np.cumsum(ds)[:-1]]))
        w.append("timings", {"step": step, "phase": names, "parent": None, "start_us": starts, "dur_us": ds,
                             "category": ["phase"] * len(phases) + ["comm"], "device": "cpu"})
        w.append("timings", {"step": step, "phase": "step", "category": "step", "start_us": t,
                             "dur_us": sum(ds) + int(rng.uniform(1, 3) * 1000), "device": "cpu"})
        w.append("tensor_stats", tensor_rows)
    w0 = writers[0]
    w0.append("scalars", {"step": step, "stage": stage, "key": ["loss", "lr"],
                          "value": [float(np.exp(-step / 10)), 1e-6 if stage == "rl" else 1e-4]})
    if stage == "rl":
        n = 8
        start = t + rng.integers(0, 5000, n)
        end = start + rng.integers(50_000, 300_000, n)
        w0.append("samples", {"step": step, "time_us": end, "sample_id": np.arange(n) + 100 * step,
                              "group_id": np.arange(n) // 4, "response_len": rng.integers(10, 200, n),
                              "reward": rng.uniform(0, 1, n), "gen_start_us": start, "gen_end_us": end,
                              "gen_ms": (end - start) / 1000.0, "policy_version": step, "trainer_version": step})
    if step % 4 == 0:
        _spectra(w0, rng, step, stage)


def _tensor_rows(rng: np.random.Generator, step: int, stage: str) -> dict:
    n = len(TENSORS)
    numel = np.array([int(np.prod(s)) for *_, s in TENSORS])
    w_norm = np.sqrt(numel) * 0.02 * rng.uniform(0.9, 1.1, n)
    update = w_norm * (1e-2 if stage == "sft" else 1e-3) * rng.uniform(0.5, 1.5, n)
    s1 = rng.uniform(0.2, 0.6, n) if stage == "sft" else rng.uniform(0.6, 0.99, n)
    drift_unchanged = rng.uniform(0.05, 0.2, n) if stage == "sft" else rng.uniform(0.6, 0.9, n)
    return {
        "step": step, "stage": stage, "tensor": [t[0] for t in TENSORS], "layer": [t[1] for t in TENSORS],
        "kind": [t[2] for t in TENSORS], "shape": [str(list(t[3])) for t in TENSORS], "dtype": "float32",
        "numel": numel, "sharded": False, "w_norm": w_norm, "update_norm": update, "update_ratio": update / w_norm,
        "bf16_unchanged_count": (s1 * numel).astype(np.int64), "bf16_unchanged_frac": s1,
        "drift_norm": update * np.sqrt(step), "ref_covered": True,
        "drift_unchanged_count": (drift_unchanged * numel).astype(np.int64), "drift_unchanged_frac": drift_unchanged,
        "grad_norm": update * 30,
    }


def _spectra(w: RunWriter, rng: np.random.Generator, step: int, stage: str) -> None:
    rows = [t for t in TENSORS if len(t[3]) == 2]
    sigma = [sorted(rng.uniform(0.01, 1.0, 4).tolist(), reverse=True) for _ in rows]
    fro = [float(np.sqrt(sum(x * x for x in s) * 1.2)) for s in sigma]
    w.append("spectra", {
        "step": step, "stage": stage, "tensor": [t[0] for t in rows], "layer": [t[1] for t in rows],
        "kind": [t[2] for t in rows], "rows": [t[3][0] for t in rows], "cols": [t[3][1] for t in rows], "k": 4,
        "drift_norm": fro, "sigma": sigma, "rank1_energy": [s[0] ** 2 / f ** 2 for s, f in zip(sigma, fro, strict=True)],
        "topk_energy": [sum(x * x for x in s) / f ** 2 for s, f in zip(sigma, fro, strict=True)],
    })
