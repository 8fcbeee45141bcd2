"""Tensor names: the wrapper-free name a run records, and its layer index and module kind.

Shared by the live probes, θ₀ (which matches a checkpoint's names to the model's), the offline
checkpoint diff and the dashboard, so the same tensor has the same name, layer and kind everywhere.
"""

from __future__ import annotations

import re

__all__ = ["KINDS", "normalize_name", "tensor_kind", "tensor_layer"]

KINDS = ("q", "k", "v", "o", "qkv", "mlp", "embed", "head", "norm", "bias", "other")

_LAYER = re.compile(r"(?:^|\.)(?:layers?|h|blocks?|block|decoder\.layers|encoder\.layer)\.(\d+)(?:\.|$)")
_ANY_INDEX = re.compile(r"\.(\d+)\.")
# Order matters: the first match wins, so specific names come before generic ones.
_KIND_RULES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("norm", re.compile(r"(norm|ln_?\d*|ln_f|layernorm|rmsnorm)(\.|$)", re.I)),
    ("embed", re.compile(r"(embed|wte|wpe|tok_emb|pos_emb|embeddings)", re.I)),
    ("head", re.compile(r"(lm_head|score|classifier|output_layer)(\.|$)", re.I)),
    ("qkv", re.compile(r"(qkv|c_attn|in_proj|query_key_value|Wqkv)", re.I)),
    ("q", re.compile(r"(q_proj|\.query|\.wq|\.q)(\.|$)", re.I)),
    ("k", re.compile(r"(k_proj|\.key|\.wk|\.k)(\.|$)", re.I)),
    ("v", re.compile(r"(v_proj|\.value|\.wv|\.v)(\.|$)", re.I)),
    ("o", re.compile(r"(o_proj|out_proj|attn\.c_proj|attention\.output|\.wo|\.o|dense)(\.|$)", re.I)),
    ("mlp", re.compile(r"(mlp|ffn|feed_forward|fc\d?|c_fc|gate_proj|up_proj|down_proj|w[123])(\.|$)", re.I)),
)

# Wrapper components. DDP's ``module`` only ever leads a name (a user's own submodule may be called
# "module" further in); torch.compile's ``_orig_mod``, FSDP1's and activation checkpointing's wrappers
# can sit at any depth, since a submodule can be compiled or wrapped on its own.
_LEADING = frozenset({"module", "_orig_mod"})
_ANYWHERE = frozenset({"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


def normalize_name(name: str) -> str:
    """Strip wrapper components (DDP ``module.``, ``torch.compile``, FSDP1) so checkpoints and models match.

    Whole dotted components only: ``encoder.submodule.weight`` keeps its ``submodule``."""
    parts = name.split(".")
    while len(parts) > 1 and parts[0] in _LEADING:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in _ANYWHERE)


def tensor_layer(name: str) -> int | None:
    """Transformer block index in a parameter name (``model.layers.3.mlp.up_proj.weight`` → 3)."""
    m = _LAYER.search(name) or _ANY_INDEX.search(name)
    return int(m.group(1)) if m else None


def tensor_kind(name: str) -> str:
    """Module kind of a parameter: q, k, v, o, qkv, mlp, embed, head, norm, bias or other."""
    for kind, pattern in _KIND_RULES:
        if pattern.search(name):
            return kind
    return "bias" if name.endswith(".bias") else "other"
