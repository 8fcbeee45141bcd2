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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from dynascope.core.naming import normalize_name
from dynascope.core.warn import warn

__all__ = ["LOGPROB_GAP_THRESHOLD_NATS", "RATIO_BAND", "TRAINER_SELF", "Fingerprint", "SyncMismatch",
           "compare_fingerprints", "logprob_gap_columns", "logprob_gap_totals", "verify_weight_sync",
           "weight_fingerprints"]

# A token whose two engines' probabilities differ by more than a factor e^0.1 ≈ 1.105 counts as "over".
LOGPROB_GAP_THRESHOLD_NATS = 0.1
# The importance-ratio band exp(Δ) ∈ [0.9, 1.1] that PPO-style clipping and the mismatch reports use.
RATIO_BAND = (0.9, 1.1)
# Key prefix of the trainer-vs-trainer gap (the same tokens recomputed twice by the trainer) in ``scalars``.
TRAINER_SELF = "trainer_self/"


@torch.no_grad()
def logprob_gap_columns(rollout_logprobs: Tensor, trainer_logprobs: Tensor, mask: Tensor,
                        threshold_nats: float = LOGPROB_GAP_THRESHOLD_NATS) -> dict[str, list]:
    """Per sample (row of the [B, T] inputs), the ``samples`` columns of the log-prob gap over ``mask``'s tokens.

    ``logprob_gap_tokens_count`` tokens compared, ``logprob_gap_sum_nats`` Σ|Δ| (so any set of samples pools
    to a mean Σ/Σtokens), ``logprob_gap_max_nats``, ``logprob_gap_over_count`` tokens with |Δ| >
    ``threshold_nats``, the threshold itself, and ``logprob_ratio_outside_count`` tokens whose importance
    ratio exp(Δ) lies outside ``RATIO_BAND`` (Δ = rollout − trainer). Pass them on:
    ``scope.samples(..., **columns)``. A sample with no token to compare has NULL sum, max and counts of
    tokens over; a NaN log-prob makes them NULL too.
    """
    m = mask.to(torch.bool)
    delta = rollout_logprobs.detach().double() - trainer_logprobs.detach().double()
    delta = torch.where(m, delta, torch.zeros((), dtype=delta.dtype, device=delta.device))
    gap = delta.abs()
    lo, hi = math.log(RATIO_BAND[0]), math.log(RATIO_BAND[1])
    tokens = m.sum(1)
    stats = torch.stack([tokens.double(), gap.sum(1), gap.amax(1), (gap > threshold_nats).sum(1).double(),
                         ((delta < lo) | (delta > hi)).sum(1).double()], 1)
    rows = stats.cpu().tolist()  # one host copy for the batch
    out: dict[str, list] = {"logprob_gap_tokens_count": [], "logprob_gap_sum_nats": [], "logprob_gap_max_nats": [],
                            "logprob_gap_over_count": [], "logprob_gap_threshold_nats": [],
                            "logprob_ratio_outside_count": []}
    for n, total, peak, over, outside in rows:
        seen = n > 0 and not math.isnan(total)
        out["logprob_gap_tokens_count"].append(int(n))
        out["logprob_gap_sum_nats"].append(total if seen else None)
        out["logprob_gap_max_nats"].append(peak if seen else None)
        out["logprob_gap_over_count"].append(int(over) if seen else None)
        out["logprob_gap_threshold_nats"].append(float(threshold_nats))
        out["logprob_ratio_outside_count"].append(int(outside) if seen else None)
    return out


