"""Values A/B: every tensor statistic of one seeded workload, recorded by two source trees, compared.

A change to how statistics are computed (the chunk engine, a fused pass, a new kernel) must not change
what they are. This records the same workload with the code at ``--ref`` (e.g. a worktree of the
previous commit) and with the code of this checkout, each in its own child process with its tree first
on ``PYTHONPATH``, then compares every column of every ``tensor_stats`` and ``spectra`` row: integers,
booleans and strings exactly, floats within ``--rtol`` (1e-6 relative by default; NaN equals NaN).
Columns present in one tree only are listed, not compared.

The workload (one CPU thread, fixed seeds, ``time_budget=None`` so the rotating window is the same in
both trees): a small transformer LM trained with AdamW for 12 steps under

* ``window``: the default memory budget (a rotating window), θ₀ = init, S_k with k = 2, a stage switch
  that resets θ₀, an unused parameter (no gradient), an Inf planted in one gradient at step 8 (NaN
  weights from there on), spectral summaries;
* ``full``: every statistic of every tensor at every step (``memory_budget=None``), S_k with k = 3;
* ``bf16``: the model in bf16, plain SGD, full coverage;
* ``diff``: ``dynascope diff`` of the checkpoints the ``full`` run saved at steps 3, 6, 9, 12, with S_k.

    python3 benchmarks/stats_values_ab.py --ref /tmp/ref-worktree
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

STEPS = 12
IGNORED = {"run_id", "time_us", "compute_ms", "writer"}  # ids and wall clock


def _model(dtype: Any = None) -> Any:
    import torch
    import torch.nn as nn

    class Block(nn.Module):
        def __init__(self, d: int) -> None:
            super().__init__()
            self.attn_norm = nn.LayerNorm(d)
            self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
            self.up_proj, self.down_proj = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
            self.unused = nn.Parameter(torch.randn(d))  # never in the graph: its gradient stays None

        def forward(self, x: Any) -> Any:
            y = self.attn_norm(x)
            a = torch.softmax(self.q_proj(y) @ self.k_proj(y).transpose(1, 2) / 8.0, -1) @ self.v_proj(y)
            x = x + self.o_proj(a)
            return x + self.down_proj(torch.relu(self.up_proj(x)))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(128, 32)
            self.layers = nn.ModuleList(Block(32) for _ in range(2))
            self.lm_head = nn.Linear(32, 128, bias=False)

        def forward(self, x: Any) -> Any:
            h = self.embed(x)
            for blk in self.layers:
                h = blk(h)
            return self.lm_head(h)

    torch.manual_seed(0)
    model = LM()
    return model.to(dtype) if dtype is not None else model


def _train(run: Path, config: str, ckpt_dir: Path | None = None) -> None:
    import torch
    import torch.nn.functional as F

    import dynascope

    bf16 = config == "bf16"
    model = _model(torch.bfloat16 if bf16 else None)
    opt = (torch.optim.SGD(model.parameters(), lr=0.05) if bf16 else
           torch.optim.AdamW(model.parameters(), lr=1e-3))
    kw: dict[str, Any] = {"window": dict(memory_budget=0.1, bf16_k=2, spectral={"every": 3, "time_budget": None}),
                          "full": dict(memory_budget=None, bf16_k=3),
                          "bf16": dict(memory_budget=None)}[config]
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (4, 17), generator=g)
    scope = dynascope.watch(model, opt, run=run, time_budget=None, system_interval_s=None, **kw)
    for step in range(STEPS):
        if config == "window" and step == 6:
            scope.set_stage("rl")
            scope.set_reference("init")
        logits = model(x[:, :-1])
        F.cross_entropy(logits.flatten(0, 1).float(), x[:, 1:].flatten()).backward()
        if config == "window" and step == 8:
            model.layers[1].attn_norm.weight.grad[3] = float("inf")
        opt.step()
        opt.zero_grad(set_to_none=True)
        if ckpt_dir is not None and (step + 1) % 3 == 0:
            from safetensors.torch import save_file

            save_file({n: p.detach().clone() for n, p in model.named_parameters()},
                      str(ckpt_dir / f"step_{step + 1}.safetensors"))
    scope.close()


def record(out: Path) -> None:
    """Every run of the workload into ``out`` (this process's code)."""
    import torch

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    ckpts = out / "ckpts"
    ckpts.mkdir()
    from safetensors.torch import save_file

    save_file({n: p.detach().clone() for n, p in _model().named_parameters()}, str(ckpts / "base.safetensors"))
    _train(out / "window", "window")
    _train(out / "full", "full", ckpts)
    _train(out / "bf16", "bf16")
    from dynascope.importers.checkpoint_diff import diff_checkpoints

    diff_checkpoints(ckpts / "base.safetensors", sorted(ckpts.glob("step_*.safetensors")), out / "diff",
                     bf16_k=3, k=4, device="cpu")


def _rows(run: Path, table: str) -> tuple[list[str], list[tuple]]:
    import duckdb

    glob = f"{run}/{table}/**/*.parquet"
    with duckdb.connect() as con:
        rel = con.sql(f"SELECT * FROM read_parquet('{glob}', union_by_name = true)")
        cols = [c for c in rel.columns if c not in IGNORED]
        key = [c for c in ("step", "rank", "tensor") if c in cols]
        rows = con.sql(f"SELECT {', '.join(cols)} FROM read_parquet('{glob}', union_by_name = true) "
                       f"ORDER BY {', '.join(key)}").fetchall()
    return cols, rows


def _same(a: Any, b: Any, rtol: float) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        if math.isnan(a) or math.isnan(b):
            return math.isnan(a) and math.isnan(b)
        return a == b or abs(a - b) <= rtol * max(abs(a), abs(b))
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b, strict=True))
    return a == b and type(a) is type(b)


