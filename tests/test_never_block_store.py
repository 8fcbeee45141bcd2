"""The writer's end under real faults: a disk that stops answering, SIGTERM from a launcher. ``close()``
keeps its deadline, and a terminated job's finished steps are in the store, its own handler still called."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

from dynascope.core.net import free_port
from dynascope.store import RunWriter, open_store
from dynascope.store.preempt import TERM_FLUSH_S

from helpers.waiting import wait_until

TESTS = Path(__file__).resolve().parent


class _StalledDisk:
    """The writer's commit seam, made to hang until released (an NFS server gone away)."""

    def __init__(self, writer: RunWriter) -> None:
        self.release, self.entered = threading.Event(), threading.Event()
        real = writer._commit

        def commit(groups):
            self.entered.set()
            self.release.wait(600)
            return real(groups)

        writer._commit = commit  # type: ignore[method-assign]


def test_close_keeps_its_deadline_on_a_stalled_disk_and_the_flush_lands_whole_later(tmp_path: Path) -> None:
    w = RunWriter(tmp_path / "run", flush_secs=3600)
    w.append("scalars", {"step": list(range(100)), "key": "loss", "value": 1.0, "time_us": 1})
    disk = _StalledDisk(w)
    closer = threading.Thread(target=w.close, kwargs={"timeout_s": 1.0}, daemon=True)
    closer.start()
    closer.join(60)  # a hang never returns; slack for a loaded machine
    assert not closer.is_alive() and disk.entered.is_set() and w.close_timed_out
    disk.release.set()  # the disk comes back: the flush that was under way commits, whole
    wait_until(lambda: _count(tmp_path / "run") == 100, "the late flush to land")


def _count(run: Path) -> int:
    try:
        with open_store(run) as store:
            return store.rows("SELECT count(*) FROM scalars")[0][0]
    except Exception:
        return -1


WORKER = textwrap.dedent("""
    import os, signal, sys, torch, torch.distributed as dist
    import dynascope
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    called = []
    signal.signal(signal.SIGTERM, lambda *a: (called.append(1), open(f"{RUN}.handler{rank}", "w").close(),
                                              sys.exit(143)))  # the user's own handler: must still run
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scope = dynascope.watch(model, opt, run=RUN, system_interval_s=None)  # flushes every 10 s by default
    step = 0
    while True:
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        step += 1
        with open(f"{RUN}.step{rank}.tmp", "w") as f:
            f.write(str(step))
        os.replace(f"{RUN}.step{rank}.tmp", f"{RUN}.step{rank}")
""")


def test_sigterm_under_torchrun_keeps_every_finished_step(tmp_path: Path) -> None:
    run = tmp_path / "run"
    script = tmp_path / "worker.py"
    script.write_text(WORKER.replace("RUN", repr(str(run))))
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--nnodes=1",
                             "--master_addr=127.0.0.1", f"--master_port={free_port()}", str(script)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def steps(rank: int) -> int:
            try:
                return int(Path(f"{run}.step{rank}").read_text() or 0)
            except (OSError, ValueError):
                return 0

        wait_until(lambda: steps(0) >= 20 and steps(1) >= 20, "both ranks to train 20 steps", 240, 0.05)
        proc.send_signal(signal.SIGTERM)  # to torchrun's agent, which forwards it to the workers
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    done = {r: steps(r) for r in (0, 1)}
    for r in (0, 1):
        assert Path(f"{run}.handler{r}").exists(), f"rank {r}: the user's SIGTERM handler did not run"
    with open_store(run) as store:
        recorded = dict(store.rows("SELECT rank, count(DISTINCT step) FROM timings WHERE category = 'step' GROUP BY 1"))
    for r in (0, 1):  # every step whose optimizer.step() returned (one more may have, after its marker)
        assert recorded.get(r, 0) >= done[r] > 0, (r, recorded, done)


HELD = textwrap.dedent("""
    import os, signal, sys, time
    from dynascope.store import RunWriter
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))  # the user's handler, chained to after the flush
    w = RunWriter(RUN, flush_secs=3600)
    w.append("scalars", {"step": list(range(100)), "key": "loss", "value": 1.0, "time_us": 1})
    commit = w._commit
    def slow(groups):  # a shared file system's write: the process must not end while it lands
        time.sleep(2)
        return commit(groups)
    w._commit = slow
    with w._lock:  # the signal lands while the training thread is inside the writer's lock (an append)
        os.kill(os.getpid(), signal.SIGTERM)
        while True:
            pass
""")


