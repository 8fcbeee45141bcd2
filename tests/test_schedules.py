"""Schedule what-if on planted synchronous runs written with the real RunWriter and read back through DuckDB.

Every run below has fixed phase durations, so each schedule's step time follows in closed form (derived
in the comments) and the replay must reproduce it exactly.
"""

from __future__ import annotations

import polars as pl
import pytest

import dynascope.analyses
import dynascope.analyses.what_if_schedule as schedules
from dynascope.analyses._schedule_replay import Pieces, Pool, replay
from dynascope.analyses._what_if_load import process_share
from dynascope.analyses.what_if_schedule_inputs import schedule_inputs
from dynascope.store import RunWriter

from helpers.planted_timings import STEPS, T0, plant


def rows(df: pl.DataFrame) -> dict[str, dict]:
    return {r["schedule"]: r for r in df.iter_rows(named=True)}


def test_inputs_split_each_step_into_its_pieces(tmp_path):
    run = plant(tmp_path / "one", eval_ms=300.0)
    inp = schedule_inputs(run)
    assert inp.height == STEPS and set(inp["ranks"]) == {1}
    assert inp["sync_ms"].to_list() == [5.0] * STEPS and inp["rollout_ms"].to_list() == [100.0] * STEPS
    assert inp["pre_ms"].to_list() == [300.0] + [0.0] * (STEPS - 1)  # the evaluation came before the rollout
    assert inp["train_ms"].to_list() == [55.0] * STEPS  # train + optimizer + the gap nobody timed
    assert inp["replayed_ms"].to_list() == inp["measured_ms"].to_list()
    assert inp["samples_count"].to_list() == [8] * STEPS


def test_sync_replay_reproduces_the_measured_steps(tmp_path):
    df = rows(schedules.schedule_what_if(plant(tmp_path / "one")))
    s = df["sync"]
    assert s["step_ms"] == pytest.approx(5 + 100 + 40 + 10 + 5) and s["calibration_error_pct"] == pytest.approx(0, abs=1e-9)
    assert s["samples_per_s"] == pytest.approx(8 / 0.160)
    assert s["trainer_idle_pct"] == pytest.approx(100 * 105 / 160) and s["rollout_idle_pct"] == pytest.approx(100 * 55 / 160)
    assert s["weight_sync_ms"] == pytest.approx(5) and s["weight_sync_exposed_pct"] == pytest.approx(100 * 5 / 160)
    assert s["speedup_x"] == 1.0 and s["staleness_max"] == 0


def test_one_step_off_policy_rollout_bound(tmp_path):
    # Two devices for the one rank's two processes: no sharing. W=5, R=100, T'=55 (train+opt+gap).
    # Batch 0: load+generate [0, 105]; batch 1 starts at once with version 0 (no load): [105, 205];
    # batch k ≥ 2 waits for version k−1, which is out before the worker is free, and loads it: +105 each.
    # The last batch ends at 10·105 − 5, then trains for 55: makespan 1100 ms; staleness 1 except batch 0.
    df = rows(schedules.schedule_what_if(plant(tmp_path / "one"), devices=2))
    b = df["one_step_off_policy"]
    assert b["step_ms"] == pytest.approx(1100 / STEPS)
    assert b["staleness_mean"] == pytest.approx(0.9) and b["staleness_max"] == 1
    assert b["stale_samples_pct"] == pytest.approx(90)
    assert b["speedup_x"] == pytest.approx(160 * STEPS / 1100)
    assert b["weight_sync_ms"] == pytest.approx(5 * 9 / STEPS)  # batch 1 reuses version 0
    # The trainer only waits for weights while the first one loads (5 ms): the others overlap training.
    assert b["weight_sync_exposed_pct"] == pytest.approx(100 * 5 / 1100)


