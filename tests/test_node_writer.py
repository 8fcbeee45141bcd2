"""One writer per node (``store.node``): the node's ranks hand their flushes to one writer, which writes them
with its own. Every rank's rows land once, stamped with that rank, and the rollups over them are exact; a
node writer that closes or is killed leaves a sender to take its place, one that never answers leaves its
senders writing their own files for a while, and no row is written twice."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa

from dynascope.store import RunWriter, node, open_store
from dynascope.store.buffer import ARROW, TableBuffer, to_arrow
from dynascope.store.node import NodeLink, NodeServer, address
from dynascope.store.schema import TABLES

from helpers.rollup_reference import NAIVE, ROLLED, batch, same
from helpers.torchrun import torchrun
from helpers.waiting import wait_until


def _timing(w: RunWriter, step: int) -> None:
    w.append("timings", {"step": step, "phase": "fwd", "category": "compute", "start_us": step * 1000,
                         "dur_us": 10 + w.rank})


def _train_until(ws: list[RunWriter], step: int, done: Callable[[], object], what: str) -> int:
    """Training goes on, a step of every writer per poll, until ``done``; returns the next step."""
    def one() -> object:
        nonlocal step
        for w in ws:
            _timing(w, step)
        step += 1
        return done()
    wait_until(one, what, interval_s=0.02)
    return step


def _taker(ws: list[RunWriter]) -> RunWriter | None:
    """The sender that took the node writer's place, once one has."""
    return next((w for w in ws if isinstance(w.node, NodeServer)), None)


def _steps_by_rank(run: Path) -> dict[int, list[int]]:
    with open_store(run) as con:
        rows = con.rows("SELECT rank, step FROM timings ORDER BY rank, step")
    out: dict[int, list[int]] = {}
    for rank, step in rows:
        out.setdefault(rank, []).append(step)
    return out


def _writer_dirs(run: Path, table: str) -> set[str]:
    return {p.name for p in (run / table).iterdir() if p.name not in ("writer=_schema", "writer=_merged")}


def _events(run: Path, kind: str) -> list[tuple[int, dict]]:
    with open_store(run) as con:
        rows = con.rows(f"SELECT rank, fields_json FROM events WHERE event = '{kind}' ORDER BY rank")
    return [(r, json.loads(f or "{}")) for r, f in rows]


