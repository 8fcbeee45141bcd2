"""The what-if replay against plain references, on real stores written by the RunWriter: a polars replay of
each scenario step by step (the former ``what_if``), and a loop-by-loop replay of ranks sharing devices;
plus the replay's own shortcuts (the medians' table path, rank numbers far apart) against its general path."""

from __future__ import annotations

import random
from collections import defaultdict
from pathlib import Path
from statistics import median

import polars as pl
import pytest
from polars.testing import assert_frame_equal

import dynascope.analyses._what_if_medians as medians
from dynascope.analyses._common import frame
from dynascope.analyses._what_if_load import process_share
from dynascope.analyses.steps import REMAINDER, STEP_ROW, SYNC, TOP_LEVEL, step_rows_sql
from dynascope.analyses.what_if_rank import what_if, what_if_steps
from dynascope.analyses.what_if_rank_shared import what_if_shared
from dynascope.analyses.what_if_schedule_inputs import schedule_inputs
from dynascope.store import RunWriter, open_store

from helpers.planted_timings import MS, T0, mixed_store, plant, plant_two_busy_ranks, random_run, timing_rows

G = ["run_id", "role", "step"]


def reference_what_if(path: Path, ranks=None, phases=None) -> pl.DataFrame:
    """The former polars what_if for one-rank and all-rank scenarios (by_phase=False), step by step."""
    con = open_store(path)
    rows = frame(con, f"""
        WITH t AS (SELECT run_id, coalesce(role, '') AS role, rank, step, phase, {SYNC} AS sync, start_us, dur_us
                   FROM timings WHERE {TOP_LEVEL}),
        s AS (SELECT *, coalesce(SUM(CASE WHEN sync THEN 1 ELSE 0 END) OVER (
                  PARTITION BY run_id, role, rank, step ORDER BY start_us, sync
                  ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0)::BIGINT AS seg FROM t)
        SELECT run_id, role, rank, step, seg, phase, sync, SUM(dur_us)::DOUBLE AS dur_us FROM s GROUP BY ALL""")
    steps = frame(con, step_rows_sql(None)).select(*G, "rank", pl.col("step_us").cast(pl.Float64))
    per_rank = rows.group_by([*G, "rank"]).agg(pl.col("dur_us").sum().alias("covered"), pl.col("seg").max())
    rem = steps.join(per_rank, on=[*G, "rank"], how="left").select(
        *G, "rank", pl.col("seg").fill_null(0).cast(rows.schema["seg"]), pl.lit(REMAINDER).alias("phase"),
        pl.lit(False).alias("sync"), (pl.col("step_us") - pl.col("covered").fill_null(0.0)).alias("dur_us"))
    rows = pl.concat([rows.join(steps.select(*G, "rank"), on=[*G, "rank"], how="semi"),
                      rem.select(rows.columns).cast(rows.schema)])
    med = rows.filter(~pl.col("sync")).group_by([*G, "seg", "phase"]).agg(pl.col("dur_us").median().alias("med_us"))
    rows = rows.join(med, on=[*G, "seg", "phase"], how="left")
    mask = pl.lit(True) if ranks in (None, "all") else pl.col("rank").is_in(list(ranks))
    mask = mask if phases is None else mask & pl.col("phase").is_in(list(phases))

    def sim(replace: pl.Expr) -> pl.DataFrame:
        d = pl.when(replace & ~pl.col("sync")).then(pl.col("med_us")).otherwise(pl.col("dur_us"))
        per = rows.with_columns(d.alias("d")).group_by([*G, "seg", "rank"]).agg(
            pl.col("d").filter(~pl.col("sync")).sum().alias("busy"), pl.col("d").filter(pl.col("sync")).sum().alias("sync"))
        seg = per.group_by([*G, "seg"]).agg((pl.col("busy").max() + pl.col("sync").min()).alias("t"))
        return seg.group_by(G).agg(pl.col("t").sum().alias("sim_us"))

    base = sim(pl.lit(False))
    new = sim(mask if ranks is not None else pl.lit(False)).rename({"sim_us": "new_us"})
    return base.join(new, on=G).sort(G).select(*G, (pl.col("sim_us") / 1e3).alias("simulated_base_ms"),
                                              (pl.col("new_us") / 1e3).alias("simulated_ms"))


