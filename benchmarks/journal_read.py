"""What live writers' journals and sealed segments cost a query of the present: open + count of a run of
``--writers`` writers, each holding ``--sealed`` sealed segments of ``timings`` and a journal of ``--flushes``
flushes (its rows since its last seal), against the same run with those rows sealed too (one more segment
instead of the journal). Both runs are written through ``store.journal`` (its encoder, its seal), then
opened and counted in fresh processes, the two arms alternating round by round.

    python benchmarks/journal_read.py --writers 256 1280 --flushes 30 --sealed 4 7 --rounds 5
    python benchmarks/journal_read.py --writers 1280 --flushes 30 --sealed 4 --rounds 5 --snapshot
    python benchmarks/journal_read.py --writers 1280 --flushes 30 --sealed 4 --rounds 5 --filtered --baseline ../before

The second also times a snapshot of the journal run, counted as another engine reads it: with the copy of
the journal rows (``snapshot_journals``) against its segments alone. The third also counts the journal run
through the what-ifs' filter (the top-level and step rows), which names eight columns of each journal line.

A live journal writer holds at most ``own_fold.SEALED_LEAVE + SEALED_EVERY`` (4) sealed segments once its
merges take effect; 7 is what it held when it folded every 4 seals to 3, as a writer without a journal does.

A flush is one step's 4 phase rows. At ``watch()``'s defaults (a flush every 10 s, a seal every 300 s) a
journal holds at most 30 flushes; 300 is a writer that flushes every second.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import pyarrow as pa

sys.path.insert(0, str(Path(__file__).resolve().parent))
from write_side import _open_count  # noqa: E402  (the same fresh-process open + count as write_side's)

from dynascope.store import RunWriter, own_fold  # noqa: E402
from dynascope.store.flush import Group  # noqa: E402
from dynascope.store.journal import SETTLE_S, Journal, journals_in  # noqa: E402
from dynascope.store.schema import TABLES  # noqa: E402

PHASES = ["forward", "backward", "optimizer", "step"]


def _rows(rank: int, steps: range) -> pa.Table:
    return pa.Table.from_pylist([{"run_id": "r", "rank": rank, "role": "trainer", "step": step, "phase": p,
                                  "start_us": step * 10_000, "dur_us": d, "category": "step" if p == "step" else "phase"}
                                 for step in steps for p, d in zip(PHASES, [1000, 2000, 500, 3600], strict=True)],
                                schema=TABLES["timings"])


def build(run: Path, writers: int, flushes: int, seal_last: bool, sealed: int) -> int:
    """The run: each writer ``sealed`` sealed segments of ``flushes`` steps, then ``flushes`` steps in its
    journal (sealed as well with ``seal_last``); returns the rows."""
    RunWriter(run, fold=False).close()  # the run, its marker and its schema files
    step = 0
    for rank in range(writers):
        j = Journal(run, f"r{rank}-trainer-bench", seal_secs=1e9)
        seq = 0
        for gen in range(sealed + 1):  # a generation's flushes in one append: the same lines as one a flush
            seq = j.write([Group("timings", [("timings", _rows(rank, range(step, step + flushes)))])], seq).next_seq
            step += flushes
            if gen < sealed or seal_last:
                j.seal()
        j.reset()
        if j._con is not None:
            j._con.close()
    time.sleep(SETTLE_S + 0.5)  # the last seals in effect
    # A writer deletes a sealed journal GRACE_S after its seal took effect (``Journal.delete_sealed``), so
    # a live writer holds one journal a table, and another only in the 10 s after each seal. Delete them
    # as it would: a glob lists them and a query opens them, counted or not.
    for wdir in (run / "timings").glob("writer=*"):
        done = {int(p.name[:12]) for p in wdir.glob("*.v*.parquet")}
        for n, path in journals_in(wdir) or []:
            if n in done:
                path.unlink()
    return writers * (sealed + 1) * flushes * len(PHASES) + 1  # and the closed writer's run_end event is not timings


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--writers", type=int, nargs="+", default=[256, 1280])
    ap.add_argument("--flushes", type=int, nargs="+", default=[30, 300])
    ap.add_argument("--sealed", type=int, nargs="+", default=[own_fold.SEALED_LEAVE + own_fold.SEALED_EVERY])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--baseline", type=Path, help="another checkout of dynascope: its reader opens and counts "
                    "both runs too, in the same alternation")
    ap.add_argument("--snapshot", action="store_true", help="also take a snapshot of the run with journals "
                    "and count it as another engine does: with the journal rows' copy, and segments alone")
    ap.add_argument("--filtered", action="store_true", help="also count the run with journals through the "
                    "what-ifs' filter")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    readers = {"": {"DYNASCOPE_FOLD": "0"}}
    if args.baseline:
        readers[" (baseline)"] = {"DYNASCOPE_FOLD": "0", "PYTHONPATH": str(args.baseline)}
    results = []
    for n, f, k in itertools.product(args.writers, args.flushes, args.sealed):
        d = Path(tempfile.mkdtemp(prefix="journal-read-"))
        try:
            rows = {arm: build(d / arm, n, f, arm == "sealed", k) for arm in ("journal", "sealed")}
            order = [(run, who) for run in ("journal", "sealed") for who in readers]
            order += [("journal", f" {c}") for c in ("snapshot", "snapshot-segments") if args.snapshot]
            order += [("journal", f" filtered{who}") for who in readers if args.filtered]
            arms: dict[str, list[dict]] = {run + who: [] for run, who in order}
            for r in range(args.rounds):
                for run, who in order[::1 if r % 2 == 0 else -1]:
                    how = who.strip() if who.startswith(" snapshot") else \
                        "dynascope-filtered" if who.startswith(" filtered") else "dynascope"
                    env = readers.get(who.removeprefix(" filtered"), readers[""])
                    arms[run + who] += _open_count(how, d / run, 1, env)
            for arm, runs in arms.items():  # a snapshot without the copy lacks the journals' rows
                want = n * (k + (not arm.endswith("segments"))) * f * len(PHASES)
                assert all(x["rows"] == want for x in runs), (arm, runs, rows)
            res = {"writers": n, "flushes": f, "segments": k,
                   **{arm: {"s": [x["s"] for x in runs], "rss_mb": [x["rss_mb"] for x in runs]}
                      for arm, runs in arms.items()}}
            results.append(res)
            print(json.dumps(res), flush=True)
        finally:
            shutil.rmtree(d, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"\nopen + count of timings, fresh process, median (min–max) of {args.rounds} rounds\n")
    print("| writers | sealed segments a writer | flushes in a journal | with journals: s | MB | all sealed: s | MB "
          "| ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        j, s = statistics.median(r["journal"]["s"]), statistics.median(r["sealed"]["s"])
        print(f"| {r['writers']:,} | {r['segments']} | {r['flushes']} | {j:.2f} ({min(r['journal']['s']):.2f}–{max(r['journal']['s']):.2f})"
              f" | {statistics.median(r['journal']['rss_mb']):.0f} | {s:.2f} ({min(r['sealed']['s']):.2f}–"
              f"{max(r['sealed']['s']):.2f}) | {statistics.median(r['sealed']['rss_mb']):.0f} | {j / s:.2f} |")

    for r in results if args.snapshot else []:
        a, b = r["journal snapshot"], r["journal snapshot-segments"]
        print(f"{r['writers']:,} writers, {r['segments']} sealed, {r['flushes']} flushes: a snapshot counted with its "
              f"journal rows {statistics.median(a['s']):.2f} s ({min(a['s']):.2f}–{max(a['s']):.2f}), "
              f"{statistics.median(a['rss_mb']):.0f} MB; segments alone {statistics.median(b['s']):.2f} s "
              f"({min(b['s']):.2f}–{max(b['s']):.2f}), {statistics.median(b['rss_mb']):.0f} MB")
    for r in results if args.filtered else []:
        for who in readers:
            a = r[f"journal filtered{who}"]
            print(f"{r['writers']:,} writers, {r['segments']} sealed, {r['flushes']} flushes, with journals, the "
                  f"what-ifs' filter{who}: {statistics.median(a['s']):.2f} s ({min(a['s']):.2f}–{max(a['s']):.2f}), "
                  f"{statistics.median(a['rss_mb']):.0f} MB")
    for r in results if args.baseline else []:
        b, n = r["journal (baseline)"], r["journal"]
        print(f"{r['writers']:,} writers, {r['segments']} sealed, {r['flushes']} flushes, with journals: baseline "
              f"{statistics.median(b['s']):.2f} s ({min(b['s']):.2f}–{max(b['s']):.2f}), {statistics.median(b['rss_mb']):.0f}"
              f" MB; ratio {statistics.median(n['s']) / statistics.median(b['s']):.2f}")


if __name__ == "__main__":
    main()