def logprob_gap_totals(columns: dict[str, list], prefix: str = TRAINER_SELF) -> dict[str, float]:
    """``logprob_gap_columns``' per-sample columns pooled over a batch, as ``scalars`` keys under ``prefix``:
    the counts and Σ|Δ| summed over the samples that had tokens, the max of the maxima. For a gap that is not
    one row per sample, such as the trainer's log-probs of the same tokens computed twice (``TRAINER_SELF``):
    ``scope.log(**logprob_gap_totals(logprob_gap_columns(second, first, mask)))``."""
    seen = [i for i, v in enumerate(columns["logprob_gap_sum_nats"]) if v is not None]
    out = {"logprob_gap_tokens_count": float(sum(columns["logprob_gap_tokens_count"][i] for i in seen))}
    for key in ("logprob_gap_sum_nats", "logprob_gap_over_count", "logprob_ratio_outside_count"):
        out[key] = float(sum(columns[key][i] for i in seen))
    out["logprob_gap_max_nats"] = max((columns["logprob_gap_max_nats"][i] for i in seen), default=math.nan)
    out["logprob_gap_threshold_nats"] = float(columns["logprob_gap_threshold_nats"][0]) if columns[
        "logprob_gap_threshold_nats"] else math.nan
    return {prefix + k: v for k, v in out.items()}


@dataclass(frozen=True)
class Fingerprint:
    """What one side of a weight sync holds for one tensor: its shape, dtype and two checksums of its bits.

    With x's bit patterns read as integers (int16 for bf16/fp16, int32 for fp32) and x viewed as
    [shape[0], −1] (a 0-D or 1-D tensor: one row per element), ``bit_sum`` is Σ bits and ``bit_moment``
    Σ_r (r + 1)·Σ_c bits[r, c], both modulo 2⁶⁴. Integer sums do not depend on the order of summation, so
    two processes get the same checksums for the same bits whatever their threads; a stale tensor changes
    ``bit_sum`` and a permuted or transposed one ``bit_moment``.
    """

    shape: tuple[int, ...]
    dtype: str
    bit_sum: int
    bit_moment: int


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _named(src: Any) -> list[tuple[str, Tensor]]:
    if hasattr(src, "named_parameters"):
        src = src.named_parameters()
    elif isinstance(src, Mapping):
        src = src.items()
    return [(normalize_name(n), t) for n, t in src]


def _cast(t: Tensor, want: torch.dtype | None) -> Tensor:
    x = t.detach()
    return (x.to(want) if want is not None and x.dtype != want else x).contiguous()


@torch.no_grad()
def weight_fingerprints(named: Any, dtype: torch.dtype | Mapping[str, torch.dtype] | None = None) -> dict[str, Fingerprint]:
    """``Fingerprint`` per tensor of a module, a state dict or (name, tensor) pairs, each tensor first cast to
    ``dtype`` (one dtype, a dtype per name, or None: as stored). Run it on either side of a sync (the
    rollout engine's process computes its own); one pass over the bits, one host copy for all tensors."""
    sums: list[Tensor] = []
    meta: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    for name, t in _named(named):
        x = _cast(t, dtype.get(name) if isinstance(dtype, Mapping) else dtype)
        bits = x.view(_INT_VIEW[x.element_size()]) if x.is_floating_point() else x
        rows = bits.reshape(x.shape[0] if x.ndim > 1 else max(x.numel(), 1), -1)
        # 16-bit patterns summed over a row of up to 2¹⁶ fit int32 exactly (a third faster than int64 here)
        narrow = bits.element_size() <= 2 and rows.shape[1] <= 1 << 16
        row_sums = rows.sum(1, dtype=torch.int32 if narrow else torch.int64).to(torch.int64)
        weights = torch.arange(1, rows.shape[0] + 1, dtype=torch.int64, device=rows.device)
        sums.append(torch.stack([row_sums.sum(), (row_sums * weights).sum()]))
        meta.append((name, tuple(x.shape), x.dtype))
    if not sums:
        return {}
    return {name: Fingerprint(shape, str(dt).removeprefix("torch."), s, m)
            for (name, shape, dt), (s, m) in zip(meta, torch.stack(sums).cpu().tolist(), strict=True)}


