"""Trainer↔rollout consistency: the per-token log-prob gap, and a check of each weight sync.

An RL trainer samples with one copy of the policy (an inference engine such as vLLM or SGLang, usually in
bf16) and trains another (fp32 master weights). Two things make the copies disagree, and both bias the
policy gradient without raising an error:

- the engines compute different probabilities for the same tokens (dtype, kernels, KV cache, sampling
  code): the *log-prob gap* of a token is |log π_rollout(y_t) − log π_trainer(y_t)|, recorded per sample
  by ``logprob_gap_columns`` as columns of the ``samples`` table;
- a weight sync that did not deliver what the trainer holds (a tensor left stale, a name mapped to the
  wrong tensor, a transposed layout): ``verify_weight_sync`` compares per-tensor fingerprints of the
  rollout copy with those of the trainer's weights cast to the rollout's dtype. Bit-identical tensors
  give identical fingerprints, so any difference is a mismatch beyond the cast, written as a
  ``weight_sync_mismatch`` event naming the tensors.

Both cost one pass over what they read and one host copy per call, not per tensor.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import normalize_name

__all__ = ["LOGPROB_GAP_THRESHOLD_NATS", "Fingerprint", "SyncMismatch", "compare_fingerprints",
           "logprob_gap_columns", "verify_weight_sync", "weight_fingerprints"]

# A token whose two engines' probabilities differ by more than a factor e^0.1 ≈ 1.105 counts as "over".
LOGPROB_GAP_THRESHOLD_NATS = 0.1


@torch.no_grad()
def logprob_gap_columns(rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor,
                        threshold_nats: float = LOGPROB_GAP_THRESHOLD_NATS) -> dict[str, list]:
    """Per sample (row of the [B, T] inputs), the ``samples`` columns of the log-prob gap over ``mask``'s tokens.

    ``logprob_gap_tokens_count`` tokens compared, ``logprob_gap_sum_nats`` Σ|Δ| (so any set of samples pools
    to a mean Σ/Σtokens), ``logprob_gap_max_nats``, ``logprob_gap_over_count`` tokens with |Δ| >
    ``threshold_nats`` and the threshold itself. Pass them on: ``scope.samples(..., **columns)``. A sample
    with no token to compare has a NULL sum and max; a NaN log-prob makes its sum and max NULL.
    """
    m = mask.to(torch.bool)
    gap = (rollout_logprobs.detach().double() - trainer_logprobs.detach().double()).abs()
    gap = torch.where(m, gap, torch.zeros((), dtype=gap.dtype, device=gap.device))
    tokens = m.sum(1)
    stats = torch.stack([tokens.double(), gap.sum(1), gap.amax(1), (gap > threshold_nats).sum(1).double()], 1)
    rows = stats.cpu().tolist()  # one host copy for the batch
    out: dict[str, list] = {"logprob_gap_tokens_count": [], "logprob_gap_sum_nats": [], "logprob_gap_max_nats": [],
                            "logprob_gap_over_count": [], "logprob_gap_threshold_nats": []}
    for n, total, peak, over in rows:
        seen = n > 0 and not math.isnan(total)
        out["logprob_gap_tokens_count"].append(int(n))
        out["logprob_gap_sum_nats"].append(total if seen else None)
        out["logprob_gap_max_nats"].append(peak if seen else None)
        out["logprob_gap_over_count"].append(int(over) if seen else None)
        out["logprob_gap_threshold_nats"].append(float(threshold_nats))
    return out


@dataclass(frozen=True)
class Fingerprint:
    """What one side of a weight sync holds for one tensor: shape, dtype, two checksums of its bits, its norm.

    With x's bit patterns read as integers (int16 for bf16/fp16, int32 for fp32) and x viewed as
    [shape[0], −1] (a 0-D or 1-D tensor: one row per element), ``bit_sum`` is Σ bits and ``bit_moment``
    Σ_r (r + 1)·Σ_c bits[r, c], both modulo 2⁶⁴. Integer sums do not depend on the order of summation, so
    two processes get the same checksums for the same bits whatever their threads; a stale tensor changes
    ``bit_sum`` and a permuted or transposed one ``bit_moment``. ``norm`` (‖x‖₂) says how far off it is.
    """

    shape: tuple[int, ...]
    dtype: str
    bit_sum: int
    bit_moment: int
    norm: float


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _named(src: Any) -> list[tuple[str, Tensor]]:
    if hasattr(src, "named_parameters"):
        src = src.named_parameters()
    elif isinstance(src, Mapping):
        src = src.items()
    return [(normalize_name(n), t) for n, t in src]


@torch.no_grad()
def weight_fingerprints(named: Any, dtype: torch.dtype | Mapping[str, torch.dtype] | None = None) -> dict[str, Fingerprint]:
    """``Fingerprint`` per tensor of a module, a state dict or (name, tensor) pairs, each tensor first cast to
    ``dtype`` (one dtype, a dtype per name, or None: as stored). Run it on either side of a sync (the
    rollout engine's process computes its own); one host copy for all tensors."""
    sums: list[Tensor] = []
    norms: list[Tensor] = []
    meta: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, t in _named(named):
        want = dtype.get(name) if isinstance(dtype, Mapping) else dtype
        x = t.detach()
        if want is not None and x.dtype != want:
            x = x.to(want)
        x = x.contiguous()
        bits = x.view(_INT_VIEW[x.element_size()]) if x.is_floating_point() else x
        rows = bits.reshape(x.shape[0] if x.ndim > 1 else max(x.numel(), 1), -1)
        row_sums = rows.sum(1, dtype=torch.int64)
        weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64, device=rows.device)
        sums.append(torch.stack([row_sums.sum(), (row_sums * weights).sum()]))
        norms.append(torch.linalg.vector_norm(x.float()) if x.is_floating_point() else
                     torch.tensor(float("nan"), device=x.device))
        meta.append((name, tuple(x.shape), x.dtype))
    if not sums:
        return {}
    ints, floats = torch.stack(sums).cpu().tolist(), torch.stack(norms).double().cpu().tolist()
    return {name: Fingerprint(shape, str(dt).removeprefix("torch."), s, m, n)
            for (name, shape, dt), (s, m), n in zip(meta, ints, floats, strict=True)}


