"""`dynascope diff`: same figures as the live probe, every input format, planted sparsity, clear errors."""

from __future__ import annotations

import json
import struct
import weakref

import pytest
import torch
import torch.nn as nn
from safetensors.torch import save_file
from typer.testing import CliRunner

import dynascope
from dynascope.analyses import sparsity_over_training
from dynascope.cli import app
from dynascope.importers import checkpoint_diff
from dynascope.importers.checkpoint_diff import checkpoint_steps, diff_checkpoints
from dynascope.store import StoreError, open_store

STAT_COLS = ("w_norm", "update_norm", "update_ratio", "changed_count", "changed_frac", "changed_rel_count",
             "sign_flip_count", "w_nan_count", "w_inf_count", "drift_norm", "drift_ratio", "drift_changed_count",
             "drift_changed_rel_count", "bf16_unchanged_count", "bf16_unchanged_frac", "drift_unchanged_count",
             "drift_unchanged_frac", "drift_zero_count", "drift_zero_frac", "numel", "kind", "layer", "shape", "dtype")
SPECTRA_COLS = ("drift_norm", "sigma", "rank1_energy", "topk_energy", "stable_rank", "effective_rank", "u1", "v1",
                "angle_left_deg", "angle_right_deg", "off_principal_energy", "spectral_drift", "rows", "cols", "k")


