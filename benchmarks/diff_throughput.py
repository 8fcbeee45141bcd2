"""Checkpoint-diff throughput vs the read limit.

Generates two safetensors checkpoints (~1 GB each by default; ``--quick``: ~16 MB) where the second
changes a planted 30 % of each tensor, then times over the same tensors:

  read limit   read both tensors through the same lazy reader, torch.linalg.vector_norm(a − b)
  diff k=0     `dynascope diff`'s sparsity+norm pass (weight_update_stats, rows into a run)
  diff k=8     the same plus the spectral summary of every 2-D tensor (for scale, no goal)

and prints GB/s (bytes of both checkpoints read per second) and each ratio to the read limit; the
goal for the sparsity+norm pass is ≥ 0.5. Best of ``--repeats``; files are in the page cache after
generation, so this measures the compute side of reading, not the disk.

    python benchmarks/diff_throughput.py [--quick] [--gb 1.0] [--dtype float32|bfloat16] [--device cuda]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from dynascope.core.tensor_io import open_checkpoint
from dynascope.importers.checkpoint_diff import diff_checkpoints
from dynascope.stats.engine import weight_update_stats


def generate(folder: Path, gb: float, dtype: torch.dtype, side: int) -> int:
    """Write base.safetensors and ckpt-1.safetensors of about ``gb`` GB each; returns bytes per file."""
    elem = torch.empty((), dtype=dtype).element_size()
    n_tensors = max(2, round(gb * 1e9 / (side * side * elem)))
    g = torch.Generator().manual_seed(0)
    base, ck = {}, {}
    for i in range(n_tensors):
        w = torch.randn(side, side, generator=g).to(dtype)
        mask = torch.rand(side, side, generator=g) < 0.3
        name = f"model.layers.{i}.mlp.up_proj.weight"
        base[name], ck[name] = w, torch.where(mask, w * 1.01, w).to(dtype)
    save_file(base, folder / "base.safetensors")
    save_file(ck, folder / "ckpt-1.safetensors")
    return n_tensors * side * side * elem


def read_limit(folder: Path, dev: torch.device) -> None:
    with open_checkpoint(folder / "base.safetensors") as a, open_checkpoint(folder / "ckpt-1.safetensors") as b:
        for name in a.names():
            float(torch.linalg.vector_norm(a.get(name).to(dev).float() - b.get(name).to(dev).float()))


def stats_only(folder: Path, dev: torch.device) -> None:
    with open_checkpoint(folder / "base.safetensors") as a, open_checkpoint(folder / "ckpt-1.safetensors") as b:
        for name in a.names():
            weight_update_stats([b.get(name).to(dev)], [a.get(name).to(dev)]).tolist()


def best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="~16 MB checkpoints, one repeat (smoke run)")
    ap.add_argument("--gb", type=float, default=1.0, help="size of each checkpoint")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="where statistics are computed (cpu, cuda)")
    ap.add_argument("--keep", type=Path, default=None, help="write the checkpoints here and keep them")
    args = ap.parse_args()
    gb, side, repeats = (0.016, 1024, 1) if args.quick else (args.gb, 4096, args.repeats)
    dtype = getattr(torch, args.dtype)
    dev = torch.device(args.device)
    folder = args.keep or Path(tempfile.mkdtemp(prefix="dynascope-diff-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        nbytes = generate(folder, gb, dtype, side)
        total = 2 * nbytes  # both checkpoints are read
        runs = iter(range(10_000))

        def diff(k: int) -> None:
            diff_checkpoints(folder / "base.safetensors", [folder / "ckpt-1.safetensors"],
                             folder / f"run-{k}-{next(runs)}", k=k, device=args.device)

        rows = [("read limit: vector_norm(a − b)", best(lambda: read_limit(folder, dev), repeats))]
        rows.append(("weight_update_stats alone", best(lambda: stats_only(folder, dev), repeats)))
        rows.append(("dynascope diff, k=0 (sparsity+norm)", best(lambda: diff(0), repeats)))
        rows.append(("dynascope diff, k=8 (+ spectra)", best(lambda: diff(8), 1)))
        limit = rows[0][1]
        print(f"\ncheckpoints: 2 × {nbytes / 1e9:.3f} GB {args.dtype}, {side}×{side} tensors, "
              f"device {dev}, {torch.get_num_threads()} torch threads")
        print(f"{'method':40s} {'seconds':>9s} {'GB/s':>8s} {'vs limit':>9s}")
        for name, secs in rows:
            print(f"{name:40s} {secs:9.3f} {total / 1e9 / secs:8.2f} {limit / secs:9.2f}")
        ratio = limit / rows[2][1]
        print(f"\nsparsity+norm pass at {ratio:.0%} of the read limit (goal ≥ 50%): {'met' if ratio >= 0.5 else 'NOT met'}")
    finally:
        if args.keep is None:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