def assert_replays_like_the_reference(path: Path, ranks, phases) -> None:
    ref = reference_what_if(path, ranks, phases)
    got = what_if_steps(path, ranks=ranks, phases=phases)
    assert got.select(G).rows() == ref.select(G).rows()
    for col in ("simulated_base_ms", "simulated_ms"):
        assert got[col].to_list() == pytest.approx(ref[col].to_list(), rel=1e-12), (ranks, phases, col)


@pytest.mark.parametrize("n_ranks", [1, 2, 3, 4])
def test_replay_equals_the_polars_reference(tmp_path, n_ranks):
    run = random_run(tmp_path / "rand", n_ranks, seed=n_ranks)
    for ranks, phases in ((None, None), ("all", None), ([0], None), ([n_ranks - 1], ["a", REMAINDER])):
        assert_replays_like_the_reference(run, ranks, phases)
    # what_if's one-pass scenarios agree with the reference simulated rank by rank
    df = what_if(run, by_phase=True)
    assert df.height == n_ranks * 6 + 1  # per rank, per (rank, busy phase incl. remainder), all ranks
    for row in df.iter_rows(named=True):
        ref = reference_what_if(run, "all" if row["rank"] is None else [row["rank"]],
                                None if row["phase"] is None else [row["phase"]])
        assert row["saved_ms"] == pytest.approx((ref["simulated_base_ms"] - ref["simulated_ms"]).sum(), abs=1e-6)


def test_replay_of_several_runs_and_roles_equals_the_reference(tmp_path):
    # uneven ranks per role, a phase named like the remainder (their medians pool), a phase starting with
    # its rank-step's sync row (it counts before it) and a rank-step without a step row
    root = mixed_store(tmp_path)
    for ranks, phases in ((None, None), ("all", None), ([1], None), ([0, 2], ["train", REMAINDER])):
        assert_replays_like_the_reference(root, ranks, phases)
    assert what_if(root).filter(pl.col("run_id") == "b")["role"].unique().sort().to_list() == ["rollout", "trainer"]


def test_alike_rank_steps_take_the_table_path(tmp_path, monkeypatch):
    # every rank-step runs the same phases: the medians come from a (steps × ranks × cells) table, which
    # must equal the general path's grouping by sorting
    run = plant(tmp_path / "p", ranks=4, slow={1: 1.4, 2: 1.7})  # medians between two ranks
    taken = []
    width = medians._uniform_width
    monkeypatch.setattr(medians, "_uniform_width", lambda *a: taken.append(width(*a)) or taken[-1])
    table = what_if(run, by_phase=True)
    assert taken and taken[-1] is not None and table.height == 4 + 4 * 5 + 1  # ranks, (rank, busy phase), all
    with monkeypatch.context() as m:
        m.setattr(medians, "_uniform_width", lambda *a: None)
        assert_frame_equal(table, what_if(run, by_phase=True), rel_tol=1e-12, abs_tol=1e-9)
    assert_replays_like_the_reference(run, [2], None)