class Tiny(nn.Module):
    """HF-style names; one bf16 projection so bit-exact counts are checked in a 16-bit dtype too."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(40, 16)
        self.layers = nn.ModuleList([nn.ModuleDict({
            "q_proj": nn.Linear(16, 16), "up_proj": nn.Linear(16, 32), "down_proj": nn.Linear(32, 16),
            "norm": nn.LayerNorm(16)}) for _ in range(2)])
        self.layers[1]["q_proj"].to(torch.bfloat16)
        self.lm_head = nn.Linear(16, 40, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x)
        for blk in self.layers:
            q = blk["q_proj"](h.to(blk["q_proj"].weight.dtype)).float()
            h = blk["norm"](h + q + blk["down_proj"](torch.relu(blk["up_proj"](h))))
        return self.lm_head(h)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_live_probe_and_diff_agree(tmp_path):
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    save_file(_state(model), tmp_path / "base.safetensors")
    scope = dynascope.watch(model, opt, run=tmp_path / "live", every=1, memory_budget=None, system_interval_s=None,
                            spectral=dict(every=1, k=4, time_budget=None))
    ckpts = []
    for _ in range(4):
        x = torch.randint(0, 40, (4, 8))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.roll(1, 1).flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        # Named by the live step of this update (the scope's first optimizer step is step 0).
        ckpts.append(tmp_path / f"ckpt-{scope.step_index - 1}.safetensors")
        save_file(_state(model), ckpts[-1])
    scope.close()
    diff_checkpoints(tmp_path / "base.safetensors", ckpts, tmp_path / "diff", k=4)

    def rows(run, table, cols):
        with open_store(run) as con:
            df = con.sql(f"SELECT step, tensor, {', '.join(cols)} FROM {table} ORDER BY step, tensor").pl()
        return {(r["step"], r["tensor"]): r for r in df.iter_rows(named=True)}

    live, off = rows(tmp_path / "live", "tensor_stats", STAT_COLS), rows(tmp_path / "diff", "tensor_stats", STAT_COLS)
    assert set(off) == set(live) and len(off) == 4 * len(_state(model))
    for key, row in off.items():
        for col in STAT_COLS:
            a, b = row[col], live[key][col]
            assert (a == pytest.approx(b, rel=1e-9, abs=1e-12)) if isinstance(a, float) else a == b, (key, col, a, b)
    assert any(r["changed_count"] < r["numel"] for r in off.values())  # not a trivially all-changed case
    live_s, off_s = rows(tmp_path / "live", "spectra", SPECTRA_COLS), rows(tmp_path / "diff", "spectra", SPECTRA_COLS)
    two_d = [n for n, t in _state(model).items() if t.ndim == 2]
    assert set(off_s) == set(live_s) == {(s, n) for s in range(4) for n in two_d}
    for key, row in off_s.items():
        for col in SPECTRA_COLS:
            a, b = row[col], live_s[key][col]
            if isinstance(a, list):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-7), (key, col)
            elif isinstance(a, float):
                assert a == pytest.approx(b, rel=1e-6, abs=1e-9), (key, col)
            else:
                assert a == b, (key, col)


def _write_formats(tmp_path, sd: dict[str, torch.Tensor], name: str):
    """The same state dict as a safetensors file, a sharded HF folder and a torch .pt file."""
    st = tmp_path / f"{name}.safetensors"
    save_file(sd, st)
    folder = tmp_path / f"{name}-sharded"
    folder.mkdir()
    keys = list(sd)
    shards = {"model-00001-of-00002.safetensors": keys[::2], "model-00002-of-00002.safetensors": keys[1::2]}
    for fname, ks in shards.items():
        save_file({k: sd[k] for k in ks}, folder / fname)
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, ks in shards.items() for k in ks}}))
    pt = tmp_path / f"{name}.pt"
    torch.save(sd, pt)
    bins = tmp_path / f"{name}-bins"
    bins.mkdir()
    for i, ks in enumerate(shards.values()):
        torch.save({k: sd[k] for k in ks}, bins / f"pytorch_model-{i}.bin")
    (bins / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"weight_map": {k: f"pytorch_model-{i}.bin" for i, ks in enumerate(shards.values()) for k in ks}}))
    return {"safetensors": st, "sharded": folder, "pt": pt, "bins": bins}


def _planted(seed: int = 0):
    """BASE, then a checkpoint where a mask of known density moved by 1 % (bf16-visible) and another
    mask moved by 1e-6 relative (a bit-exact change a bf16 copy cannot see)."""
    g = torch.Generator().manual_seed(seed)
    base = {"model.layers.0.self_attn.q_proj.weight": torch.randn(64, 48, generator=g),
            "model.layers.0.mlp.up_proj.weight": torch.randn(96, 48, generator=g),
            "model.norm.weight": torch.randn(50, generator=g)}
    visible, tiny = {}, {}
    ck = {}
    for name, w in base.items():
        perm = torch.randperm(w.numel(), generator=g)
        nv, nt = int(0.3 * w.numel()), int(0.2 * w.numel())
        flat = w.clone().view(-1)
        flat[perm[:nv]] *= 1.01
        flat[perm[nv:nv + nt]] *= 1 + 4e-6  # a few ulps in fp32
        visible[name], tiny[name] = nv, nt
        ck[name] = flat.view(w.shape)
    return base, ck, visible, tiny


def test_planted_mask_recovered_exactly_in_every_format(tmp_path):
    base, ck, visible, tiny = _planted()
    numel = {n: t.numel() for n, t in base.items()}
    b = _write_formats(tmp_path, base, "base")
    c = _write_formats(tmp_path, ck, "step-7")
    results = []
    for fmt in ("safetensors", "sharded", "pt", "bins"):
        run = tmp_path / f"run-{fmt}"
        summary = diff_checkpoints(b[fmt], [c[fmt]], run, k=4)
        assert summary.steps == [7] and summary.tensors == 3
        with open_store(run) as con:
            df = con.sql("SELECT tensor, step, changed_count, changed_rel_count, drift_changed_count, "
                             "changed_frac, ref_covered FROM tensor_stats ORDER BY tensor").pl()
        for r in df.iter_rows(named=True):
            assert r["step"] == 7 and r["ref_covered"]
            assert r["changed_count"] == visible[r["tensor"]] + tiny[r["tensor"]]  # bit-exact: both masks
            assert r["drift_changed_count"] == r["changed_count"]
            assert r["changed_rel_count"] == visible[r["tensor"]]
        results.append(df.drop("tensor").rows())
        by_tensor = sparsity_over_training(run, by="tensor")
        for r in by_tensor.iter_rows(named=True):
            density = (visible[r["tensor"]] + tiny[r["tensor"]]) / numel[r["tensor"]]
            assert r["changed_frac"] == density  # exact: integer counts over numel
            assert abs(r["changed_rel_frac"] - 0.3) < 1e-3  # the planted visible density
    assert results[0] == results[1] == results[2] == results[3]


def test_tensors_regex_step_order_and_memory_bound(tmp_path, monkeypatch):
    base, ck, _, _ = _planted()
    save_file(base, tmp_path / "base.safetensors")
    paths = []
    for s in (300, 100, 200):  # shell order ≠ step order
        d = tmp_path / f"checkpoint-{s}"
        d.mkdir()
        save_file({k: v * (1 + s * 1e-4) for k, v in ck.items()}, d / "model.safetensors")
        paths.append(d)
    assert checkpoint_steps(paths) == [300, 100, 200]
    assert checkpoint_steps([tmp_path / "a.pt", tmp_path / "b.pt"]) == [1, 2]

    alive, peak = weakref.WeakSet(), [0]
    real_get = checkpoint_diff.Checkpoint.get

    def counting_get(self, name):
        t = real_get(self, name)
        alive.add(t)
        peak[0] = max(peak[0], len(alive))
        return t

    monkeypatch.setattr(checkpoint_diff.Checkpoint, "get", counting_get)
    summary = diff_checkpoints(tmp_path / "base.safetensors", paths, tmp_path / "run", tensors=r"\.weight$", k=2)
    assert summary.steps == [100, 200, 300] and summary.tensors == 3
    assert peak[0] <= 3  # BASE, previous and current checkpoint's tensor: never the whole model
    only_mlp = diff_checkpoints(tmp_path / "base.safetensors", paths, tmp_path / "run2", tensors="mlp", k=2)
    assert only_mlp.tensors == 1
    with open_store(tmp_path / "run") as con:
        steps = [s for (s,) in con.execute("SELECT DISTINCT step FROM spectra ORDER BY 1").fetchall()]
        drift = con.execute("SELECT step, drift_norm, update_norm FROM tensor_stats WHERE tensor LIKE '%up_proj%' "
                            "ORDER BY step").fetchall()
    assert steps == [100, 200, 300]
    assert drift[0][1] == pytest.approx(drift[0][2])  # first checkpoint: previous = BASE
    assert drift[2][1] > drift[2][2] > 0  # later: step-to-step is smaller than the drift from BASE


runner = CliRunner()


def _cli(*args):
    result = runner.invoke(app, ["diff", *map(str, args)])
    return result.exit_code, (result.output or "") + (getattr(result, "stderr", "") or "")


def test_cli_diff_and_its_errors(tmp_path):
    base, ck, _, _ = _planted()
    save_file(base, tmp_path / "base.safetensors")
    save_file(ck, tmp_path / "ckpt-1.safetensors")
    code, out = _cli(tmp_path / "base.safetensors", tmp_path / "ckpt-1.safetensors", "--run", tmp_path / "ok", "--k", 2)
    assert code == 0 and "3 tensors" in out, out
    with open_store(tmp_path / "ok") as con:
        assert con.execute("SELECT count(*) FROM spectra").fetchone()[0] == 2

    # A header cut short: the length prefix promises more bytes than the file has.
    raw = (tmp_path / "ckpt-1.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(raw[:8 + 20])
    # A header whose JSON is corrupt but complete in length.
    n = struct.unpack("<Q", raw[:8])[0]
    (tmp_path / "corrupt.safetensors").write_bytes(raw[:8] + b"{" * n + raw[8 + n:])
    shapes = dict(ck)
    shapes["model.norm.weight"] = torch.zeros(47)
    save_file(shapes, tmp_path / "shape.safetensors")
    renamed = {("model.final_norm.weight" if k == "model.norm.weight" else k): v for k, v in ck.items()}
    save_file(renamed, tmp_path / "names.safetensors")
    (tmp_path / "junk.pt").write_bytes(b"not a zip file at all")

    cases = [
        ("trunc.safetensors", "not a readable safetensors checkpoint"),
        ("corrupt.safetensors", "not a readable safetensors checkpoint"),
        ("shape.safetensors", "model.norm.weight has shape (47,)"),
        ("names.safetensors", "tensor names differ from BASE"),
        ("missing.safetensors", "no such checkpoint"),
        ("junk.pt", "not a readable torch state dict"),
    ]
    for i, (fname, message) in enumerate(cases):
        code, out = _cli(tmp_path / "base.safetensors", tmp_path / fname, "--run", tmp_path / f"bad{i}")
        assert code == 2, (fname, out)
        assert message in out and "Traceback" not in out, (fname, out)
        assert len(out.strip().splitlines()) <= 3, out  # one line (rich may wrap a long path)
        assert not (tmp_path / f"bad{i}").exists()  # nothing half-written is left behind

    code, out = _cli(tmp_path / "base.safetensors", tmp_path / "names.safetensors", "--run", tmp_path / "skip",
                     "--allow-missing")
    assert code == 0 and "model.final_norm.weight" in out and "model.norm.weight" in out, out
    with open_store(tmp_path / "skip") as con:
        assert con.execute("SELECT count(DISTINCT tensor) FROM tensor_stats").fetchone()[0] == 2
        assert con.execute("SELECT count(*) FROM events WHERE event = 'checkpoint_diff_skipped'").fetchone()[0] == 1
    code, out = _cli(tmp_path / "base.safetensors", tmp_path / "ckpt-1.safetensors", "--run", tmp_path / "ok")
    assert code == 2 and "already exists" in out
    code, out = _cli(tmp_path / "base.safetensors", tmp_path / "ckpt-1.safetensors", "--run", tmp_path / "re",
                     "--tensors", "(")
    assert code == 2 and "invalid regular expression" in out
    with pytest.raises(StoreError, match="no tensors"):
        diff_checkpoints(tmp_path / "base.safetensors", [tmp_path / "ckpt-1.safetensors"], tmp_path / "none",
                         tensors="nothing-matches")