def test_sigterm_inside_the_writers_lock_still_writes_every_row(tmp_path: Path) -> None:
    # The flush that SIGTERM starts cannot take the lock the interrupted thread holds, and waits out its
    # deadline; the user's handler then exits, which unwinds and releases the lock. The exit's own close
    # must wait for that flush to land, not find the writer "closing" and let the process end under it.
    run, proc = _run_until_terminated(tmp_path, HELD)
    assert proc.returncode == 143, proc.stderr
    assert _rows_and_ends(run) == (100, 1)  # one close: two racing closes each wrote their own run_end


def _run_until_terminated(tmp_path: Path, script: str) -> tuple[Path, subprocess.CompletedProcess]:
    run, path = tmp_path / "run", tmp_path / "script.py"
    path.write_text(script.replace("RUN", repr(str(run))))
    return run, subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=120)


def _rows_and_ends(run: Path) -> tuple[int, int]:
    """The scalars rows and the run_end events in ``run``."""
    with open_store(run) as store:
        return store.rows("SELECT (SELECT count(*) FROM scalars), "
                          "(SELECT count(*) FROM events WHERE event = 'run_end')")[0]


INSIDE = textwrap.dedent("""
    import os, signal, time
    from dynascope.store import RunWriter
    w = RunWriter(RUN, flush_secs=3600)  # no handler of the user's: the default, which ends the process
    w.append("scalars", {"step": list(range(100)), "key": "loss", "value": 1.0, "time_us": 1})
    real, sent = w._over_locked, []

    def inside(extra_rows=0):  # runs within append, under the writer's lock
        if not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - sent[0] < 0.3:  # the append goes on a while, the signal pending
                pass
            # Written here, still inside the append: once it returns, the deferred signal may land
            # between any two bytecodes of the script's own code, so a marker written there can be cut.
            with open(RUN + ".appended", "w") as f:
                f.write(repr(time.monotonic() - sent[0]))
        return real(extra_rows)

    w._over_locked = inside
    w.append("scalars", {"step": list(range(100, 150)), "key": "loss", "value": 1.0, "time_us": 1})
    while True:  # training goes on until the signal ends the process
        pass
""")


def test_sigterm_during_an_append_is_put_off_until_the_lock_is_free(tmp_path: Path) -> None:
    # Without the deferral the flush waits out its whole deadline on the lock the append holds, and the
    # default action then ends the process with nothing written.
    run, proc = _run_until_terminated(tmp_path, INSIDE)
    assert proc.returncode == -signal.SIGTERM, proc.stderr  # ended by the signal, as it would have been
    assert float(Path(f"{run}.appended").read_text()) >= 0.3  # the process outlived the signal inside the append
    assert _rows_and_ends(run) == (150, 1)


AGAIN = textwrap.dedent("""
    import os, signal, time
    from dynascope.store import RunWriter
    signal.signal(signal.SIGTERM, lambda *a: None)  # the user's handler goes on (a graceful stop at the next step)
    first = RunWriter(RUN + "-first", flush_secs=3600)
    os.kill(os.getpid(), signal.SIGTERM)  # handled at once: the first writer is closed
    time.sleep(1.5)  # past the first signal's deferral window
    w = RunWriter(RUN, flush_secs=3600)
    w.append("scalars", {"step": list(range(100)), "key": "loss", "value": 1.0, "time_us": 1})
    real, sent = w._over_locked, []

    def inside(extra_rows=0):
        if not sent:
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGTERM)
            while time.monotonic() - sent[0] < 0.3:
                pass
        return real(extra_rows)

    w._over_locked = inside
    w.append("scalars", {"step": list(range(100, 150)), "key": "loss", "value": 1.0, "time_us": 1})
    deadline = time.monotonic() + 60
    while not w._closed and time.monotonic() < deadline:  # the second signal's flush closes this writer
        time.sleep(0.01)
    with open(RUN + ".flushed", "w") as f:
        f.write(repr(time.monotonic() - sent[0]))
""")


def test_a_second_sigterm_much_later_is_put_off_too(tmp_path: Path) -> None:
    # The deferral window runs from the first signal of a burst, not of the process: a handled SIGTERM whose
    # handler went on leaves the next one, landing inside an append, put off as the first was.
    run, proc = _run_until_terminated(tmp_path, AGAIN)
    assert proc.returncode == 0, proc.stderr
    assert float(Path(f"{run}.flushed").read_text()) < TERM_FLUSH_S  # not a flush that waited out its deadline
    assert _rows_and_ends(run) == (150, 1)
