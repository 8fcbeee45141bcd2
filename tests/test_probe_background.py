"""The post-step weight pass on its background thread: waited for at the next step, guarded by versions."""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn

import dynascope
from dynascope.probes import tensors
from dynascope.store import open_store


def _step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor) -> None:
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _watched(tmp_path, d: int) -> tuple[nn.Module, torch.optim.Optimizer, torch.Tensor, dynascope.Scope]:
    """A d×d linear layer under SGD, watched at full coverage without θ₀, and one batch."""
    torch.manual_seed(0)
    model = nn.Linear(d, d)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=tmp_path / "r", memory_budget=None, time_budget=None, reference=None,
                            system_interval_s=None)
    return model, opt, torch.randn(4, d), scope


def test_weights_changed_during_the_pass_are_null(tmp_path, monkeypatch) -> None:
    """A weight edited in place while the pass runs loses that step's weight statistics (NULL) and the step
    gets a weights_changed event; the tensor the edit did not touch keeps its values."""
    model, opt, x, scope = _watched(tmp_path, 8)
    gate, started = threading.Event(), threading.Event()
    passes = tensors.weight_pass

    def held(*a, **k):  # the pass starts, then waits until the edit below is done
        started.set()
        assert gate.wait(30)
        return passes(*a, **k)
    monkeypatch.setattr(tensors, "weight_pass", held)
    model(x).square().mean().backward()
    opt.step()  # the post-hook hands the pass to its thread and returns
    assert started.wait(30)
    with torch.no_grad():
        model.weight.add_(1.0)
    gate.set()
    opt.zero_grad(set_to_none=True)
    monkeypatch.setattr(tensors, "weight_pass", passes)
    _step(model, opt, x)  # its pre-hook waits for the held pass
    scope.close()
    store = open_store(tmp_path / "r")
    rows = dict(((s, t), (u, g)) for s, t, u, g in store.rows(
        "SELECT step, tensor, update_norm, grad_norm FROM tensor_stats"))
    assert rows[(0, "weight")][0] is None and rows[(0, "weight")][1] is not None  # ‖g‖ was read in the step
    assert rows[(0, "bias")][0] is not None
    assert rows[(1, "weight")][0] is not None
    events = store.rows("SELECT step, message FROM events WHERE event = 'weights_changed'")
    assert [e[0] for e in events] == [0] and "weight" in events[0][1]


def test_the_next_step_waits_for_the_pass(tmp_path) -> None:
    """The optimizer never steps while the previous pass reads the weights: ΔW of every step is the step's."""
    model, opt, x, scope = _watched(tmp_path, 16)
    want = []
    for _ in range(4):
        before = model.weight.detach().clone()
        _step(model, opt, x)
        want.append(torch.linalg.vector_norm(model.weight.detach().double() - before.double()).item())
    scope.close()
    got = [u for (u,) in open_store(tmp_path / "r").rows(
        "SELECT update_norm FROM tensor_stats WHERE tensor = 'weight' ORDER BY step")]
    assert len(got) == 4 and all(abs(a - b) <= 1e-6 * b for a, b in zip(got, want, strict=True))


def test_the_first_snapshot_is_copied_before_the_first_step(tmp_path) -> None:
    """At full coverage watch() has the pass thread copy the weights for the first step's snapshot; the first
    step uses that copy only if nothing wrote the weights since, so ΔW of step 0 is the step's either way."""
    for edit in (False, True):
        model, opt, x, scope = _watched(tmp_path / str(edit), 16)
        scope.stats._pass.wait()
        assert scope.stats.snapshot._carried is not None  # copied off the training thread, before any step
        if edit:
            with torch.no_grad():
                model.weight.mul_(2.0)  # after the copy: the first step must not compare against it
        before = model.weight.detach().clone()
        _step(model, opt, x)
        want = torch.linalg.vector_norm(model.weight.detach().double() - before.double()).item()
        scope.close()
        (got,), = open_store(tmp_path / str(edit) / "r").rows(
            "SELECT update_norm FROM tensor_stats WHERE tensor = 'weight' AND step = 0")
        assert abs(got - want) <= 1e-6 * want


