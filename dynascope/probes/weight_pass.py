"""The post-step pass over the weights: every chunked statistic of a tensor in one fused pass, and the copies
the next steps need written while W_t is read.

At a record, the passes of declared statistics that cover a tensor (ΔW against the pre-step snapshot,
drift against θ₀, S_k against the bf16 snapshot k steps back) run as one pass (``stats.engine.Pass`` of
their statistics together), so each chunk of W_t is read once whatever it is compared with. The same pass
writes what the following steps compare against, element by element as it reads W_t:

* with every tensor recorded at every step, the next pre-step snapshot (``StepSnapshot.carry_views``): W_t
  into the arena, over the snapshot this pass has just read; the next pre-hook takes it over only if the
  version counters show no write since (``StepSnapshot.take``);
* S_k's next bf16 snapshot when one is due and resident (``Bf16History.buffers``), over the one used up.

``TensorStats.after`` runs this on the probe's background thread on a host (``probes.background``).

Before the first record at full coverage on a host (``prepare``, when ``watch()`` returns), the same thread
copies the weights into the arena as a carried snapshot, which the first pre-hook takes over unless
something wrote them since, and the compile thread loads the fused kernels the first records use: a first
record otherwise allocated and faulted in the arena and copied the weights inside the step, and ran its
passes on chunk tensors while the kernels loaded (docs/benchmarks.md, "Full coverage").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from dynascope.core.naming import normalize_name
from dynascope.stats.engine import Pass, Reader, flat_reader
from dynascope.stats.fused_many import Item

if TYPE_CHECKING:
    from dynascope.probes.params import LocalViews, Tracked
    from dynascope.probes.rows import Record
    from dynascope.probes.tensors import TensorStats

__all__ = ["prepare", "weight_pass"]

Plans = list[tuple[Pass, list[int]]]


def weight_pass(probe: TensorStats, rec: Record, plans: Plans, batched: Plans,
                inputs: dict[str, Callable[[int], Reader | None]], locals_: LocalViews, step: int,
                carry: bool) -> None:
    """The record's weight statistics into ``rec``, and the copies for the next steps (module docstring);
    ``carry``: W_t into the arena as the next pre-step snapshot (every tensor in the record, on a host)."""
    t0 = time.perf_counter()
    tracked, window = rec.tracked, rec.window
    device = locals_[0].device if len(rec.tracked) else torch.device("cpu")  # no tensor tracked: an empty record
    for p, rows in batched:
        rec.add(p.key, p.outputs, rows, p.run_batched([locals_[i] for i in rows]).to(device))
    copies: dict[int, list[tuple[str, Reader]]] = {}
    carried: list[torch.Tensor] = []
    if carry:
        carried = probe.snapshot.carry_views([locals_[i] for i in window])
        for i, v in zip(window, carried, strict=True):
            copies.setdefault(i, []).append(("new", flat_reader(v)))
    hist, names = probe.history, [normalize_name(t.name) for t in tracked]
    held = None if hist is None else hist.buffers(step, probe._schedule, list(zip(names, locals_, strict=True)),
                                                  lambda: probe.history_resident(tracked, list(locals_)))
    if held is not None:
        for i, n in enumerate(names):
            copies.setdefault(i, []).append(("new", flat_reader(held[n])))
    _passes(probe, rec, plans, inputs, locals_, copies)
    if any(rows for _, rows in plans):
        probe.window.charge(t0)
    if carry:
        probe.snapshot.carried()
        probe._copies = (step, {tracked[i].name: v for i, v in zip(window, carried, strict=True)})
    if held is not None:
        hist.adopt(step, list(zip(names, locals_, strict=True)), held)  # type: ignore[union-attr]
    elif hist is not None:
        probe._snapshot(step, tracked, locals_)


def _passes(probe: TensorStats, rec: Record, plans: Plans, inputs: dict[str, Callable[[int], Reader | None]],
            locals_: LocalViews, copies: dict[int, list[tuple[str, Reader]]]) -> None:
    """Every chunked pass of the weights, one fused pass per tensor, and the copies of tensors no pass read."""
    covering: dict[int, list[int]] = {}
    for k, (_, rows) in enumerate(plans):
        for i in rows:
            covering.setdefault(i, []).append(k)
    device = locals_[0].device if len(rec.tracked) else torch.device("cpu")  # no tensor tracked: an empty record
    groups: dict[tuple[int, ...], list[int]] = {}  # tensors covered by the same passes: one fused run of all
    for i, ks in covering.items():
        groups.setdefault(tuple(ks), []).append(i)
    results: dict[int, torch.Tensor] = {}
    for ks, rows in groups.items():
        merged = _merged(probe, ks, [p for p, _ in plans])
        items = [Item({n: inputs[n](i) for n in merged.inputs}, locals_[i].numel(),  # type: ignore[misc]
                      copies=copies.get(i, ())) for i in rows]
        results.update(zip(rows, merged.run_many(items, probe.settings, chunk_elems=rec.chunk_elems), strict=True))
    for i, dests in copies.items():
        if i not in covering:
            w = locals_[i].reshape(-1)
            for _, dest in dests:
                dest(0, w.numel()).copy_(w)
    for k, (p, rows) in enumerate(plans):
        out: list[Any] = []
        for i in rows:
            off = sum(len(plans[q][0].outputs) for q in covering[i] if q < k)
            out.append(results[i][off:off + len(p.outputs)])
        rec.add(p.key, p.outputs, rows, torch.stack(out) if out else
                torch.zeros((0, len(p.outputs)), dtype=torch.float64, device=device))
        if rows and "k_snapshot" in p.inputs:
            rec.constants[p.key] = {"bf16_k_steps": probe.history.k}  # type: ignore[union-attr]


def _merged(probe: TensorStats, ks: tuple[int, ...], chunked: list[Pass]) -> Pass:
    """The one pass of the chunked weight passes ``ks`` (indices into ``chunked``), made once per probe."""
    merged = probe._merged.get(ks)
    if merged is None:
        merged = probe._merged[ks] = Pass([s for k in ks for s in chunked[k].statistics])
    return merged


def prepare(probe: TensorStats, tracked: list[Tracked], step: int) -> None:
    """Ahead of the first record at full coverage on a host: its pre-step snapshot copied on the pass thread,
    and the fused kernels of the gradient passes and of the merged weight passes loading (module docstring)."""
    locals_ = [t.local() for t in tracked]
    if (probe.memory_budget is not None or not locals_ or any(w.device.type != "cpu" for w in locals_)
            or not probe._schedule(step)):
        return
    chunked = [p for p in probe.weight_passes if not p.batched]
    for dtype in {w.dtype for w in locals_}:
        for p in probe.grad_passes:  # a batched pass runs each statistic's own kernel (stats.kernels.norms)
            for q in [p] if not p.batched else [Pass([s]) for s in p.statistics if s.element is not None]:
                q.prepare({"grad": dtype})
        dtypes = {"new": dtype, "old": dtype, "ref": dtype, "k_snapshot": torch.bfloat16}
        base = {"new", "old"} | ({"ref"} if probe.reference is not None else set())  # θ₀ at every full record
        # (inputs held, copies): every record; S_k's snapshot steps; its compare steps, which take the next one
        shapes = [(base, [("new", dtype)])]
        if probe.history is not None:
            shapes += [(base, [("new", dtype), ("new", torch.bfloat16)]),
                       (base | {"k_snapshot"}, [("new", dtype), ("new", torch.bfloat16)])]
        for held, copies in shapes:
            ks = tuple(k for k, p in enumerate(chunked) if held.issuperset(p.inputs))
            if ks:
                _merged(probe, ks, chunked).prepare(dtypes, copies)
    if probe._needs_old:
        def job() -> None:
            views = probe.snapshot.carry_views(locals_)
            torch._foreach_copy_(views, locals_)
            probe.snapshot.carried()
        probe._pass.submit(job)