def test_weight_transfer_between_processes(tmp_path):
    # The run of test_one_step_off_policy_rollout_bound (W=5, R=100, T'=55, 2 devices), with publishing at
    # P=10 per version on the trainer: version 0 is out at 10, so every batch starts 10 ms later, and the
    # trainer's 55 + 10 stays under the worker's 105: makespan 1100 + 10. Ten publishes (version 0 and
    # after each update but the last) and nine loads: 14.5 ms per trained batch; the trainer idles through
    # the first load and publishes for 100 ms: 105 ms exposed.
    run = plant(tmp_path / "one")
    b = rows(schedules.schedule_what_if(run, devices=2, publish_ms=10))["one_step_off_policy"]
    assert b["step_ms"] == pytest.approx(1110 / STEPS)
    assert b["weight_sync_ms"] == pytest.approx((10 * 10 + 9 * 5) / STEPS)
    assert b["weight_sync_exposed_pct"] == pytest.approx(100 * 105 / 1110)
    assert "publish_ms=10" in b["params"]
    # Loads at L=20 instead of the measured 5: batch 0 is ready at 10 + 120, batch 1 (version 0 again) at
    # 230, every later one loads and takes 120: 230 + 8·120 = 1190, trained by 1245.
    b = rows(schedules.schedule_what_if(run, devices=2, publish_ms=10, load_ms=20))["one_step_off_policy"]
    assert b["step_ms"] == pytest.approx(1245 / STEPS)
    # The synchronous replay keeps the measured copy: its calibration does not move.
    s = rows(schedules.schedule_what_if(run, devices=2, publish_ms=10, load_ms=20))["sync"]
    assert s["step_ms"] == pytest.approx(160) and s["weight_sync_ms"] == pytest.approx(5)
    with pytest.raises(ValueError, match="publish_ms"):
        schedules.schedule_what_if(run, publish_ms=-1)


def test_one_step_off_policy_train_bound(tmp_path):
    # W=5, R=50, T'=80: the trainer is the bottleneck: 55 ms until batch 0 exists, then 10 × 80 ms.
    df = rows(schedules.schedule_what_if(plant(tmp_path / "one", rollout_ms=50.0, train_ms=65.0), devices=2))
    b = df["one_step_off_policy"]
    assert b["step_ms"] == pytest.approx((55 + STEPS * 80) / STEPS)
    assert b["trainer_idle_pct"] == pytest.approx(100 * 55 / 855)


def test_colocated_overlap_on_one_device_gains_nothing(tmp_path):
    # One device shared by trainer and worker: overlapping halves both rates, so with W=0 and R = T' = 100
    # batch 0 generates alone (100), every pair (train k, generate k+1) takes 200, the last trains alone
    # (100): 200·n, the synchronous time. Processor sharing conserves work.
    run = plant(tmp_path / "one", rollout_ms=100.0, train_ms=90.0, opt_ms=5.0, gap_ms=5.0, sync_ms=0.0)
    b = rows(schedules.schedule_what_if(run, devices=1))["one_step_off_policy"]
    assert b["step_ms"] == pytest.approx(200.0)


def test_async_two_workers_with_staleness_one(tmp_path):
    # W=5, R=100, T'=30 (train 20), 3 devices. Both workers start at 0 with version 0; batches 0 and 1 are
    # ready at 105 and train back to back (versions 1, 2 at 135, 165). The bound holds batch 2 until version
    # 1 (135) and batch 3 until version 2 (165); each loads its version: ready at 240 and 270, trained by
    # 300. Every further pair repeats 135 ms later: the last pair is trained at 165 + 4·135 = 705 ms.
    run = plant(tmp_path / "one", train_ms=15.0)
    c = rows(schedules.schedule_what_if(run, devices=3, workers=2, staleness=1))["async"]
    assert c["step_ms"] == pytest.approx(705 / STEPS)
    assert c["staleness_max"] == 1 and c["staleness_mean"] == pytest.approx(0.9)
    assert c["dropped_batches_count"] == 0
    # A bound no batch reaches lets both workers run free: rounds of two batches take 105 ms, except the
    # second (version 0 is still the newest: no load), so the last pair is ready at 520 and trained by 580.
    # Staleness: batch 0 → 0, batch 1 → 1, then 2 and 3 alternately (each pair made with one version).
    free = rows(schedules.schedule_what_if(run, devices=3, workers=2, staleness=100))["async"]
    assert free["step_ms"] == pytest.approx(580 / STEPS)
    assert free["staleness_max"] == 3 and free["staleness_mean"] == pytest.approx(2.1)


def test_drop_policy_wastes_stale_batches(tmp_path):
    run = plant(tmp_path / "one", train_ms=15.0)
    blocked = rows(schedules.schedule_what_if(run, devices=3, workers=2, staleness=0))["async"]
    dropped = rows(schedules.schedule_what_if(run, devices=3, workers=2, staleness=0, staleness_policy="drop"))["async"]
    assert blocked["staleness_max"] == 0 and dropped["staleness_max"] == 0
    assert blocked["dropped_batches_count"] == 0 and dropped["dropped_batches_count"] > 0
    # With bound 0 and blocking, a worker waits for each version: the synchronous step exactly.
    assert blocked["step_ms"] == pytest.approx(135.0)
    # Dropping: batches 0 and 1 are made with version 0; batch 1 is one version stale when its turn comes.
    assert dropped["step_ms"] > blocked["step_ms"]