@dataclass(frozen=True)
class SyncMismatch:
    """One tensor the rollout copy does not hold as the trainer does: ``reason`` is "values", "shape",
    "dtype", "missing" (the trainer has it, the rollout not) or "extra". For "values" with both copies at
    hand, ``differing_count`` elements differ and ``diff_rel`` is ‖rollout − cast(trainer)‖ / ‖cast(trainer)‖."""

    tensor: str
    reason: str
    differing_count: int | None = None
    diff_rel: float | None = None


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
            out.append(SyncMismatch(name, "values"))
    out += [SyncMismatch(name, "extra") for name in rollout if name not in trainer]
    return out


@torch.no_grad()
def _measured(m: SyncMismatch, trainer: dict[str, Tensor], rollout: dict[str, Tensor]) -> SyncMismatch:
    """How far a mismatched tensor is off, when both copies are in this process (rare: only mismatches)."""
    if m.reason != "values" or m.tensor not in trainer or m.tensor not in rollout:
        return m
    r = rollout[m.tensor].detach()
    t = _cast(trainer[m.tensor], r.dtype).to(r.device)
    diff = (r.float() - t.float())
    ref = torch.linalg.vector_norm(t.float())
    stats = torch.stack([(r != t).sum().double(), torch.linalg.vector_norm(diff).double() / ref.double()]).cpu().tolist()
    return SyncMismatch(m.tensor, m.reason, int(stats[0]), stats[1])


def verify_weight_sync(scope: Any, trainer: Any, rollout: Any, *, max_named: int = 20) -> list[SyncMismatch]:
    """Check a weight sync: the rollout copy against the trainer's weights cast to the rollout's dtypes.

    ``trainer`` is the trained module (or its state dict / named tensors); ``rollout`` the rollout copy in
    the same forms, or the ``weight_fingerprints`` the rollout engine computed of its own weights. Logs the
    scalars ``weight_sync/tensors_checked`` and ``weight_sync/mismatched_tensors``; a mismatch is also a
    ``weight_sync_mismatch`` event (severity error) naming up to ``max_named`` tensors. Returns the
    mismatches; never raises into the training loop (a failed check is a warning and a probe_error event).
    """
    try:
        remote = _is_fingerprints(rollout)
        rollout_named = {} if remote else dict(_named(rollout))
        got = rollout if remote else weight_fingerprints(list(rollout_named.items()))
        dtypes = {n: getattr(torch, f.dtype) for n, f in got.items()}
        trainer_named = dict(_named(trainer))
        want = weight_fingerprints(list(trainer_named.items()), dtypes)
        bad = [_measured(m, trainer_named, rollout_named) for m in compare_fingerprints(want, got)]
    except Exception as exc:  # the check must not stop training
        warn(f"dynascope: weight-sync check failed: {type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=2)
        scope.event("probe_error", f"weight_sync_check: {type(exc).__name__}: {exc}", severity="warning",
                    check="weight_sync")
        return []
    scope.log(**{"weight_sync/tensors_checked": len(want), "weight_sync/mismatched_tensors": len(bad)})
    if bad:
        named = [f"{m.tensor} ({m.reason}" + (f": {m.differing_count} elements, ‖Δ‖/‖W‖ = {m.diff_rel:.2e}"
                                               if m.differing_count is not None else "") + ")" for m in bad[:max_named]]
        more = f" and {len(bad) - max_named} more" if len(bad) > max_named else ""
        scope.event("weight_sync_mismatch", f"{len(bad)} of {len(want)} tensors differ from the trainer's weights "
                    f"cast to the rollout dtype: {', '.join(named)}{more}", severity="error",
                    tensors=[m.tensor for m in bad], reasons=[m.reason for m in bad], checked=len(want))
    return bad


def _is_fingerprints(x: Any) -> bool:
    return isinstance(x, Mapping) and bool(x) and all(isinstance(v, Fingerprint) for v in x.values())