def test_watch_loads_the_kernels_the_first_records_use(tmp_path, monkeypatch) -> None:
    """The fused kernels watch() starts loading at full coverage are the ones the records then ask for
    (gradient counts; the merged weight pass with θ₀, with and without S_k and its snapshot's copy)."""
    from dynascope.stats import fused

    if not fused.available():
        pytest.skip("numba is not installed")
    monkeypatch.setattr(fused, "_kernels", {})
    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scope = dynascope.watch(model, opt, run=tmp_path / "r", memory_budget=None, time_budget=None, bf16_k=2,
                            system_interval_s=None)
    prepared = set(fused._kernels)
    x = torch.randn(4, 16)
    for _ in range(5):  # S_k's snapshot at steps 0 and 2, compared at 2 and 4
        _step(model, opt, x)
    scope.close()
    assert prepared and set(fused._kernels) == prepared


def test_pass_jobs_run_on_their_own_openmp_count() -> None:
    """A weight-pass job's torch ops run on one OpenMP thread, a job that asks for the caller's count (the
    spectra) gets it, and neither changes the count of the training thread or of threads started later."""
    from dynascope.probes.background import PassThread, set_openmp_threads

    if not set_openmp_threads(torch.get_num_threads()) or torch.get_num_threads() < 2:
        pytest.skip("needs torch's OpenMP runtime and 2 or more intra-op threads")
    passes = PassThread()
    try:
        assert passes.submit(torch.get_num_threads).result() == 1
        assert passes.submit(torch.get_num_threads, threads=None).result() == torch.get_num_threads()
        assert passes.submit(torch.get_num_threads).result() == 1  # each job sets its own, on the same thread
    finally:
        passes.close()
    later: list[int] = []
    t = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert later == [torch.get_num_threads()] and torch.get_num_threads() >= 2


def test_spectra_on_the_carried_copies_do_not_hold_the_next_step(tmp_path, monkeypatch) -> None:
    """At full coverage the spectra read the copy of W_t the weight pass carries into the arena: the next
    optimizer step runs while they are still running, and they see W_t, not the weights that step wrote."""
    from dynascope.probes.spectral import SpectralProbe

    torch.manual_seed(0)
    model = nn.Linear(16, 16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gate, seen = threading.Event(), {}
    record = SpectralProbe.record

    def held(self, step, stage, named, reference):  # step 0's record waits until step 1 is done
        if step == 0:
            seen["released"] = gate.wait(timeout=120)
            seen["w"] = {n: w.clone() for n, w in named}
        return record(self, step, stage, named, reference)

    monkeypatch.setattr(SpectralProbe, "record", held)
    scope = dynascope.watch(model, opt, run=tmp_path / "r", memory_budget=None, time_budget=None,
                            reference="init", spectral={"every": 1, "time_budget": None, "k": 2},
                            system_interval_s=None)
    x = torch.randn(4, 16)
    _step(model, opt, x)
    w0 = model.weight.detach().clone()  # W after step 0's optimizer step
    _step(model, opt, x)  # its pre-hook would wait for the gated spectra if they held the step
    gate.set()
    scope.close()
    assert seen["released"], "step 1 waited for step 0's spectra"
    assert not torch.equal(model.weight, w0) and torch.equal(seen["w"]["weight"], w0)
    with open_store(tmp_path / "r") as con:
        rows = con.frame("SELECT step, tensor, rank1_energy FROM spectra ORDER BY step")
        events = con.frame("SELECT event FROM events WHERE event = 'weights_changed'")
    assert rows["step"].to_list() == [0, 1] and rows["rank1_energy"].is_not_null().all() and events.is_empty()
