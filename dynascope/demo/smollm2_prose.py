"""Forgetting, measured on a task the run does not train on: SmolLM2's log-loss on held-out English prose.

RL's Razor (Shenfeld, Pari & Agrawal, arXiv 2509.04259) measures forgetting as the drop in performance on
prior tasks the fine-tuning did not train on. The run trains on arithmetic; its prior task here is plain
language modelling of English technical prose: the Python documentation's topic texts that CPython ships
in ``pydoc_data.topics`` (nothing is downloaded). They are tokenized once, cut into windows of ``tokens``
tokens, and ``n`` windows evenly spaced through the text are scored at every evaluation point: per window,
the mean next-token negative log-likelihood in nats. Forgetting at a point is that loss minus the base's
(the same windows, paired), so its bootstrap intervals resample windows.
"""

from __future__ import annotations

import platform
from typing import Any

import torch

_BATCH = 4  # windows per forward pass: bounds the [batch, tokens, vocab] logits


def prose_source() -> str:
    """Where the prose comes from (the text differs between Python versions, so results name theirs)."""
    return f"pydoc_data.topics of Python {platform.python_version()}"


def prose_windows(tok: Any, n: int, tokens: int) -> torch.Tensor:
    """[n, tokens] token ids: ``n`` windows evenly spaced through the topics' text, in sorted topic order."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = torch.tensor(tok(text, add_special_tokens=False)["input_ids"], dtype=torch.long)
    windows = ids[: len(ids) // tokens * tokens].view(-1, tokens)
    if len(windows) < n:
        raise ValueError(f"{prose_source()} holds {len(windows)} windows of {tokens} tokens, fewer than {n}")
    return windows[torch.linspace(0, len(windows) - 1, n).round().long()]


@torch.no_grad()
def prose_nll(model: Any, windows: torch.Tensor) -> list[float]:
    """Per window, the mean next-token negative log-likelihood in nats (fp32 log-softmax over the vocabulary)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out: list[torch.Tensor] = []
    for lo in range(0, len(windows), _BATCH):
        ids = windows[lo:lo + _BATCH].to(dev)
        logits = model(input_ids=ids).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none")
        out.append(nll.view(len(ids), -1).mean(1))
    model.train(was)
    return torch.cat(out).double().cpu().tolist()