def test_rank_numbers_far_apart_replay_like_consecutive_ones(tmp_path):
    def write(path: Path, ranks: tuple[int, ...]) -> Path:
        rng = random.Random(4)
        for r in ranks:
            with RunWriter(path, rank=r) as w:
                for step in range(5):
                    order = [("weight_sync", 2_000, "phase"), ("rollout", rng.randint(20_000, 60_000), "phase"),
                             ("train", rng.randint(5_000, 9_000), "phase"), ("allreduce", 1_000, "comm"),
                             ("optimizer", 2_000, "phase")]
                    rows, t = timing_rows(T0 + step * 10**6, order)
                    w.append("timings", {**rows, "step": step})
                    w.append("timings", {"phase": "step", "category": "step", "step": step,
                                         "start_us": T0 + step * 10**6, "dur_us": t - T0 - step * 10**6 + 500})
                    w.append("samples", {"step": step, "sample_id": [0, 1, 2], "gen_start_us": T0,
                                         "gen_end_us": [T0 + rng.randint(1_000, 9_000) for _ in range(3)]})
        return path

    far, near = write(tmp_path / "far", (0, 3, 90_000)), write(tmp_path / "near", (0, 1, 2))
    got = schedule_inputs(far)
    assert got.height == 5
    assert_frame_equal(got.drop("run_id"), schedule_inputs(near).drop("run_id"))
    rename = pl.col("rank").replace_strict({0: 0, 3: 1, 90_000: 2}, default=None)
    assert_frame_equal(what_if(far, by_phase=True).drop("run_id", "scenario").with_columns(rename),
                       what_if(near, by_phase=True).drop("run_id", "scenario"))


# --- ranks that share devices ---

def reference_what_if_shared(path: Path, ranks: list[int], devices: float, background: float = 0.0,
                             timeslice: float = 1.0) -> dict[tuple, tuple[float, float]]:
    """``what_if_shared`` loop by loop: (run_id, role, step) → (simulated_base_ms, simulated_ms)."""
    con = open_store(path)
    found = con.rows(f"""SELECT run_id, coalesce(role, ''), rank, step, phase, ({STEP_ROW}), {SYNC}, start_us, dur_us
                         FROM timings WHERE ({TOP_LEVEL}) OR ({STEP_ROW})""")
    spans: dict[tuple, tuple[int, int]] = {}
    rows: dict[tuple, list] = defaultdict(list)
    for run_id, role, rank, step, phase, is_step, sync, start, dur in found:
        if is_step:
            spans[(run_id, role, rank, step)] = (start, start + dur)
        else:
            rows[(run_id, role, rank, step)].append((start, dur, phase, sync))

    timeline: dict[tuple, list[tuple[int, int, float]]] = {}  # per (run, role): (from, to, each rank's share)
    for group in {k[:2] for k in spans}:
        busy = [(s, e, 1) for k, (s, e) in spans.items() if k[:2] == group] + [
            (s, s + d, -1) for k, rs in rows.items() if k[:2] == group and k in spans for s, d, _, sync in rs if sync]
        cuts = sorted({x for s, e, _ in busy for x in (s, e)})
        timeline[group] = [(lo, hi, process_share(devices, sum(n for s, e, n in busy if s <= lo < e) + background,
                                                  timeslice)) for lo, hi in zip(cuts, cuts[1:], strict=False)]

    def work(group: tuple, a: float, b: float) -> float:  # ∫ share(busy ranks of the group) over [a, b]
        return sum((min(hi, b) - max(lo, a)) * r for lo, hi, r in timeline[group] if lo < b and hi > a)

    cells: dict[tuple, float] = defaultdict(float)  # (rank-step, seg, phase, sync, is tail) → work or µs
    syncs = {k: sum(r[3] for r in rows[k]) for k in spans}
    for k, (s0, s1) in spans.items():
        seg_of = [sum(o[3] and o[0] < r[0] for o in rows[k]) for r in rows[k]]
        done = 0.0
        for (start, dur, phase, sync), seg in zip(rows[k], seg_of, strict=True):
            w = work(k[:2], start, start + dur)
            done += w
            cells[(k, seg, phase, sync, False)] += dur if sync else w
        cells[(k, max(seg_of, default=0), REMAINDER, False, True)] += work(k[:2], s0, s1) - done
    pooled: dict[tuple, list] = defaultdict(list)
    for (k, seg, phase, sync, _), v in cells.items():
        if not sync:
            pooled[(*k[:2], k[3], seg, phase)].append(v)
    segs: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
    for (k, seg, phase, sync, _), v in cells.items():
        run_id, role, rank, step = k
        new = median(pooled[(run_id, role, step, seg, phase)]) if rank in ranks and not sync else v
        nxt = (run_id, role, rank, step + 1)
        if syncs[k] and seg == syncs[k] and syncs.get(nxt):  # the stretch across the boundary joins step + 1
            step, seg = step + 1, 0
        acc = segs[(run_id, role, step, seg)][rank]
        acc[0 if not sync else 2] += v
        acc[1] += 0.0 if sync else new

    def shared(works: list[float]) -> float:
        t = done = 0.0
        for i, x in enumerate(sorted(works)):
            t += (x - done) / process_share(devices, len(works) - i + background, timeslice)
            done = x
        return t

    out: dict[tuple, list[float]] = defaultdict(lambda: [0.0, 0.0])
    for (run_id, role, step, _), per_rank in segs.items():
        wait = min(a[2] for a in per_rank.values())
        for i in (0, 1):
            out[(run_id, role, step)][i] += (shared([a[i] for a in per_rank.values()]) + wait) / MS
    return {k: (v[0], v[1]) for k, v in out.items()}


