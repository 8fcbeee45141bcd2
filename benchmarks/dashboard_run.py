"""The large synthetic run that ``dashboard_render.py`` serves: ``build(run, rows)`` writes it straight into
the store layout with pyarrow, in the writer's own encodings, with the rollups the writer keeps.

A 32-layer, 2048-wide model (9 tensors per layer, embeddings and head): ``rows`` tensor_stats rows over as
many steps as that takes, the first fifth SFT and the rest RL; spectra every 100 steps; 8 ranks of phase
timings with rank 5 slow in backward; RL samples with log-normal lengths; scalars; checkpoint and fault events.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from dynascope.store import RunWriter
from dynascope.store._columns import parquet_options
from dynascope.store.layout import segment_name, writer_dir
from dynascope.store.rollup import ROLLUPS
from dynascope.store.schema import TABLES

LAYERS, RANKS, SPEC_DIM = 32, 8, 128
PER_LAYER = [("self_attn.q_proj", "q"), ("self_attn.k_proj", "k"), ("self_attn.v_proj", "v"),
             ("self_attn.o_proj", "o"), ("mlp.gate_proj", "mlp"), ("mlp.up_proj", "mlp"), ("mlp.down_proj", "mlp"),
             ("input_layernorm", "norm"), ("post_attention_layernorm", "norm")]
T0 = 1_750_000_000_000_000


def _tensors() -> tuple[list[str], np.ndarray, list[str], np.ndarray]:
    names, layers, kinds, numel = ["model.embed_tokens.weight"], [-1], ["embed"], [32000 * 2048]
    for i in range(LAYERS):
        for suffix, kind in PER_LAYER:
            names.append(f"model.layers.{i}.{suffix}.weight")
            layers.append(i)
            kinds.append(kind)
            numel.append(2048 if kind == "norm" else 2048 * (5632 if kind == "mlp" else 2048))
    names += ["model.norm.weight", "lm_head.weight"]
    layers += [-1, -1]
    kinds += ["norm", "head"]
    numel += [2048, 32000 * 2048]
    return names, np.array(layers), kinds, np.array(numel, dtype=np.int64)


def _table(name: str, cols: dict) -> pa.Table:
    schema = TABLES[name]
    n = len(next(iter(cols.values())))
    arrays = []
    for f in schema:
        v = cols.get(f.name)
        arrays.append(pa.nulls(n, f.type) if v is None else pa.array(v, type=f.type) if not isinstance(v, pa.Array)
                      else v.cast(f.type))
    return pa.Table.from_arrays(arrays, schema=schema)


def _write(run: Path, name: str, writer: str, seq: int, cols: dict) -> int:
    d = writer_dir(run, name, writer)
    d.mkdir(parents=True, exist_ok=True)
    t = _table(name, cols)
    # The writer's own encodings, and the rollups it keeps beside each tensor_stats segment.
    pq.write_table(t, d / segment_name(seq, seq), **parquet_options(t.schema))
    for rollup, roll in ROLLUPS.get(name, ()):
        rolled = roll(t)
        rd = writer_dir(run, rollup, writer)
        rd.mkdir(parents=True, exist_ok=True)
        pq.write_table(rolled, rd / segment_name(seq, seq), **parquet_options(rolled.schema))
    return t.num_rows


def _strings(idx: np.ndarray, values: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(idx.astype(np.int32)), pa.array(values)).cast(pa.string())


def build(run: Path, rows: int) -> dict:
    """Write the run; returns row counts per table."""
    RunWriter(run, world_size=RANKS, run_name="bench-dashboard").close()  # marker, typed empty segments, runs row
    rng = np.random.default_rng(0)
    names, layer_of, kind_of, numel_of = _tensors()
    nt = len(names)
    steps = max(10, rows // nt)
    sft_end = steps // 5
    counts = {t: 0 for t in ("tensor_stats", "spectra", "timings", "samples", "scalars", "events")}
    chunk = max(1, 1_000_000 // nt)
    kinds_u = sorted(set(kind_of))
    kind_idx = np.array([kinds_u.index(k) for k in kind_of])
    for seq, s0 in enumerate(range(1, steps + 1, chunk)):
        st = np.arange(s0, min(steps + 1, s0 + chunk))
        step = np.repeat(st, nt)
        ti = np.tile(np.arange(nt), len(st))
        n = len(step)
        sft = step <= sft_end
        numel = numel_of[ti]
        w = np.sqrt(numel) * 0.02 * (1 + 1e-5 * step)
        noise = rng.random(n, dtype=np.float32).astype(np.float64)
        dw = w * np.where(sft, 1e-3, 1e-4) * (0.5 + noise)
        changed = np.where(sft, 0.9 + 0.1 * noise, 0.05 + 0.3 * noise)
        gzero = np.where(sft, 0.01 * noise, 0.2 + 0.4 * noise)
        drift = w * np.where(sft, 1e-3 * np.sqrt(step), 1e-3 * np.sqrt(sft_end) + 1e-4 * np.sqrt(np.maximum(step - sft_end, 0)))
        nan = np.where(rng.random(n) < 2e-6, 1, 0)
        counts["tensor_stats"] += _write(run, "tensor_stats", "bench-r0", seq, {
            "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "role": _strings(np.zeros(n), ["trainer"]),
            "step": step, "time_us": T0 + step * 1_000_000, "stage": _strings(np.where(sft, 0, 1), ["sft", "rl"]),
            "tensor": _strings(ti, names), "layer": np.where(layer_of[ti] < 0, None, layer_of[ti]).astype(object),
            "kind": _strings(kind_idx[ti], kinds_u), "dtype": _strings(np.zeros(n), ["bfloat16"]), "numel": numel,
            "w_norm": w, "update_norm": dw, "update_ratio": dw / w, "changed_count": (changed * numel).astype(np.int64),
            "changed_frac": changed, "w_nan_count": np.zeros(n, np.int64), "w_inf_count": np.zeros(n, np.int64),
            "drift_norm": drift, "drift_ratio": drift / w, "grad_norm": dw * 40,
            "grad_zero_count": (gzero * numel).astype(np.int64), "grad_zero_frac": gzero,
            "grad_near_zero_count": (gzero * 1.3 * numel).astype(np.int64), "grad_near_zero_frac": gzero * 1.3,
            "grad_nan_count": nan, "grad_inf_count": np.zeros(n, np.int64),
        })
    _build_rest(run, rng, steps, sft_end, names, layer_of, kind_of, counts)
    return counts


def _build_rest(run: Path, rng, steps: int, sft_end: int, names, layer_of, kind_of, counts: dict) -> None:
    # spectra: every 100 steps, 2-D tensors, with 128-d singular vectors drifting slowly
    mats = [i for i, k in enumerate(kind_of) if k not in ("norm",)]
    rec = np.arange(100, steps + 1, 100) if steps >= 200 else np.arange(2, steps + 1, 2)
    u0 = rng.normal(size=(len(mats), SPEC_DIM)).astype(np.float32)
    rows = []
    for r in rec:
        u = u0 + 0.001 * r
        u = u / np.linalg.norm(u, axis=1, keepdims=True)
        for j, ti in enumerate(mats):
            s1 = 0.01 * r * (1 + 0.05 * rng.random())
            sig = [s1, s1 * 0.3, s1 * 0.1, s1 * 0.05]
            fro2 = float(np.square(sig).sum() * 1.04)  # ‖ΔW‖²_F, a little beyond the top 4
            rows.append((int(r), names[ti], None if layer_of[ti] < 0 else int(layer_of[ti]), kind_of[ti], sig,
                         sig[0] ** 2 / fro2, fro2 / sig[0] ** 2, u[j].tolist(), fro2 ** 0.5))
    cols = list(zip(*rows, strict=True))
    n = len(rows)
    counts["spectra"] += _write(run, "spectra", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": [0] * n, "step": cols[0], "stage": ["sft" if s <= sft_end else "rl"
                                                                          for s in cols[0]],
        "tensor": cols[1], "layer": cols[2], "kind": cols[3], "rows": [SPEC_DIM] * n, "cols": [SPEC_DIM] * n,
        "k": [4] * n, "drift_norm": cols[8], "sigma": cols[4],
        "rank1_energy": cols[5], "stable_rank": cols[6], "u1": cols[7], "v1": cols[7]})
    # timings: 8 ranks, a step row and 6 phases per step; rank 5 is 30 % slower in backward
    phases = [("rollout", "phase", 900.0), ("reward", "phase", 40.0), ("forward", "phase", 120.0),
              ("backward", "phase", 240.0), ("allreduce", "comm", 50.0), ("optimizer", "phase", 30.0)]
    for rank in range(RANKS):
        st = np.arange(1, steps + 1)
        durs = np.stack([np.full(steps, ms) * (1.3 if rank == 5 and p == "backward" else 1.0)
                         * (0.9 + 0.2 * rng.random(steps)) for p, _, ms in phases], 1) * 1000
        step_us = durs.sum(1) + 5000
        start = T0 + np.concatenate([[0], np.cumsum(step_us)[:-1]])
        offs = np.concatenate([np.zeros((steps, 1)), np.cumsum(durs, 1)[:, :-1]], 1)
        k = len(phases)
        cols = {"run_id": [run.name] * (steps * (k + 1)), "rank": np.full(steps * (k + 1), rank, np.int32),
                "step": np.concatenate([np.repeat(st, k), st]),
                "phase": [p for _ in range(steps) for p, _, _ in phases] + ["step"] * steps,
                "category": [c for _ in range(steps) for _, c, _ in phases] + ["step"] * steps,
                "start_us": np.concatenate([(start[:, None] + offs).ravel(), start]).astype(np.int64),
                "dur_us": np.concatenate([durs.ravel(), step_us]).astype(np.int64), "device": ["cpu"] * (steps * (k + 1))}
        counts["timings"] += _write(run, "timings", f"bench-r{rank}", 0, cols)
    per = 32
    st = np.repeat(np.arange(sft_end + 1, steps + 1), per)
    n = len(st)
    lens = np.minimum(4096, rng.lognormal(5, 0.8, n)).astype(np.int64)
    gstart = T0 + st * 1_000_000
    counts["samples"] += _write(run, "samples", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "step": st, "sample_id": np.arange(n),
        "group_id": np.arange(n) // 8, "prompt_len": np.full(n, 128), "response_len": lens,
        "reward": (rng.random(n) < 0.4).astype(float), "gen_start_us": gstart, "gen_end_us": gstart + lens * 200,
        "policy_version": st - rng.integers(0, 3, n), "trainer_version": st})
    keys = ["loss", "grad_norm", "lr", "reward_mean", "kl"]
    st = np.repeat(np.arange(1, steps + 1), len(keys))
    n = len(st)
    counts["scalars"] += _write(run, "scalars", "bench-r0", 0, {
        "run_id": [run.name] * n, "rank": np.zeros(n, np.int32), "step": st, "time_us": T0 + st * 1_000_000,
        "stage": np.where(st <= sft_end, "sft", "rl"), "key": keys * (n // len(keys)),
        "value": 2.0 * np.exp(-st / steps) + 0.05 * rng.random(n)})
    ev = [("checkpoint_save", s, "info") for s in range(0, steps, max(1, steps // 10))] + [("fault", steps // 2, "error"),
                                                                                          ("restart", steps // 2, "info")]
    counts["events"] += _write(run, "events", "bench-r0", 0, {
        "run_id": [run.name] * len(ev), "rank": [0] * len(ev), "step": [e[1] for e in ev],
        "time_us": [T0 + e[1] * 1_000_000 for e in ev], "event": [e[0] for e in ev], "severity": [e[2] for e in ev],
        "message": [f"{e[0]} at step {e[1]}" for e in ev], "dur_us": [2_000_000 if e[0] == "checkpoint_save" else None
                                                                     for e in ev]})


