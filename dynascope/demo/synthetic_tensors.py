"""FSDP shards of a Llama-shaped model's tensor statistics for the synthetic cluster run.

FSDP2 shards every parameter along its first dimension in ``ceil(dim0 / ranks)``-row chunks, so a rank's
shard of a ``[vocab, hidden]`` embedding is a block of rows and the last ranks may hold none (the probe
skips an empty local tensor, so they write no row for it). Each record holds, per tensor, whole-tensor
statistics of the bf16, lr ≈ 1e-6 regime (update ratio ~1e-5..1e-4, a few percent of elements changing in
bf16 per step, drift from θ₀ growing with the step), split over the shards so that they combine exactly as
``store/combine.py`` combines real shards: norms as the root of summed squares (each shard's share of the
squares is its share of the elements, ±10%), counts as sums.
"""

from __future__ import annotations

import numpy as np

from dynascope.core.naming import tensor_kind, tensor_layer
from dynascope.demo.synthetic import ClusterSpec

VOCAB = 32_000
# (suffix, rows, cols) per layer; cols 0 is a vector. "i" is the MLP's intermediate width.
_LAYER = [("self_attn.q_proj.weight", "h", "h"), ("self_attn.k_proj.weight", "h", "h"),
          ("self_attn.v_proj.weight", "h", "h"), ("self_attn.o_proj.weight", "h", "h"),
          ("mlp.gate_proj.weight", "i", "h"), ("mlp.up_proj.weight", "i", "h"), ("mlp.down_proj.weight", "h", "i"),
          ("input_layernorm.weight", "h", None), ("post_attention_layernorm.weight", "h", None)]


