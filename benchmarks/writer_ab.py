"""The store writer of this checkout against the one of a git revision, in one process, rounds interleaved.

The baseline revision's ``dynascope`` package is exported (``git archive``) and imported as
``dynascope_base``, so both writers run side by side on the same Python, disk and load; rounds alternate
A/B so machine noise hits both alike. Two workloads:

- ``ingest``: benchmarks/store_ingest.py's stream (steps of 100 named scalars), flushed every 2 s as
  usual: the cost per row;
- ``flushes``: one flush per step of 100 scalars and an 8-tensor ``tensor_stats`` batch (with its two
  rollups): the cost per flush, where a per-flush addition (a commit record) shows most.

    flock /tmp/dynascope-bench.lock python3 benchmarks/writer_ab.py --baseline main
"""

from __future__ import annotations

import argparse
import importlib
import io
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
METRICS = [f"train/metric_{i:03d}" for i in range(100)]


def baseline_package(rev: str, into: Path) -> str:
    """Export ``rev``'s dynascope/ as ``dynascope_base`` under ``into``; returns the package name."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "dynascope"], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        tar.extractall(into, filter="data")
    (into / "dynascope").rename(into / "dynascope_base")
    # imports only (import statements and the module paths given to importlib); every other string (the
    # store's marker file dynascope.json, the probe's phase name, detector names) keeps its value, so the
    # baseline writes and reads the same runs as the current package
    parts = "|".join(p.stem for p in (into / "dynascope_base").iterdir() if p.suffix == ".py" or p.is_dir())
    statement = re.compile(r"^(\s*(?:from|import)\s+)dynascope(?=[.\s])", re.M)
    bare = re.compile(r"^(\s*import\s+)dynascope_base$", re.M)  # code goes on to name it `dynascope`
    module_path = re.compile(rf"""(?<=["'])dynascope(?=\.(?:{parts})\b)""")
    for py in (into / "dynascope_base").rglob("*.py"):
        text = statement.sub(r"\1dynascope_base", py.read_text(encoding="utf-8"))
        text = bare.sub(r"\1dynascope_base as dynascope", text)
        py.write_text(module_path.sub("dynascope_base", text), encoding="utf-8")
    sys.path.insert(0, str(into))
    return "dynascope_base"


def ingest(writer_cls, root: Path, steps: int) -> float:
    values = [[float(i * j % 7) for i in range(len(METRICS))] for j in range(64)]
    w = writer_cls(root, flush_secs=2.0)
    t0 = time.perf_counter()  # from the first append to the end of close, as benchmarks/store_ingest.py
    for s in range(steps):
        w.append("scalars", {"step": s, "key": METRICS, "value": values[s % 64]})
    w.close()
    return time.perf_counter() - t0


def flushes(writer_cls, root: Path, steps: int) -> float:
    rng = np.random.default_rng(0)
    n = 8
    tensors = {"tensor": [f"layers.{i}.weight" for i in range(n)], "kind": "mlp", "layer": list(range(n)),
               "numel": np.full(n, 4096), "w_norm": rng.uniform(1, 2, n), "update_norm": rng.uniform(0, 0.01, n),
               "bf16_unchanged_count": np.full(n, 4000)}
    w = writer_cls(root, flush_secs=3600)
    t0 = time.perf_counter()
    for s in range(steps):
        w.append("scalars", {"step": s, "key": METRICS, "value": 1.0})
        w.append("tensor_stats", {"step": s, "stage": "rl", **tensors})
        w.flush()
    w.close()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default="main", help="git revision to compare against")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--ingest-steps", type=int, default=20_000)
    ap.add_argument("--flush-steps", type=int, default=500)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dynascope-writer-ab-"))
    try:
        base = importlib.import_module(baseline_package(args.baseline, tmp / "pkg") + ".store").RunWriter
        from dynascope.store import RunWriter as head

        results: dict[tuple[str, str], list[float]] = {}
        for r in range(args.rounds):
            for work, steps in (("ingest", args.ingest_steps), ("flushes", args.flush_steps)):
                order = (("base", base), ("head", head)) if r % 2 == 0 else (("head", head), ("base", base))
                for name, cls in order:
                    root = tmp / f"{work}-{name}-{r}"
                    fn = ingest if work == "ingest" else flushes
                    results.setdefault((work, name), []).append(fn(cls, root, steps))
                    shutil.rmtree(root, ignore_errors=True)
        print(f"baseline {args.baseline}, {args.rounds} rounds each, interleaved\n")
        print(f"{'workload':<9} {'writer':<6} {'median s':>9} {'min':>7} {'max':>7}   per unit")
        for work, steps in (("ingest", args.ingest_steps), ("flushes", args.flush_steps)):
            unit = (steps * len(METRICS), "rows/s") if work == "ingest" else (steps, "ms/flush")
            for name in ("base", "head"):
                xs = results[(work, name)]
                med = statistics.median(xs)
                per = f"{unit[0] / med:,.0f} rows/s" if work == "ingest" else f"{1000 * med / unit[0]:.2f} ms/flush"
                print(f"{work:<9} {name:<6} {med:>9.3f} {min(xs):>7.3f} {max(xs):>7.3f}   {per}")
            ratios = [h / b for h, b in zip(results[(work, "head")], results[(work, "base")], strict=True)]
            print(f"{work:<9} head/base per round: median {statistics.median(ratios):.3f} "
                  f"(min {min(ratios):.3f}, max {max(ratios):.3f})\n")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
