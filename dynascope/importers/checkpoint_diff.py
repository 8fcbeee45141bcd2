"""`dynascope diff BASE CKPT [CKPT ...] --run OUT`: the live probe's statistics, from saved checkpoints.

Checkpoint i becomes step i (1-based, BASE is step 0) unless every name carries a step number
(``checkpoint-500``, ``step_1000``, ``global_step200``, ``iter-3``): then those numbers are the steps and
the checkpoints are taken in step order, whatever order the shell listed them in.

Per tensor and checkpoint it writes the rows the live probe writes (same pure functions):
- ``tensor_stats``: the step columns (w_norm, update_norm, changed/sign-flip counts, …) against the
  *previous* checkpoint (BASE for the first), exactly as the probe compares step t with step t−1, and
  the drift columns (drift_norm, drift_changed_*) against BASE = θ₀;
- ``spectra`` (2-D float weights, unless k = 0): the low-rank summary of W_i − W_BASE.

Work goes tensor by tensor: BASE's tensor is read once, then each checkpoint's in turn, so at most three
tensors (BASE, previous, current) plus the spectral temporaries are in memory at any time.
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

import torch

from dynascope.importers.checkpoint_io import Checkpoint, open_checkpoint
from dynascope.probes.spectral import SpectralProbe
from dynascope.probes.update_stats import UPDATE_STAT_COLUMNS, norms, weight_update_stats
from dynascope.store import RunWriter, StoreError, first_line
from dynascope.store.naming import tensor_kind, tensor_layer

__all__ = ["DiffSummary", "checkpoint_steps", "diff_checkpoints"]

_STEP_RE = re.compile(r"(?:checkpoint|ckpt|global_step|step|iter|epoch)[-_]?(\d+)", re.I)
_COL = {c: i for i, c in enumerate(UPDATE_STAT_COLUMNS)}


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
    on_plan: Callable[[int, list[str]], None] | None = None,
) -> DiffSummary:
    """Diff each checkpoint against BASE (and its predecessor) into the run at ``run_dir``.

    Raises ``StoreError`` (one line) for unreadable files, mismatched names (unless ``allow_missing``)
    or shapes, and an existing run directory. ``progress(bytes)`` is called as tensors are read;
    ``on_plan(total_bytes, skipped_names)`` once before any work. ``device``: where the statistics
    are computed ("auto": the GPU when there is one; tensors are read on the host either way).
    """
    if not checkpoints:
        raise StoreError("give at least one checkpoint to compare with BASE")
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
        probe = SpectralProbe(k=k, budget_ms=float("inf")) if k > 0 else None
        summary = DiffSummary(run_dir, steps, skipped=skipped)
        config = {"base": str(base), "checkpoints": [str(p) for p in paths], "steps": steps,
                  "tensors": tensors, "k": k, "eta": eta}
        created = not run_dir.exists()
        writer = RunWriter(run_dir, framework="checkpoint-diff", config=config, run_name=run_dir.name)
        ok = False
        try:
            if skipped:
                writer.event("checkpoint_diff_skipped", f"{len(skipped)} tensor names not in every checkpoint",
                             severity="warning", names=skipped)
            for name in names:
                summary.bytes_read += _diff_tensor(name, base_ck, cks, steps, times, stage, eta, probe, writer,
                                                   summary, progress, dev)
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
                 stage: str | None, eta: float, probe: SpectralProbe | None, writer: RunWriter,
                 summary: DiffSummary, progress: Callable[[int], None] | None, device: torch.device) -> int:
    w0 = base_ck.get(name).to(device)
    nbytes = _nbytes(base_ck.specs[name])
    if progress:
        progress(nbytes)
    read = nbytes
    prev = w0
    cols: dict[str, list] = {c: [] for c in ("step", "time_us", "w_norm", "update_norm", "changed_count",
                                             "changed_bf16_count", "sign_flip_count", "w_nan_count", "w_inf_count",
                                             "drift_norm", "drift_changed_count", "drift_changed_bf16_count",
                                             "w0_norm")}
    w0_norm = float(norms([w0])[0])
    spectra: list[dict] = []
    for ck, step, t_us in zip(cks, steps, times, strict=True):
        cur = ck.get(name).to(device)
        read += nbytes
        if progress:
            progress(nbytes)
        # Drift is computed as the live probe does, θ₀ as "new": its w_norm column is ‖θ₀‖ (the
        # drift_ratio denominator) and every other column is symmetric in the two arguments.
        if prev is w0:  # first checkpoint: the step and drift comparisons are the same pair
            s = weight_update_stats([cur], [w0], eta)[0].tolist()
            d = list(s)
            d[_COL["w_norm"]] = w0_norm
        else:
            s, d = weight_update_stats([cur, w0], [prev, cur], eta).tolist()
        for c in ("w_norm", "update_norm", "changed_count", "changed_bf16_count", "sign_flip_count", "w_nan_count", "w_inf_count"):
            cols[c].append(s[_COL[c]])
        cols["w0_norm"].append(d[_COL["w_norm"]])
        cols["drift_norm"].append(d[_COL["update_norm"]])
        cols["drift_changed_count"].append(d[_COL["changed_count"]])
        cols["drift_changed_bf16_count"].append(d[_COL["changed_bf16_count"]])
        cols["step"].append(step)
        cols["time_us"].append(t_us)
        if probe is not None and probe.eligible(name, cur, {name: w0}):
            for row in probe.record(step, stage, [(name, cur)], {name: w0}):
                row["time_us"] = t_us
                spectra.append(row)
        prev = cur
    if probe is not None:
        probe.forget(name)
    _write_rows(name, base_ck.specs[name], cols, stage, writer)
    if spectra:
        cols_s = {c: [r.get(c) for r in spectra] for c in spectra[0] if c not in ("stage", "tensor", "layer", "kind")}
        writer.append("spectra", {**cols_s, "stage": stage, "tensor": name, "layer": tensor_layer(name),
                                  "kind": tensor_kind(name)})
    summary.tensor_stats_rows += len(cols["step"])
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


def _nan_to_none(xs: list[float]) -> list[float | None]:
    return [None if x != x else x for x in xs]


def _write_rows(name: str, spec: tuple[tuple[int, ...], torch.dtype], cols: dict[str, list], stage: str | None,
                writer: RunWriter) -> None:
    numel = int(torch.Size(spec[0]).numel())

    def frac(xs: list) -> list:
        return [None if x is None or x != x else x / numel for x in xs] if numel else [None] * len(xs)

    def ratio(a: list, b: list) -> list:
        return [x / y if y else None for x, y in zip(a, b, strict=True)]

    counts = {c: _nan_to_none(cols[c]) for c in ("changed_count", "changed_bf16_count", "sign_flip_count",
                                                  "drift_changed_count", "drift_changed_bf16_count")}
    writer.append("tensor_stats", {
        "step": cols["step"], "time_us": cols["time_us"], "stage": stage, "tensor": name,
        "layer": tensor_layer(name), "kind": tensor_kind(name), "shape": "x".join(str(d) for d in spec[0]),
        "dtype": str(spec[1]).removeprefix("torch."), "numel": numel, "sharded": False,
        "w_norm": cols["w_norm"], "update_norm": cols["update_norm"], "update_ratio": ratio(cols["update_norm"], cols["w_norm"]),
        **{c: [None if x is None else int(x) for x in v] for c, v in counts.items()},
        "changed_frac": frac(counts["changed_count"]), "changed_bf16_frac": frac(counts["changed_bf16_count"]),
        "sign_flip_frac": frac(counts["sign_flip_count"]),
        "w_nan_count": [int(x) for x in cols["w_nan_count"]], "w_inf_count": [int(x) for x in cols["w_inf_count"]],
        "ref_covered": True, "drift_norm": cols["drift_norm"], "drift_ratio": ratio(cols["drift_norm"], cols["w0_norm"]),
        "drift_changed_frac": frac(counts["drift_changed_count"]),
        "drift_changed_bf16_frac": frac(counts["drift_changed_bf16_count"]),
    })