def test_a_node_writes_one_writers_files_with_every_ranks_rows(tmp_path: Path) -> None:
    run, key = tmp_path / "run", uuid.uuid4().hex
    ws = [RunWriter(run, rank=r, world_size=8, flush_secs=0.05, seal_secs=0.5, node=key) for r in range(8)]
    assert isinstance(ws[0].node, NodeServer) and all(isinstance(w.node, NodeLink) for w in ws[1:])
    rng = np.random.default_rng(0)
    seen: set[str] = set()
    for step in range(120):
        for w in ws:
            _timing(w, step)
            if step % 10 == 0:
                w.append("tensor_stats", batch(rng, step, 12, with_drift=step % 20 == 0))
        if step % 30 == 29:  # while it runs, the node holds one writer's directory per table
            sent = step + 1 + 12 * (step // 10 + 1)
            wait_until(lambda n=sent: all(w.node.rows_forwarded >= n for w in ws[1:]), "the senders' flushes")
            seen |= _writer_dirs(run, "timings") | _writer_dirs(run, "tensor_stats")
    assert seen == {f"writer={ws[0].writer_id}"}
    for w in ws[1:]:  # the senders close first, the node writer last: the run's fold is its
        w.close()
    ws[0].close()
    assert _steps_by_rank(run) == {r: list(range(120)) for r in range(8)}  # every rank's rows, once
    with open_store(run) as con:
        gens = dict(con.rows("SELECT rank, any_value(generation) FROM tensor_stats GROUP BY rank"))
        assert gens == {w.rank: w.generation for w in ws}
        naive, rolled = con.rows(NAIVE), con.rows(ROLLED)  # the node writer's rollups over every rank's rows
    assert len(naive) == len(rolled) > 0
    assert all(same(a, b) for x, y in zip(naive, rolled, strict=True) for a, b in zip(x, y, strict=True))
    ends = dict(_events(run, "run_end"))
    # each sender's run_end row is itself handed over after it was written
    assert ws[0].node.rows_received == sum(w.node.rows_forwarded for w in ws[1:]) == sum(
        ends[r]["node_rows_forwarded"] + 1 for r in range(1, 8))
    assert ends[0]["node"] == "writer" and ends[0]["node_senders"] == 7
    assert all(ends[r]["node"] == "sender" and ends[r]["node_rows_forwarded"] > 0 for r in range(1, 8))
    assert [p.name for p in (run / "_commits").iterdir()] == [f"writer={ws[0].writer_id}"]


def test_a_sender_takes_the_place_of_a_node_writer_that_closes(tmp_path: Path, monkeypatch) -> None:
    # The node writer's rank finishes first: a sender binds the name it freed and the others hand over to it.
    monkeypatch.setattr(node, "RETRY_S", 0.5)  # a sender that fell back on a loaded host comes back soon
    run, key = tmp_path / "run", uuid.uuid4().hex
    ws = [RunWriter(run, rank=r, world_size=4, flush_secs=0.05, node=key) for r in range(4)]
    for step in range(50):
        for w in ws:
            _timing(w, step)
    wait_until(lambda: all(w.node.rows_forwarded >= 50 for w in ws[1:]), "the senders' first 50 steps")
    ws[0].close()  # it refuses further flushes; those it answered land before its own last flush
    end = _train_until(ws[1:], 50, lambda: (t := _taker(ws[1:])) and t.node.senders >= 2 and t.node.rows_received,
                       "a sender to take over and the other two to hand over to it")
    taker = _taker(ws[1:])
    assert taker is not None
    others = [w for w in ws[1:] if w is not taker]
    for w in [*others, taker]:
        w.close()
    got = _steps_by_rank(run)
    assert got == {0: list(range(50)), **{r: list(range(end)) for r in range(1, 4)}}  # each row once
    assert [r for r, _ in _events(run, "node_takeover")] == [taker.rank]
    ends = dict(_events(run, "run_end"))
    assert ends[taker.rank]["node"] == "writer" and ends[taker.rank]["node_took_over"] is True
    assert ends[taker.rank]["node_rows_forwarded"] >= 50 and ends[taker.rank]["node_senders"] >= 2
    assert all(ends[w.rank]["node"] == "sender" for w in others)


KILLED = textwrap.dedent("""
    import sys, time
    from dynascope.store import RunWriter
    w = RunWriter(sys.argv[1], rank=0, world_size=3, flush_secs=0.05, node=sys.argv[2])
    print(type(w.node).__name__, flush=True)
    while True:
        time.sleep(1)
""")


def test_a_killed_node_writer_loses_no_later_row_and_doubles_none(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(node, "RETRY_S", 0.5)  # a sender that fell back on a loaded host comes back soon
    run, key = tmp_path / "run", uuid.uuid4().hex
    proc = subprocess.Popen([sys.executable, "-c", KILLED, str(run), key], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "NodeServer"
        ws = [RunWriter(run, rank=r, world_size=3, flush_secs=0.05, node=key) for r in (1, 2)]
        for step in range(40):
            for w in ws:
                _timing(w, step)
        wait_until(lambda: all(w.node.rows_forwarded >= 40 for w in ws), "the senders to hand over 40 steps")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
        end = _train_until(ws, 40, lambda: (t := _taker(ws)) and t.node.rows_received,
                           "a sender to take over and the other to hand over to it")
        (other,) = [w for w in ws if isinstance(w.node, NodeLink)]
        for w in sorted(ws, key=lambda w: w is not other):  # the sender first, the node writer last
            w.close()
    finally:
        proc.kill()
    got = _steps_by_rank(run)
    for r in (1, 2):  # nothing twice; every step after the kill (and those the node writer flushed) once
        assert len(got[r]) == len(set(got[r])) and set(range(40, end)) <= set(got[r]), got[r]
    (took,) = _events(run, "node_takeover")  # one of the two took the dead node writer's place
    ends = dict(_events(run, "run_end"))
    assert ends[took[0]]["node_took_over"] is True and ends[other.rank]["node"] == "sender"


def test_a_node_writer_that_does_not_answer_is_tried_again_later(tmp_path: Path, monkeypatch) -> None:
    # A node writer's process can be busy for longer than a sender waits (a checkpoint holding it): the
    # sender writes that flush itself, its own files for a while, then hands its flushes over again.
    monkeypatch.setattr(node, "RETRY_S", 0.5)
    run, key = tmp_path / "run", uuid.uuid4().hex
    mute = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # takes the address, never accepts or reads
    mute.bind(address(run.resolve(), key))
    mute.listen(8)
    try:
        w = RunWriter(run, rank=3, flush_secs=0.05, node=key)
        assert isinstance(w.node, NodeLink)
        for step in range(30):
            _timing(w, step)
        wait_until(lambda: not w.node.alive, "the sender to give up on a node writer that does not answer")
        assert w.node.fallbacks == 1 and w.node.rows_forwarded == 0
    finally:
        mute.close()
    writer = RunWriter(run, rank=0, flush_secs=0.05, node=key)  # the address is free: a node writer takes it
    assert isinstance(writer.node, NodeServer)
    wait_until(lambda: w.node.alive, "the sender's own-files spell to end")
    for step in range(30, 60):
        _timing(w, step)
    wait_until(lambda: w.node.rows_forwarded >= 30, "the sender to hand its flushes to the node writer again")
    w.close()
    writer.close()
    assert _steps_by_rank(run) == {3: list(range(60))}
    (fallback,) = _events(run, "node_fallback")
    assert fallback[0] == 3


WORKER = textwrap.dedent("""
    import sys, torch, torch.distributed as dist, torch.nn as nn
    import dynascope
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    scope = dynascope.watch(model, opt, run=sys.argv[1], system_interval_s=None, node_writer=True)
    for _ in range(5):
        model(torch.randn(4, 8)).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
    node = type(scope.writer.node).__name__ == "NodeServer"
    if not node:  # the senders close first: their last flushes go to the node writer before it closes
        scope.close()
    dist.barrier()
    if node:
        scope.close()
    dist.destroy_process_group()
""")


def test_watch_under_torchrun_writes_one_writer_per_node(tmp_path: Path) -> None:
    run = tmp_path / "run"
    torchrun(tmp_path, WORKER, run, nproc=3)
    with open_store(run) as con:
        per_rank = dict(con.rows("SELECT rank, count(DISTINCT step) FROM tensor_stats GROUP BY rank"))
        tensors = dict(con.rows("SELECT rank, count(DISTINCT tensor) FROM tensor_stats GROUP BY rank"))
    assert per_rank == {0: 5, 1: 5, 2: 5} and tensors == {0: 4, 1: 4, 2: 4}
    ends = [e for _, e in _events(run, "run_end")]
    assert sorted(e["node"] for e in ends) == ["sender", "sender", "writer"]
    # every flush of the senders went to the node writer (the run may be folded already: no files to count)
    assert all(e["node_fallbacks"] == 0 and e["node_rows_forwarded"] > 0 for e in ends if e["node"] == "sender")


def test_received_tables_join_the_writers_own_rows_as_they_are() -> None:
    # Tables as ranks' writers make them can differ in type where a column is all NULL in one (plain string)
    # and holds strings in another (dictionary), or lacks a column altogether: one table, every value kept.
    def made(rank: int, kind: str | None) -> pa.Table:
        buf = TableBuffer()
        buf.add(3, {"step": [1, 2, 3], "tensor": ["a", "b", None], "kind": kind, "numel": 4})
        return to_arrow("tensor_stats", buf, "run", rank, "trainer", 10 + rank)
    parts = [made(0, None), made(1, "attn_q"), made(2, None).drop_columns(["numel"])]
    own = TableBuffer()
    own.add(2, {"step": [7, 8], "tensor": ["c", "d"], "kind": "mlp_up"})
    for p in parts:
        own.add(p.num_rows, {ARROW: p})
    got = to_arrow("tensor_stats", own, "run", 5, "trainer", 15)
    assert got.schema.names == TABLES["tensor_stats"].names
    cols = ["rank", "generation", "step", "tensor", "kind", "numel"]
    assert sorted(zip(*(got.column(c).to_pylist() for c in cols), strict=True), key=str) == sorted(
        [(5, 15, 7, "c", "mlp_up", None), (5, 15, 8, "d", "mlp_up", None)]
        + [(r, 10 + r, s, t, "attn_q" if r == 1 else None, None if r == 2 else 4)
           for r in range(3) for s, t in ((1, "a"), (2, "b"), (3, None))], key=str)
