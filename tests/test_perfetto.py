"""``dynascope export --perfetto``: the Chrome-trace file holds every timing row and event, on tracks per
(role, rank) and stream, with slices that nest, and HTA's own trace parser reads the same durations back."""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from pathlib import Path

import pytest

from dynascope.importers.trace import import_traces
from dynascope.store import StoreError, open_store
from dynascope.store.perfetto import _Track, export_perfetto

from helpers.planted_timings import plant

HTA_TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces" / "hta"


def _load(path: Path) -> dict:
    doc = json.loads(path.read_text())
    assert isinstance(doc["traceEvents"], list) and isinstance(doc["baseTimeNanoseconds"], int)
    return doc


def _names(events: list[dict]) -> tuple[dict[int, str], dict[tuple[int, int], str]]:
    procs = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    return procs, threads


def _assert_nested(events: list[dict]) -> None:
    """On every thread track, any two slices are disjoint or one contains the other (what the viewer needs)."""
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            by_track[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for track, spans in by_track.items():
        open_ends: list[float] = []
        for t0, t1 in sorted(spans, key=lambda s: (s[0], -s[1])):
            while open_ends and open_ends[-1] <= t0:
                open_ends.pop()
            assert not open_ends or t1 <= open_ends[-1] + 1e-3, f"slice [{t0}, {t1}] straddles on {track}"
            open_ends.append(t1)


def test_lanes_keep_nesting_and_move_straddlers() -> None:
    track = _Track()
    assert [track.place(0, 100), track.place(10, 50), track.place(20, 30), track.place(60, 90)] == [0, 0, 0, 0]
    assert track.place(80, 120) == 1      # starts inside [60, 90] and ends after it: beside, not under
    assert track.place(130, 140) == 0     # after everything: the first lane again


def test_probe_run_every_row_on_its_rank_and_step(tmp_path: Path) -> None:
    run = plant(tmp_path / "run", ranks=2, slow={1: 3.0})
    out = tmp_path / "run.json"
    counts = export_perfetto(run, out)
    doc = _load(out)
    events = doc["traceEvents"]
    procs, threads = _names(events)
    assert sorted(procs.values()) == ["trainer rank 0", "trainer rank 1"]
    assert set(threads.values()) == {"host"}

    with open_store(run) as store:
        want = store.rows("SELECT role, rank, phase, count(*), sum(dur_us) FROM timings GROUP BY ALL")
        steps = store.rows("SELECT count(*) FROM timings WHERE category = 'step'")[0][0]
        n_rows = store.rows("SELECT count(*) FROM timings")[0][0]
    got: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0])
    for e in events:
        if e["ph"] == "X":
            got[(procs[e["pid"]], e["name"])][0] += 1
            got[(procs[e["pid"]], e["name"])][1] += e["dur"]
    assert len(got) == len(want)
    for role, rank, phase, n, total_us in want:
        n_got, us_got = got[(f"{role} rank {rank}", phase)]
        assert n_got == n and us_got == pytest.approx(total_us, abs=1e-3)
    assert counts["slices"] == n_rows
    step_marks = [e for e in events if e["ph"] == "i" and e["cat"] == "step"]
    assert len(step_marks) == steps
    # The slow rank's train slices are 3x the others', where the run planted them.
    train = {procs[e["pid"]]: e["dur"] for e in events if e["ph"] == "X" and e["name"] == "train"}
    assert train["trainer rank 1"] == pytest.approx(3 * train["trainer rank 0"])
    _assert_nested(events)


def test_quick_demo_exports_phases_nested_and_events(quick_demo: tuple[Path, str], tmp_path: Path) -> None:
    run, _ = quick_demo
    out = tmp_path / "demo.json"
    counts = export_perfetto(run, out)
    events = _load(out)["traceEvents"]
    with open_store(run) as store:
        n_rows = store.rows("SELECT count(*) FROM timings")[0][0]
        n_events = store.rows("SELECT count(*) FROM events WHERE time_us IS NOT NULL")[0][0]
        steps = store.rows("SELECT count(*) FROM timings WHERE category = 'step'")[0][0]
    assert counts["slices"] == n_rows == sum(e["ph"] == "X" for e in events) > 0
    assert counts["instants"] == n_events + steps
    _assert_nested(events)
    # A phase is drawn inside the step it belongs to: same track, within the step's slice.
    slices = [e for e in events if e["ph"] == "X"]
    step_span = {(e["pid"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"]) for e in slices if e["cat"] == "step"}
    inside = [e for e in slices if e["cat"] != "step" and (e["pid"], e["args"].get("step")) in step_span]
    assert inside
    within = sum(step_span[(e["pid"], e["args"]["step"])][0] - 1e-3 <= e["ts"]
                 and e["ts"] + e["dur"] <= step_span[(e["pid"], e["args"]["step"])][1] + 1e-3 for e in inside)
    assert within / len(inside) > 0.9


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore")
def test_imported_kineto_trace_reads_back_in_hta(tmp_path: Path) -> None:
    """Import a real multi-rank Kineto trace, export it, and parse the export with HTA's trace parser: per
    rank and stream, the same number of GPU events and the same total time as the store holds."""
    if not (HTA_TRACES / "trace_filter").is_dir():
        pytest.skip(f"shared trace fixtures not found at {HTA_TRACES}")
    parser = pytest.importorskip("hta.common.trace_parser")
    config = pytest.importorskip("hta.configs.parser_config")
    logging.getLogger("hta").setLevel(logging.ERROR)
    run = tmp_path / "run"
    import_traces([HTA_TRACES / "trace_filter"], run)
    out = tmp_path / "trace.json"
    export_perfetto(run, out)
    procs, _ = _names(_load(out)["traceEvents"])
    _, df, symbols = parser.parse_trace_dataframe(str(out), config.ParserConfig())
    names = symbols.get_sym_table()
    df = df[df["stream"] >= 0]
    got = {(procs[int(p)], int(s)): (len(g), float(g["dur"].sum())) for (p, s), g in df.groupby(["pid", "stream"])}
    with open_store(run) as store:
        want = store.rows("SELECT role, rank, stream, count(*), sum(dur_ns) / 1000 FROM timings "
                          "WHERE stream IS NOT NULL GROUP BY ALL")
    assert len(got) == len(want) > 1
    for role, rank, stream, n, total_us in want:
        n_got, us_got = got[(f"{role} rank {rank}", stream)]
        # HTA rounds ns-resolution times down to whole µs per event (pytorch#122425): within 1 µs each.
        assert n_got == n and abs(us_got - total_us) <= n
    assert any("cutlass" in names[i] for i in df["name"].unique())


def test_refuses_to_overwrite_and_bad_paths(tmp_path: Path) -> None:
    run = plant(tmp_path / "run")
    out = tmp_path / "t.json"
    out.write_text("mine")
    with pytest.raises(StoreError, match="already exists"):
        export_perfetto(run, out)
    assert out.read_text() == "mine"
    with pytest.raises(StoreError, match="no such directory"):
        export_perfetto(run, tmp_path / "nope" / "t.json")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "t.json"]  # no temporary left behind