class ShardedModel:
    """The model's tensors and each rank's shard of them; ``shard_rows(rank, step)`` gives one record's rows."""

    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        h, i = spec.hidden, int(spec.hidden * 2.6875)
        dims = {"h": h, "i": i}
        shapes = [("model.embed_tokens.weight", (VOCAB, h))]
        for layer in range(spec.layers):
            shapes += [(f"model.layers.{layer}.{sfx}", (dims[a],) if b is None else (dims[a], dims[b]))
                       for sfx, a, b in _LAYER]
        shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (VOCAB, h))]
        self.names = [n for n, _ in shapes]
        self.kinds = [tensor_kind(n) for n in self.names]
        self.layers = [tensor_layer(n) for n in self.names]
        self.shapes = ["x".join(map(str, s)) for _, s in shapes]
        dim0 = np.array([s[0] for _, s in shapes], np.int64)
        rest = np.array([int(np.prod(s[1:])) for _, s in shapes], np.int64)
        self.numel = dim0 * rest
        self.n_params = int(self.numel.sum())
        r = spec.ranks
        chunk = -(-dim0 // r)
        rows = np.clip(dim0[:, None] - np.arange(r)[None, :] * chunk[:, None], 0, chunk[:, None])
        self.shard_numel = rows * rest[:, None]  # tensors × ranks
        rng = np.random.default_rng([spec.seed, 1])
        weight = self.shard_numel * rng.uniform(0.9, 1.1, self.shard_numel.shape)
        self.share = weight / weight.sum(axis=1, keepdims=True)  # each shard's share of a tensor's squares
        kind = np.array(self.kinds)
        self.is_norm = kind == "norm"
        self.is_embed = kind == "embed"
        self._meta: dict[int, dict] = {}

    def _rank_meta(self, rank: int) -> dict:
        """The per-tensor columns of a rank's rows (the same list objects every record, as the probe does)."""
        if rank not in self._meta:
            keep = np.flatnonzero(self.shard_numel[:, rank] > 0)
            self._meta[rank] = {"keep": keep, "cols": {
                "tensor": [self.names[k] for k in keep], "layer": [self.layers[k] for k in keep],
                "kind": [self.kinds[k] for k in keep], "shape": [self.shapes[k] for k in keep],
                "dtype": ["bfloat16"] * len(keep), "sharded": [True] * len(keep),
                "numel": self.shard_numel[keep, rank]}}
        return self._meta[rank]

    def _whole(self, step: int) -> dict[str, np.ndarray]:
        """Whole-tensor statistics at a recorded step (the same on every rank: seeded by the step)."""
        rng = np.random.default_rng([self.spec.seed, 2, step])
        n = len(self.names)
        w = np.sqrt(self.numel) * np.where(self.is_norm, 1.0, 0.02) * (1 + 2e-5 * step)
        ratio = np.where(self.is_norm, 1e-5, 4e-5) * rng.lognormal(0, 0.3, n)
        changed = np.clip(0.03 * rng.lognormal(0, 0.3, n), 0, 1)
        grad = 0.5 * np.sqrt(self.numel / 1e6) * rng.lognormal(0, 0.2, n)
        return {"w": w, "update": w * ratio, "changed": changed, "grad": grad,
                "drift": w * ratio * np.sqrt(step + 1) * 0.9,
                "drift_changed": np.minimum(0.95, changed * (step + 1) ** 0.6)}

    def shard_rows(self, rank: int, step: int) -> dict:
        """One record's ``tensor_stats`` columns of ``rank``'s shards."""
        meta = self._rank_meta(rank)
        keep = meta["keep"]
        whole = {k: v[keep] for k, v in self._whole(step).items()}
        rng = np.random.default_rng([self.spec.seed, 3, step, rank])
        numel = meta["cols"]["numel"].astype(np.float64)
        root = np.sqrt(self.share[keep, rank])
        m = len(keep)

        def noisy(x: np.ndarray, sigma: float) -> np.ndarray:
            return x * rng.lognormal(0, sigma, m)

        def count(frac: np.ndarray) -> np.ndarray:
            return np.round(np.clip(frac, 0, 1) * numel).astype(np.int64)

        w_norm, update = whole["w"] * root, noisy(whole["update"] * root, 0.02)
        grad = noisy(whole["grad"] * root, 0.05)
        changed = count(noisy(whole["changed"], 0.05))
        changed_rel = count(0.6 * changed / numel)
        flips = count(np.full(m, 1e-4))
        drift_changed = count(noisy(whole["drift_changed"], 0.02))
        drift_rel = count(0.5 * drift_changed / numel)
        grad_zero = count(np.where(self.is_embed[keep], 0.85, 1e-4))
        near_zero = count(grad_zero / numel + 2e-3)
        drift = whole["drift"] * root
        zeros = np.zeros(m, np.int64)
        return {**meta["cols"], "w_norm": w_norm, "update_norm": update, "update_ratio": update / w_norm,
                "changed_count": changed, "changed_frac": changed / numel,
                "changed_rel_count": changed_rel, "changed_rel_frac": changed_rel / numel,
                "sign_flip_count": flips, "sign_flip_frac": flips / numel,
                "bf16_unchanged_count": meta["cols"]["numel"] - changed,
                "bf16_unchanged_frac": 1 - changed / numel, "w_nan_count": zeros, "w_inf_count": zeros,
                "ref_covered": [True] * m, "drift_norm": drift, "drift_ratio": drift / w_norm,
                "drift_changed_count": drift_changed, "drift_changed_frac": drift_changed / numel,
                "drift_changed_rel_count": drift_rel, "drift_changed_rel_frac": drift_rel / numel,
                "drift_unchanged_count": meta["cols"]["numel"] - drift_rel,
                "drift_unchanged_frac": 1 - drift_rel / numel,
                "drift_zero_count": meta["cols"]["numel"] - drift_changed,
                "drift_zero_frac": 1 - drift_changed / numel,
                "grad_norm": grad, "grad_zero_count": grad_zero, "grad_zero_frac": grad_zero / numel,
                "grad_near_zero_count": near_zero, "grad_near_zero_frac": near_zero / numel,
                "grad_max_abs": 6 * grad / np.sqrt(numel), "grad_nan_count": zeros, "grad_inf_count": zeros}
