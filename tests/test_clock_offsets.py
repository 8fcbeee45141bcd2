"""A rank on a host whose clock runs 2.5 s ahead, under real torchrun (gloo): ``watch()`` measures its
offset from rank 0 (a sharded run over the time budget's own group; a replicated one when ``clock_sync``
asks), records it, the report names it, and the Perfetto export draws that rank on rank 0's clock."""

from __future__ import annotations

import json
import statistics
import textwrap
from pathlib import Path

import pytest

from dynascope.analyses import clock_offsets, collect_findings
from dynascope.store import open_store
from dynascope.store.perfetto import export_perfetto

from helpers.torchrun import torchrun

AHEAD_MS = 2500.0
# Barrier release on a loaded 2-core machine: the method's own error, far below the planted offset.
TOLERANCE_MS = 400.0

WORKER = textwrap.dedent("""
    import os, sys, time
    if os.environ["RANK"] == "1":  # this host's clock runs ahead: every wall-clock read in the process
        _real = time.time_ns
        time.time_ns = lambda: _real() + int(AHEAD_MS * 1e6)
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.distributed.fsdp import fully_shard
    import dynascope
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    for name, sharded in (("replicated", False), ("sharded", True)):
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if sharded:
            fully_shard(model)  # the time budget's agreement group: measured over it, no setting needed
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        scope = dynascope.watch(model, opt, run=sys.argv[1] + "-" + name, system_interval_s=None,
                                clock_sync=not sharded)
        for _ in range(3):
            model(torch.randn(4, 8)).pow(2).mean().backward()
            if not sharded:  # replicated weights: average the gradients as DDP would
                for p in model.parameters():
                    dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
            dist.barrier()
        scope.close()
    dist.destroy_process_group()
""").replace("AHEAD_MS", repr(AHEAD_MS))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("clocks")
    torchrun(tmp, WORKER, tmp / "run")
    return {name: tmp / f"run-{name}" for name in ("replicated", "sharded")}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["replicated", "sharded"])
def test_offset_measured_recorded_reported_and_aligned(runs: dict[str, Path], layout: str, tmp_path: Path) -> None:
    run = runs[layout]
    df = clock_offsets(run)
    got = {r["rank"]: r for r in df.iter_rows(named=True)}
    assert set(got) == {0, 1}
    assert got[0]["offset_ms"] == 0 and got[1]["reference_rank"] == 0
    assert got[1]["offset_ms"] == pytest.approx(AHEAD_MS, abs=TOLERANCE_MS)
    assert 0 <= got[1]["uncertainty_ms"] < TOLERANCE_MS

    (f,) = [f for f in collect_findings(run)[0] if f.finding == "clock_offset"]
    assert f.severity == "warning" and f.numbers["worst_rank"] == 1
    assert f.numbers["offset_ms"] == pytest.approx(got[1]["offset_ms"], abs=1e-3)
    assert f"rank 1's wall clock was +{got[1]['offset_ms']:.1f} ms from rank 0's" in f.sentence

    # Each step ends at the optimizer boundary, a few ms after the previous step's barrier on every rank:
    # the ranks' step ends (from step 1 on) are the moments to compare, on the raw clocks and on the export's.
    with open_store(run) as store:  # the raw rows: rank 1's steps end ~2.5 s after rank 0's
        ends = {(r, s): e for r, s, e in store.rows(
            "SELECT rank, step, start_us + dur_us FROM timings WHERE category = 'step' AND step >= 1")}
    raw = statistics.median(ends[1, s] - ends[0, s] for (r, s) in ends if r == 0 and (1, s) in ends)
    assert raw / 1e3 == pytest.approx(AHEAD_MS, abs=TOLERANCE_MS)
    out = tmp_path / "trace.json"
    export_perfetto(run, out)
    trace = json.loads(out.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in trace if e.get("name") == "process_name"}
    drawn = {(names[e["pid"]], e["args"]["step"]): e["ts"] + e["dur"] for e in trace
             if e.get("ph") == "X" and e.get("cat") == "step" and e["args"].get("step", 0) >= 1}
    (r0,) = {n for n, _ in drawn if n.startswith("trainer rank 0")}
    (r1,) = {n for n, _ in drawn if n.startswith("trainer rank 1")}
    assert r0 == "trainer rank 0" and r1.endswith("ms, aligned)")
    # on one clock, the ranks' step ends (each a few ms after the same barrier) line up
    aligned = statistics.median(drawn[r1, s] - drawn[r0, s] for (n, s) in drawn if n == r0 and (r1, s) in drawn)
    assert abs(aligned) / 1e3 < TOLERANCE_MS
