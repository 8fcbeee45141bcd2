"""Each dashboard page's first visit in the app over one store, several rounds: median and spread.

A round starts a fresh dashboard server on the store (cold query caches), opens the app (Runs) in headless
Chromium and clicks each page in the sidebar once, timing each click until that page's script finished and
every plotly chart drew (``dashboard_render.navigate_all``: how a user meets the pages). Goal at 1,024
ranks × 500 steps: every page < 4 s on 2 cores. Run under the benchmark lock:

    flock /tmp/dynascope-bench.lock python3 benchmarks/dashboard_pages.py runs/cluster-scale/r1024-s500 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from dashboard_render import CHROMIUM, PAGES, navigate_all  # benchmarks/ is on sys.path when run as a script

from dynascope.dashboard.serve import serving


def rounds(store: Path, n: int, log: Path) -> dict[str, list[float]]:
    """Seconds per page for each of ``n`` rounds, each on a fresh server; a page that showed a Streamlit
    exception fails the benchmark (a fast broken page is not a result)."""
    from playwright.sync_api import sync_playwright

    out: dict[str, list[float]] = {name: [] for name, _ in PAGES}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True,
                                    args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"])
        for i in range(n):
            with serving(store, log=log) as base:
                res = navigate_all(browser, base)
            for (name, _), (secs, _charts, errors) in zip(PAGES, res, strict=True):
                if errors:
                    raise SystemExit(f"round {i + 1}: the {name} page shows {errors} exception(s); see {log}")
                out[name].append(secs)
            print(f"round {i + 1} (load {os.getloadavg()[0]:.1f}): "
                  + " ".join(f"{k} {v[-1]:.2f}" for k, v in out.items()), flush=True)
    return out


def summary(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}–{max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("store", type=Path, help="a run directory or a store root")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--goal-s", type=float, default=4.0)
    ap.add_argument("--json", type=Path, help="also write the per-round seconds here")
    args = ap.parse_args()
    t = time.perf_counter()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "dynascope-dashboard-pages.log"
    res = rounds(args.store, args.rounds, log)
    print(f"\n{args.store} · {args.rounds} rounds · {time.perf_counter() - t:.0f} s · load {os.getloadavg()}")
    print("| page | first visit s, median (min–max) | goal met |\n|---|---|---|")
    for name, xs in res.items():
        print(f"| {name} | {summary(xs)} | {'yes' if statistics.median(xs) < args.goal_s else 'no'} |")
    if args.json:
        args.json.write_text(json.dumps({"store": str(args.store), "pages": res}, indent=1))


if __name__ == "__main__":
    main()
