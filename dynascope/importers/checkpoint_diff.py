"""`dynascope diff BASE CKPT [CKPT ...] --run OUT`: the live probe's statistics, from saved checkpoints.

Checkpoint i becomes step i (1-based, BASE is step 0) unless every name carries a step number
(``checkpoint-500``, ``step_1000``, ``global_step200``, ``iter-3``): then those numbers are the steps and
the checkpoints are taken in step order, whatever order the shell listed them in.

Per tensor and checkpoint it writes the rows the live probe writes (the same declared statistics, the
same chunk engine and row derivation, ``dynascope.stats``):
- ``tensor_stats``: the step columns (w_norm, update_norm, changed/sign-flip counts, PULSE's S₁ as
  bf16_unchanged_*, …) against the *previous* checkpoint (BASE for the first), exactly as the probe
  compares step t with step t−1; the drift columns (drift_norm, drift_changed_*, Mukherjee et al.'s
  drift_unchanged_* and drift_zero_*) against BASE = θ₀; with ``bf16_k``, PULSE's S_k
  (bf16_unchanged_k_*) by the live probe's rule: a bf16 snapshot is taken at a checkpoint whose step + k
  was given, and compared (then dropped) at that later checkpoint (BASE has no step of its own here, as
  the live probe holds no snapshot of the weights before step 0);
- ``spectra`` (2-D float weights, unless k = 0): the low-rank summary of W_i − W_BASE.

Work goes tensor by tensor: BASE's tensor is read once, then each checkpoint's in turn, so at most three
tensors (BASE, previous, current) plus the spectral temporaries are in memory at any time, and with
``bf16_k`` one bf16 cast more.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dynascope.core.errors import StoreError, first_line
from dynascope.core.naming import tensor_kind, tensor_layer
from dynascope.core.tensor_io import Checkpoint, open_checkpoint
from dynascope.stats.base import Settings
from dynascope.stats.engine import whole_tensor_values
from dynascope.stats.rows import PartialResults, tensor_stats_columns
from dynascope.stats.spectra import Spectra
from dynascope.store import RunWriter

__all__ = ["DiffSummary", "checkpoint_steps", "diff_checkpoints"]

_STEP_RE = re.compile(r"(?:checkpoint|ckpt|global_step|step|iter|epoch)[-_]?(\d+)", re.I)


@dataclass
class DiffSummary:
    """What a diff wrote."""

    run_dir: Path
    steps: list[int]
    tensors: int = 0
    tensor_stats_rows: int = 0
    spectra_rows: int = 0
    skipped: list[str] = field(default_factory=list)
    bytes_read: int = 0
    seconds: float = 0.0


def checkpoint_steps(paths: list[Path]) -> list[int]:
    """Step numbers parsed from the names (last two path parts), or 1..N when any is missing/repeated."""
    parsed = []
    for p in paths:
        hits = [m for part in (p.parent.name, p.name) for m in _STEP_RE.findall(part)]
        parsed.append(int(hits[-1]) if hits else None)
    if all(s is not None for s in parsed) and len(set(parsed)) == len(parsed):
        return parsed  # type: ignore[return-value]
    return list(range(1, len(paths) + 1))


def _select(base: Checkpoint, cks: list[Checkpoint], regex: str | None, allow_missing: bool) -> tuple[list[str], list[str]]:
    """Tensor names to diff and names skipped; raises on name or shape mismatches."""
    try:
        pattern = re.compile(regex) if regex else None
    except re.error as exc:
        raise StoreError(f"--tensors: invalid regular expression {regex!r} ({exc})") from None
    keep = lambda n: pattern is None or pattern.search(n) is not None  # noqa: E731
    names = [n for n in base.names() if keep(n)]
    skipped: set[str] = set()
    for ck in cks:
        missing = [n for n in names if n not in ck.specs]
        extra = [n for n in ck.names() if keep(n) and n not in base.specs]
        if (missing or extra) and not allow_missing:
            parts = ([f"missing {len(missing)}: {', '.join(missing[:3])}"] if missing else []) + \
                    ([f"extra {len(extra)}: {', '.join(extra[:3])}"] if extra else [])
            raise StoreError(f"{ck.path}: tensor names differ from BASE ({'; '.join(parts)}); "
                             "pass --allow-missing to skip them")
        skipped.update(missing + extra)
        for n in names:
            if n in ck.specs and ck.specs[n][0] != base.specs[n][0]:
                raise StoreError(f"{ck.path}: {n} has shape {tuple(ck.specs[n][0])}, "
                                 f"BASE has {tuple(base.specs[n][0])}")
    names = [n for n in names if n not in skipped]
    if not names:
        raise StoreError("no tensors to compare" + (f" match --tensors {regex!r}" if regex else ""))
    return names, sorted(skipped)


def _nbytes(spec: tuple[tuple[int, ...], torch.dtype]) -> int:
    return int(torch.Size(spec[0]).numel()) * torch.empty((), dtype=spec[1]).element_size()


def diff_checkpoints(
    base: str | os.PathLike, checkpoints: list[str | os.PathLike], run_dir: str | os.PathLike, *,
    tensors: str | None = None, allow_missing: bool = False, k: int = 8, stage: str | None = None,
    eta: float = 1e-3, device: str = "auto", progress: Callable[[int], None] | None = None,
    on_plan: Callable[[int, list[str]], None] | None = None, bf16_k: int | None = None,
) -> DiffSummary:
    """Diff each checkpoint against BASE (and its predecessor) into the run at ``run_dir``.

    Raises ``StoreError`` (one line) for unreadable files, mismatched names (unless ``allow_missing``)
    or shapes, and an existing run directory. ``progress(bytes)`` is called as tensors are read;
    ``on_plan(total_bytes, skipped_names)`` once before any work. ``device``: where the statistics
    are computed ("auto": the GPU when there is one; tensors are read on the host either way).
    """
    if not checkpoints:
        raise StoreError("give at least one checkpoint to compare with BASE")
    if bf16_k is not None and bf16_k < 1:
        raise StoreError(f"--bf16-k must be at least 1 (steps back), got {bf16_k}")
    run_dir = Path(run_dir)
    if (run_dir / "dynascope.json").exists():
        raise StoreError(f"{run_dir}: run already exists; diff into a new --run directory")
    t_start = time.perf_counter()
    dev = _device(device)
    paths = [Path(c) for c in checkpoints]
    steps = checkpoint_steps(paths)
    order = sorted(range(len(paths)), key=lambda i: steps[i])
    paths, steps = [paths[i] for i in order], [steps[i] for i in order]
    with ExitStack() as stack:
        base_ck = stack.enter_context(open_checkpoint(base))
        cks = [stack.enter_context(open_checkpoint(p)) for p in paths]
        names, skipped = _select(base_ck, cks, tensors, allow_missing)
        total = sum(_nbytes(base_ck.specs[n]) * (1 + len(cks)) for n in names)
        if on_plan is not None:
            on_plan(total, skipped)
        times = [int(os.stat(p).st_mtime * 1e6) for p in paths]  # when each checkpoint was written
        probe = Spectra(k=k, time_budget=None) if k > 0 else None
        summary = DiffSummary(run_dir, steps, skipped=skipped)
        config = {"base": str(base), "checkpoints": [str(p) for p in paths], "steps": steps,
                  "tensors": tensors, "k": k, "eta": eta, "bf16_k": bf16_k}
        created = not run_dir.exists()
        writer = RunWriter(run_dir, framework="checkpoint-diff", config=config, run_name=run_dir.name)
        ok = False
        try:
            if skipped:
                writer.event("checkpoint_diff_skipped", f"{len(skipped)} tensor names not in every checkpoint",
                             severity="warning", names=skipped)
            for name in names:
                summary.bytes_read += _diff_tensor(name, base_ck, cks, steps, times, stage, eta, probe, writer,
                                                   summary, progress, dev, bf16_k)
                summary.tensors += 1
            summary.seconds = time.perf_counter() - t_start
            writer.event("checkpoint_diff", f"diffed {len(names)} tensors of {len(cks)} checkpoints against {base}",
                         dur_us=int(summary.seconds * 1e6), bytes_read=summary.bytes_read)
            ok = True
        finally:
            writer.close()
            if not ok and created:  # a half-written run would only block the retry
                shutil.rmtree(run_dir, ignore_errors=True)
    return summary


def _diff_tensor(name: str, base_ck: Checkpoint, cks: list[Checkpoint], steps: list[int], times: list[int],
                 stage: str | None, eta: float, probe: Spectra | None, writer: RunWriter,
                 summary: DiffSummary, progress: Callable[[int], None] | None, device: torch.device,
                 bf16_k: int | None) -> int:
    w0 = base_ck.get(name).to(device)
    nbytes = _nbytes(base_ck.specs[name])
    if progress:
        progress(nbytes)
    read = nbytes
    prev = w0
    rows: list[dict] = []
    settings = Settings(eta=eta)
    held: tuple[int, torch.Tensor] | None = None  # S_k: (step, bf16 cast) of the checkpoint compared k steps on
    given = set(steps)
    spectra: list[dict] = []
    for ck, step, t_us in zip(cks, steps, times, strict=True):
        cur = ck.get(name).to(device)
        read += nbytes
        if progress:
            progress(nbytes)
        # Every declared statistic whose inputs a checkpoint pair gives, as the live probe computes them: the
        # update against the previous checkpoint (BASE for the first), the drift against BASE (θ₀), S_k
        # against the checkpoint bf16_k steps back when one was given.
        tensors = {"new": cur, "old": prev, "ref": w0}
        if bf16_k and held is not None and step - held[0] == bf16_k:  # the live probe's rule, with "recorded"
            tensors["k_snapshot"] = held[1]                          # = "a checkpoint was given for that step"
        row = whole_tensor_values(tensors, settings)
        if "k_snapshot" in tensors:
            row["bf16_k_steps"] = bf16_k
        del tensors  # the previous checkpoint's tensor goes when the next one is read
        if bf16_k:
            if held is not None and step - held[0] >= bf16_k:
                held = None
            if held is None and step + bf16_k in given:
                held = (step, cur.to(torch.bfloat16, copy=True))
        row.update(step=step, time_us=t_us)
        rows.append(row)
        if probe is not None and probe.eligible(name, cur, {name: w0}):
            for srow in probe.record(step, stage, [(name, cur)], {name: w0}):
                srow["time_us"] = t_us
                spectra.append(srow)
        prev = cur
    if probe is not None:
        probe.forget(name)
    _write_rows(name, base_ck.specs[name], rows, stage, writer)
    if spectra:
        cols_s = {c: [r.get(c) for r in spectra] for c in spectra[0] if c not in ("stage", "tensor", "layer", "kind")}
        writer.append("spectra", {**cols_s, "stage": stage, "tensor": name, "layer": tensor_layer(name),
                                  "kind": tensor_kind(name)})
    summary.tensor_stats_rows += len(rows)
    summary.spectra_rows += len(spectra)
    return read


def _device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError) as exc:
        raise StoreError(f"--device {device}: not usable here ({first_line(exc)})") from None
    return dev


def _write_rows(name: str, spec: tuple[tuple[int, ...], torch.dtype], rows: list[dict], stage: str | None,
                writer: RunWriter) -> None:
    """One ``tensor_stats`` row per checkpoint, derived as the live probe's (``stats.rows``)."""
    numel = int(torch.Size(spec[0]).numel())
    cols = tensor_stats_columns(PartialResults.of_dicts(rows), np.full(len(rows), numel, dtype=np.int64))
    writer.append("tensor_stats", {**cols, "tensor": name, "layer": tensor_layer(name), "kind": tensor_kind(name),
                                   "sharded": False, "shape": "x".join(str(d) for d in spec[0]),
                                   "dtype": str(spec[1]).removeprefix("torch."), "numel": numel,
                                   "step": [r["step"] for r in rows], "time_us": [r["time_us"] for r in rows],
                                   "stage": stage})

