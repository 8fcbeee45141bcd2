"""`dynascope import trace`: Kineto traces → timings rows, rank resolution, bad input, GPU breakdowns."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dynascope.analyses import comm_comp_overlap, kernel_type_breakdown, temporal_breakdown
from dynascope.cli import app
from dynascope.importers.trace import import_traces
from dynascope.store import StoreError, open_store

HTA_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "hta"
runner = CliRunner()


def fixture_dir(name: str) -> Path:
    d = HTA_TRACES / name
    if not d.is_dir():
        pytest.skip(f"shared trace fixtures not found at {d}")
    return d


def rows(run: Path, sql: str) -> list[tuple]:
    with open_store(run) as store:
        return store.sql(sql).fetchall()


# ---- a synthetic Kineto trace with hand-checkable contents ---------------------------------------------
def kineto(events: list[dict], *, rank: int | None = None, base_ns: int | None = None, rank_last: bool = False) -> dict:
    """A trace object shaped like Kineto's; distributedInfo before or after the events."""
    doc: dict = {"schemaVersion": 1}
    if rank is not None and not rank_last:
        doc["distributedInfo"] = {"backend": "nccl", "rank": rank, "world_size": 8}
    doc["traceEvents"] = events + [{"ph": "X", "cat": "Trace", "name": "PyTorch Profiler (0)", "pid": "Spans",
                                    "tid": "PyTorch Profiler", "ts": 0, "dur": 10**9}]
    if rank is not None and rank_last:
        doc["distributedInfo"] = {"rank": rank}
    if base_ns is not None:
        doc["baseTimeNanoseconds"] = base_ns
    doc["deviceProperties"] = [{"id": 0, "name": "GPU}, {weird]"}]  # brackets after the array, in strings
    return doc


def step(n: int, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{n}", "pid": 1, "tid": 1, "ts": ts, "dur": dur}


def launch(corr: int, ts: float) -> dict:
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts, "dur": 1,
            "args": {"correlation": corr}}


def kernel(name: str, corr: int, ts: float, dur: float, stream: int = 7, cat: str = "kernel") -> dict:
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"device": 0, "stream": stream, "correlation": corr}}


def synthetic_events() -> list[dict]:
    """Steps 1 [0,100) and 2 [100,200) µs; kernels with launches, one whose launch is missing."""
    return [
        step(1, 0, 100), step(2, 100, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1, "ts": 5, "dur": 3, "args": {"External id": 1}},
        launch(1, 10), kernel("gemm_kernel", 1, 20.25, 10.5),                 # compute [20.25, 30.75)
        launch(2, 40), kernel("ncclDevKernel_AllReduce_Sum", 2, 25, 30),   # comm [25, 55), overlaps gemm
        launch(3, 95), kernel("Memcpy DtoD (Device -> Device)", 3, 105.5, 2, cat="gpu_memcpy"),  # launched in step 1
        kernel("orphan_kernel", 99, 60, 5),                                  # no launch in the trace
        launch(4, 150), kernel("late_kernel", 4, 160, 10),                   # step 2 = the last step
        {"ph": "X", "cat": "gpu_user_annotation", "name": "## forward ##", "pid": 0, "tid": 7, "ts": 20, "dur": 40},
        {"ph": "f", "cat": "ac2g", "name": "ac2g", "id": 1, "pid": 0, "tid": 7, "ts": 20},
    ]


def write(path: Path, doc: dict, *, indent: int | None = None) -> Path:
    data = json.dumps(doc, indent=indent).encode()
    path.write_bytes(gzip.compress(data) if path.name.endswith(".gz") else data)
    return path