@dataclass(frozen=True)
class SyncMismatch:
    """One tensor the rollout copy does not hold as the trainer does: ``reason`` is "values", "shape",
    "dtype", "missing" (the trainer has it, the rollout not) or "extra"; ``norm_rel_diff`` is
    |‖rollout‖ − ‖trainer‖| / ‖trainer‖ for "values"."""

    tensor: str
    reason: str
    norm_rel_diff: float | None = None


def compare_fingerprints(trainer: Mapping[str, Fingerprint], rollout: Mapping[str, Fingerprint]) -> list[SyncMismatch]:
    """Every tensor whose fingerprints differ, in the trainer's order (then the rollout's extra tensors)."""
    out = []
    for name, want in trainer.items():
        got = rollout.get(name)
        if got is None:
            out.append(SyncMismatch(name, "missing"))
        elif got.shape != want.shape:
            out.append(SyncMismatch(name, "shape"))
        elif got.dtype != want.dtype:
            out.append(SyncMismatch(name, "dtype"))
        elif (got.bit_sum, got.bit_moment) != (want.bit_sum, want.bit_moment):
            rel = abs(got.norm - want.norm) / want.norm if want.norm else math.inf
            out.append(SyncMismatch(name, "values", rel))
    out += [SyncMismatch(name, "extra") for name in rollout if name not in trainer]
    return out


def verify_weight_sync(scope: Any, trainer: Any, rollout: Any, *, max_named: int = 20) -> list[SyncMismatch]:
    """Check a weight sync: the rollout copy against the trainer's weights cast to the rollout's dtypes.

    ``trainer`` is the trained module (or its state dict / named tensors); ``rollout`` the rollout copy in
    the same forms, or the ``weight_fingerprints`` the rollout engine computed of its own weights. Logs the
    scalars ``weight_sync/tensors_checked`` and ``weight_sync/mismatched_tensors``; a mismatch is also a
    ``weight_sync_mismatch`` event (severity error) naming up to ``max_named`` tensors. Returns the
    mismatches; never raises into the training loop (a failed check is a warning and a probe_error event).
    """
    try:
        got = rollout if _is_fingerprints(rollout) else weight_fingerprints(rollout)
        dtypes = {n: getattr(torch, f.dtype) for n, f in got.items()}
        want = weight_fingerprints(trainer, dtypes)
        bad = compare_fingerprints(want, got)
    except Exception as exc:  # the check must not stop training
        warnings.warn(f"dynascope: weight-sync check failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        scope.event("probe_error", f"weight_sync_check: {type(exc).__name__}: {exc}", severity="warning",
                    check="weight_sync")
        return []
    scope.log(**{"weight_sync/tensors_checked": len(want), "weight_sync/mismatched_tensors": len(bad)})
    if bad:
        named = [f"{m.tensor} ({m.reason}" + (f", ‖·‖ off by {m.norm_rel_diff:.2e}" if m.norm_rel_diff is not None
                                               else "") + ")" for m in bad[:max_named]]
        more = f" and {len(bad) - max_named} more" if len(bad) > max_named else ""
        scope.event("weight_sync_mismatch", f"{len(bad)} of {len(want)} tensors differ from the trainer's weights "
                    f"cast to the rollout dtype: {', '.join(named)}{more}", severity="error",
                    tensors=[m.tensor for m in bad], reasons=[m.reason for m in bad], checked=len(want))
    return bad


def _is_fingerprints(x: Any) -> bool:
    return isinstance(x, Mapping) and bool(x) and all(isinstance(v, Fingerprint) for v in x.values())