def test_tail_cut_and_partial_rollout(tmp_path):
    # Generations 6 × 40, 80, 100 ms from the rollout's start. p=50: the cut is the median, 40 ms, so the
    # rollout ends 60 ms early and 2 of 8 samples (25 %) are truncated. Partial rollout carries them on:
    # they need 60 ms more, so from step 1 on the rollout lasts max(40, 60) = 60 ms.
    run = plant(tmp_path / "one")
    df = rows(schedules.schedule_what_if(run, tail_pct=50))
    cut, part = df["tail_cut"], df["partial_rollout"]
    assert cut["step_ms"] == pytest.approx(160 - 60) and cut["truncated_pct"] == pytest.approx(25)
    assert part["step_ms"] == pytest.approx(160 - 60 + 20 * (STEPS - 1) / STEPS)
    assert part["carried_pct"] == pytest.approx(25)
    # Samples trained: 6 in step 0, then 6 fresh + 2 carried (staleness 1) per step.
    assert part["stale_samples_pct"] == pytest.approx(100 * 2 * 9 / (6 + 8 * 9))
    assert part["samples_per_s"] == pytest.approx((6 + 8 * 9) / ((100 + 9 * 120) / 1e3))
    inp = schedule_inputs(run, tail_pct=50)
    assert inp["tail_samples_count"].to_list() == [2] * STEPS
    assert inp["carried_in_count"].to_list() == [0] + [2] * (STEPS - 1)


def test_split_devices(tmp_path):
    # Rollout and training on one device each is the two-device one-step schedule with one worker.
    run = plant(tmp_path / "one")
    df = rows(schedules.schedule_what_if(run, devices=2, workers=1, rollout_devices=1, train_devices=1))
    assert df["split"]["step_ms"] == pytest.approx(1100 / STEPS)
    # Twice the rollout devices halve generation (linear scaling): W+R = 52.5 per batch and training (55)
    # bounds: 52.5 until batch 0 exists, then 10 × 55.
    df = rows(schedules.schedule_what_if(run, devices=3, workers=1, rollout_devices=2, train_devices=1))
    assert df["split"]["step_ms"] == pytest.approx((52.5 + STEPS * 55) / STEPS)


def test_background_load_slows_every_schedule(tmp_path):
    # Measured alone on 2 devices (rate 1); with 3 other runnable processes the rank gets 2/4 of a device.
    run = plant(tmp_path / "one")
    df = rows(schedules.schedule_what_if(run, devices=2, target_background=3))
    assert df["sync"]["step_ms"] == pytest.approx(320.0) and df["sync"]["calibration_error_pct"] == pytest.approx(0)
    assert df["tail_cut"]["step_ms"] == pytest.approx(2 * rows(schedules.schedule_what_if(run))["tail_cut"]["step_ms"])


def test_data_parallel_ranks_replay_the_slowest(tmp_path):
    # Rank 1 trains 1.5× longer; the others wait in the all-reduce, whose own cost is 4 ms.
    run = plant(tmp_path / "dp", ranks=2, slow={1: 1.5})
    inp = schedule_inputs(run)
    assert set(inp["ranks"]) == {2}
    # The 15 ms after each all-reduce (optimizer, gap) and the next step's work up to its all-reduce are one
    # stretch between collectives, counted in the next step: step 0 lacks its tail, the last has two.
    assert inp["replayed_ms"].to_list() == pytest.approx([169.0] + [184.0] * (STEPS - 2) + [199.0])
    assert inp["train_ms"].to_list() == pytest.approx([64.0] + [60 + 4 + 10 + 5] * (STEPS - 2) + [94.0])
    s = rows(schedules.schedule_what_if(run))["sync"]
    assert s["step_ms"] == pytest.approx(5 + 100 + 60 + 4 + 10 + 5) and s["calibration_error_pct"] < 1e-9