def compare(ref: Path, new: Path, rtol: float) -> dict[str, Any]:
    """Per run and table: rows compared, values compared, mismatches (first few), one-sided columns."""
    report: dict[str, Any] = {}
    for run in ("window", "full", "bf16", "diff"):
        for table in ("tensor_stats", "spectra"):
            if not (ref / run / table).exists():
                continue
            (ca, ra), (cb, rb) = _rows(ref / run, table), _rows(new / run, table)
            common = [c for c in ca if c in cb]
            ia, ib = [ca.index(c) for c in common], [cb.index(c) for c in common]
            bad: list[str] = []
            if len(ra) != len(rb):
                bad.append(f"row count {len(ra)} != {len(rb)}")
            values = non_null = 0
            for x, y in zip(ra, rb, strict=False):
                for c, i, j in zip(common, ia, ib, strict=True):
                    values += 1
                    non_null += x[i] is not None
                    if not _same(x[i], y[j], rtol):
                        bad.append(f"{c} step={x[ca.index('step')]} tensor={x[ca.index('tensor')]}: {x[i]!r} != {y[j]!r}")
            report[f"{run}/{table}"] = {"rows": len(ra), "values": values, "non_null": non_null,
                                        "mismatches": len(bad), "first": bad[:5],
                                        "only_ref": sorted(set(ca) - set(cb)), "only_new": sorted(set(cb) - set(ca))}
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", help="source tree of the reference code (its repository root)")
    ap.add_argument("--rtol", type=float, default=1e-6)
    ap.add_argument("--keep", help="record into this directory and keep it")
    ap.add_argument("--record", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.record:
        record(Path(args.record))
        return
    if not args.ref:
        ap.error("--ref is required")
    here = Path(__file__).resolve().parents[1]
    base = Path(args.keep or tempfile.mkdtemp(prefix="stats-ab-"))
    for name, tree in (("ref", Path(args.ref).resolve()), ("new", here)):
        env = dict(os.environ, PYTHONPATH=str(tree))
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--record", str(base / name)], env=env,
                       check=True, cwd=tree)
    report = compare(base / "ref", base / "new", args.rtol)
    print(json.dumps(report, indent=1))
    if any(r["mismatches"] for r in report.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