@pytest.mark.parametrize(("n_ranks", "devices", "ts"), [(2, 1, 1.0), (3, 2, 0.8), (4, 1.5, 1.0), (4, 3, 0.6)])
def test_shared_replay_equals_the_loop_by_loop_reference(tmp_path, n_ranks, devices, ts):
    run = random_run(tmp_path / "rand", n_ranks, seed=20 + n_ranks)
    ref = reference_what_if_shared(run, [0], devices, background=0.3, timeslice=ts)
    got = what_if_shared(run, ranks=[0], devices=devices, background=0.3, timeslice_efficiency=ts)
    assert got.height == len(ref) == 8
    for row in got.iter_rows(named=True):
        base, new = ref[(row["run_id"], row["role"], row["step"])]
        assert (row["simulated_base_ms"], row["simulated_ms"]) == pytest.approx((base, new), rel=1e-9), row["step"]


def test_what_if_shared_turns_durations_into_work(tmp_path):
    # Two ranks on one device. Rank 0 computes [0, 100] and waits for rank 1, which computes [0, 200]; the
    # all-reduce then costs 4 ms. Both were busy for the first 100 ms (half a device each), so rank 0 did 50
    # device-ms of work and rank 1 50 + 100 = 150. The replay as measured: 50 each at 1/2 (100 ms), rank 1's
    # last 100 alone, + 4 = 204 ms. Replacing rank 0 by the median work (100): [0, 200] both at 1/2, rank 1's
    # last 50 alone, + 4 = 254 ms: a slower rank 0 takes device time from rank 1. A device per rank
    # (what_if_steps) would replace rank 0's 100 ms by the median duration, 150 ms, and keep 204 ms.
    plant_two_busy_ranks(tmp_path / "shared")
    base = what_if_shared(tmp_path / "shared", devices=1)
    assert base["simulated_base_ms"][0] == pytest.approx(204) and base["measured_ms"][0] == pytest.approx(204)
    assert what_if_shared(tmp_path / "shared", ranks=[0], devices=1)["simulated_ms"][0] == pytest.approx(254)
    assert what_if_steps(tmp_path / "shared", ranks=[0])["simulated_ms"][0] == pytest.approx(204)
    # with a device each nobody shares, and it is what_if_steps
    assert what_if_shared(tmp_path / "shared", ranks=[0], devices=2).equals(what_if_steps(tmp_path / "shared", ranks=[0]))


def test_what_if_shared_with_time_slicing(tmp_path):
    # The two ranks above on one device, which time slicing leaves e = 0.5 of while both are busy (0.25
    # each). Rank 0 did 25 device-ms in its 100 ms, rank 1 25 + 100 alone: the replay as measured is
    # 100 + 100 + 4 = 204 ms again. With rank 0 at the median work (75): 75 and 125 at 0.25 each until
    # rank 0 is done at 300, rank 1's last 50 alone: 350 + 4 = 354 ms.
    plant_two_busy_ranks(tmp_path / "shared")
    got = what_if_shared(tmp_path / "shared", ranks=[0], devices=1, timeslice_efficiency=0.5)
    assert got["simulated_base_ms"][0] == pytest.approx(204) and got["simulated_ms"][0] == pytest.approx(354)