def test_rl_throughput_and_staleness_frames(tmp_path):
    run = plant(tmp_path / "one")
    th = schedules.rl_throughput(run)
    assert th["samples_count"][0] == 8 * STEPS and th["step_ms"][0] == pytest.approx(160)
    st = schedules.schedule_staleness(run, devices=2)
    one = st.filter(pl.col("schedule") == "one_step_off_policy").sort("staleness")
    assert one["staleness"].to_list() == [0, 1] and one["samples_count"].to_list() == [8, 72]
    assert one["share_pct"].sum() == pytest.approx(100)
    with pytest.raises(TypeError):
        schedules.schedule_staleness(run, workerz=2)


def test_registered_and_empty(tmp_path):
    assert dynascope.analyses.schedule_what_if is schedules.schedule_what_if
    with RunWriter(tmp_path / "sft", rank=0) as w:  # no rollout phase: not an RL run
        w.append("timings", {"phase": ["train", "step"], "category": ["phase", "step"], "step": 0,
                             "start_us": T0, "dur_us": [10, 20]})
    df = schedules.schedule_what_if(tmp_path / "sft")
    assert df.is_empty() and df.columns == list(schedules._SCHEMA)
    with pytest.raises(ValueError):
        schedules.schedule_what_if(plant(tmp_path / "one"), staleness_policy="sometimes")


def test_replay_shares_devices_between_processes():
    # Two workers and a trainer, one device each at most, on two devices. Rollout 200, training 100, no
    # weight sync, no bound. [0, 200]: both workers generate alone. Then three processes share two devices
    # at 2/3 each: the trainer's 100 takes 150 (to 350) while the workers get 100 of their 200 done; the
    # next 150 finishes the second training and both generations (500): a period of 300 per two batches.
    # Batches 4 and 5 are generated by 800; the workers stop (nothing left to make) and the last two
    # trainings run alone at full speed: 800 + 2·100 = 1000 µs, the trainer busy 4·150 + 2·100.
    n = 6
    p = Pieces(*(pl.Series([v] * n).to_numpy().astype(float) for v in (0.0, 0.0, 200.0, 100.0, 1.0)))
    r = replay(p, pools=[Pool(2)], trainer_pool=0, trainer_procs=1, worker_pool=0, worker_procs=1, workers=2,
               staleness=100, policy="block", rate=1.0)
    assert r.trained == n and r.makespan_us == pytest.approx(1000)
    assert r.trainer_busy_us == pytest.approx(800) and r.staleness == [0, 1, 2, 3, 2, 3]
    # one more process in the background: four on two devices, 1/2 each, while all are busy
    r = replay(p, pools=[Pool(2, background=1)], trainer_pool=0, trainer_procs=1, worker_pool=0, worker_procs=1,
               workers=2, staleness=100, policy="block", rate=1.0)
    assert r.makespan_us > 1000


def test_time_slicing_costs_an_oversubscribed_pool(tmp_path):
    # The run of test_colocated_overlap_on_one_device_gains_nothing (R = T' = 100, W = 0, one device), with
    # time slicing keeping e = 0.8 of a device its two processes share: each runs at 0.8/2 = 0.4 while both
    # are busy. Batch 0 generates alone (100), every pair (train k, generate k+1) takes 100/0.4 = 250, the
    # last trains alone (100): 100 + 9·250 + 100 = 2450 ms. The synchronous run had one process on its
    # device, so its replay is unchanged.
    run = plant(tmp_path / "one", rollout_ms=100.0, train_ms=90.0, opt_ms=5.0, gap_ms=5.0, sync_ms=0.0)
    df = rows(schedules.schedule_what_if(run, devices=1, timeslice_efficiency=0.8))
    assert df["one_step_off_policy"]["step_ms"] == pytest.approx(2450 / STEPS)
    assert df["sync"]["step_ms"] == pytest.approx(200.0) and df["sync"]["calibration_error_pct"] == pytest.approx(0)
    assert "timeslice_efficiency=0.8" in df["one_step_off_policy"]["params"]
    # the loss grows with the excess up to one process, then stays: 2 devices, 2.5 and 3 and 4 processes
    assert process_share(2, 2, 0.8) == 1.0 and process_share(2, 2.5, 0.8) == pytest.approx(0.9 * 2 / 2.5)
    assert process_share(2, 3, 0.8) == pytest.approx(0.8 * 2 / 3) and process_share(2, 4, 0.8) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="timeslice_efficiency"):
        schedules.schedule_what_if(run, devices=1, timeslice_efficiency=0)