def test_synthetic_trace_rows(tmp_path: Path) -> None:
    base = 1_700_000_000_000_000_000
    trace = write(tmp_path / "t.json.gz", kineto(synthetic_events(), rank=5, base_ns=base, rank_last=True), indent=2)
    run = tmp_path / "run"
    res = runner.invoke(app, ["import", "trace", str(trace), "--run", str(run)])
    assert res.exit_code == 0, res.output
    got = {r[0]: r[1:] for r in rows(run, "SELECT phase, rank, step, parent, category, device, stream, start_ns, "
                                          "dur_ns, start_us, dur_us FROM timings")}
    assert got["gemm_kernel"] == (5, 1, "cudaLaunchKernel", "kernel", "cuda:0", 7, base + 20_250, 10_500,
                                  (base + 20_250) // 1000, 11)
    assert got["ncclDevKernel_AllReduce_Sum"][3] == "comm"
    assert got["Memcpy DtoD (Device -> Device)"][1:4] == (1, "cudaLaunchKernel", "memcpy")  # step of its launch
    assert got["orphan_kernel"][2] is None                                                   # launch unknown
    assert got["late_kernel"][1] == 2
    assert got["## forward ##"][3:5] == ("annotation", "cuda:0")
    assert got["ProfilerStep#2"][1:6] == (2, None, "annotation", "cpu", None)
    assert "aten::mm" not in got and "cudaLaunchKernel" not in got and "PyTorch Profiler (0)" not in got


def test_synthetic_breakdowns_by_hand(tmp_path: Path) -> None:
    run = tmp_path / "run"
    import_traces([write(tmp_path / "t.json", kineto(synthetic_events(), rank=0))], run)
    # Last step (2) and the orphan are left out: gemm [20.25,30.75), nccl [25,55), memcpy [105.5,107.5).
    tb = temporal_breakdown(run, rounding="exact").row(0, named=True)
    assert tb["kernel_time_us"] == pytest.approx(107.5 - 20.25)
    assert tb["compute_time_us"] == pytest.approx(10.5)
    assert tb["idle_time_us"] == pytest.approx(87.25 - (55 - 20.25) - 2)
    assert tb["non_compute_time_us"] == pytest.approx(55 - 30.75 + 2)
    assert tb["idle_time_pct"] == pytest.approx(100 * 50.5 / 87.25)
    # HTA's rounding of a trace with fractional µs: gemm becomes [21, 30), memcpy [106, 107).
    hta = temporal_breakdown(run).row(0, named=True)
    assert (hta["kernel_time_us"], hta["compute_time_us"], hta["idle_time_us"], hta["non_compute_time_us"]) == \
        pytest.approx((86, 9, 86 - 34 - 1, 35 - 9))
    everything = temporal_breakdown(run, exclude_last_step=False, rounding="exact").row(0, named=True)
    assert everything["kernel_time_us"] == pytest.approx(170 - 20.25)
    kt = {r["kernel_type"]: r["time_us"] for r in kernel_type_breakdown(run, rounding="exact").to_dicts()}
    assert kt == pytest.approx({"COMPUTATION": 4.75, "COMPUTATION overlapping COMMUNICATION": 5.75,
                                "COMMUNICATION": 24.25, "MEMORY": 2.0})
    ov = comm_comp_overlap(run, rounding="exact").row(0, named=True)
    assert ov["overlap_pct"] == pytest.approx(100 * 5.75 / 30)
    # A store root with two runs: one row per run, and run= picks one.
    import_traces([write(tmp_path / "u.json", kineto(synthetic_events()[:5], rank=0))], tmp_path / "other")
    both = temporal_breakdown(tmp_path)
    assert sorted(both["run_id"].to_list()) == ["other", "run"]
    assert temporal_breakdown(tmp_path, run="run").drop("run_id").equals(temporal_breakdown(run).drop("run_id"))


def test_rank_from_metadata_name_and_order(tmp_path: Path) -> None:
    ev = synthetic_events()
    (tmp_path / "a").mkdir()
    write(tmp_path / "a" / "x.json", kineto(ev, rank=4))
    write(tmp_path / "a" / "worker_rank_2.json", kineto(ev))
    write(tmp_path / "a" / "rank-7.trace.json.gz", kineto(ev))
    res = import_traces([tmp_path / "a"], tmp_path / "r1")
    assert {r: p.name for r, p in res.files.items()} == {
        4: "x.json", 2: "worker_rank_2.json", 7: "rank-7.trace.json.gz"}
    plain = [write(tmp_path / f"{c}.json", kineto(ev)) for c in "pq"]
    res = import_traces(plain, tmp_path / "r2")
    assert sorted(res.files) == [0, 1]
    assert rows(tmp_path / "r2", "SELECT DISTINCT rank FROM timings ORDER BY 1") == [(0,), (1,)]


def test_cut_points_do_not_change_the_rows(tmp_path: Path) -> None:
    # Names and args full of "}, {" make many cut candidates fall inside strings or nested objects.
    ev = [step(1, 0, 1000), step(2, 1000, 10)]
    for i in range(60):
        name = ['lambda()#1}, {lambda()#2', 'x\\"}, {"ph": "X"', "ünï}, {cödé]"][i % 3] + f"_{i}"
        k = kernel(name, i, 10 + i, 0.5 + i / 1000)
        k["args"]["nested"] = [{"a": "}, {"}, {"b": [1, {"c": "]"}]}]
        ev += [launch(i, 5 + i), k]
    trace = write(tmp_path / "t.json", kineto(ev, rank=0), indent=1)
    q = "SELECT count(*), sum(hash(phase, start_ns, dur_ns, step, parent, stream, category)) FROM timings"
    a = import_traces([trace], tmp_path / "one_chunk")
    b = import_traces([trace], tmp_path / "many_chunks", block=700)
    assert a.rows == b.rows == {"annotation": 2, "kernel": 60}
    assert rows(tmp_path / "one_chunk", q) == rows(tmp_path / "many_chunks", q)
    names = {r[0] for r in rows(tmp_path / "many_chunks", "SELECT phase FROM timings WHERE category = 'kernel'")}
    assert names == {e["name"] for e in ev if e["cat"] == "kernel"}


def test_cut_points_on_a_real_trace(tmp_path: Path) -> None:
    src = fixture_dir("nccl_parser_config")
    q = "SELECT count(*), sum(hash(phase, start_ns, dur_ns, step, parent, stream, category)) FROM timings"
    a = import_traces([src], tmp_path / "big")
    b = import_traces([src], tmp_path / "small", block=1 << 20)
    assert a.rows == b.rows
    assert rows(tmp_path / "big", q) == rows(tmp_path / "small", q)


def test_fixture_counts_match_the_json(tmp_path: Path) -> None:
    src = fixture_dir("trace_filter")
    res = runner.invoke(app, ["import", "trace", str(src), "--run", str(tmp_path / "run")])
    assert res.exit_code == 0, res.output
    for rank in (0, 1):
        doc = json.loads(gzip.open(src / f"sampled_rank-{rank}.json.gz").read())
        ev = [e for e in doc["traceEvents"] if "dur" in e and e.get("cat") not in (None, "Trace")]
        gpu = sum(1 for e in ev if isinstance(e.get("args", {}).get("stream"), int))
        ann = sum(1 for e in ev if e["cat"] in ("user_annotation", "gpu_user_annotation"))
        got = dict(rows(tmp_path / "run", f"SELECT category = 'annotation', count(*) FROM timings "
                                          f"WHERE rank = {rank} GROUP BY 1"))
        assert got == {False: gpu, True: ann}
    assert rows(tmp_path / "run", "SELECT DISTINCT step FROM timings ORDER BY 1") == [(551,), (552,)]


BAD = {
    "truncated gzip": lambda d: (d / "t.json.gz").write_bytes(gzip.compress(json.dumps(kineto(synthetic_events())).encode())[:300]),
    "truncated json": lambda d: (d / "t.json").write_text(json.dumps(kineto(synthetic_events()), indent=1)[:-40]),
    "not a trace": lambda d: (d / "t.json").write_text('{"loss": [1, 2, 3]}'),
    "array top level": lambda d: (d / "t.json").write_text("[1, 2]"),
    "traceEvents not a list": lambda d: (d / "t.json").write_text('{"traceEvents": {"a": 1}}'),
    "not json": lambda d: (d / "t.json").write_text("hello"),
    "bad event": lambda d: (d / "t.json").write_text('{"traceEvents": [{"ts": 1, "dur": 2, "cat": "kernel"}, nope]}'),
    "same rank twice": lambda d: [write(d / f"{c}.json", kineto(synthetic_events(), rank=3)) for c in "ab"],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_and_nothing_imported(tmp_path: Path, case: str) -> None:
    src = tmp_path / "src"
    src.mkdir()
    BAD[case](src)
    good = write(tmp_path / "good.json", kineto(synthetic_events(), rank=0))
    for run in (tmp_path / "new_run", tmp_path / "existing"):
        if run.name == "existing":
            import_traces([good], run)  # a run that already has data, then a failing second import
            shutil.rmtree(next((run / "timings").glob("writer=trace-import-*")))
            before = sorted(p.relative_to(run) for p in run.rglob("*") if "_writers" not in p.parts)
        res = runner.invoke(app, ["import", "trace", str(src), "--run", str(run)])
        assert res.exit_code == 2, res.output
        assert res.output.strip().startswith("error") and len(res.output.strip().splitlines()) == 1, res.output
        if run.name == "new_run":
            assert not run.exists()
        else:
            assert sorted(p.relative_to(run) for p in run.rglob("*") if "_writers" not in p.parts) == before
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # staging cleaned up


def test_reimport_into_same_run_is_refused(tmp_path: Path) -> None:
    t = write(tmp_path / "t.json", kineto(synthetic_events(), rank=0))
    import_traces([t], tmp_path / "run")
    with pytest.raises(StoreError, match="already holds an imported trace"):
        import_traces([t], tmp_path / "run")


def test_trace_without_gpu_activity_gives_one_clear_error(tmp_path: Path) -> None:
    # HTA 0.5 raises IndexError here; the trace holds only CUPTI profiler-range counters, no GPU timeline.
    res = import_traces([fixture_dir("cupti_profiler")], tmp_path / "run")
    assert res.files and "kernel" not in res.rows
    for fn in (temporal_breakdown, kernel_type_breakdown, comm_comp_overlap):
        with pytest.raises(StoreError, match="no GPU activity rows") as err:
            fn(tmp_path / "run")
        assert "\n" not in str(err.value)
