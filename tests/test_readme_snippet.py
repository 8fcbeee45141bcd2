"""The README's Python API snippet runs as shown, on a tiny model with a real SFT → GRPO loop, and gives numbers.

The snippet is taken from README.md as written. The names it leaves to the reader (model, optimizer,
policy, sft_loss, generate, score, grpo_loss, ...) are defined here for a tiny character model that
really trains: a supervised warm-up on a copy task, then group-relative policy gradient on sampled
continuations. Every value the snippet's expressions return is kept and checked.
"""

from __future__ import annotations

import ast
import functools
import math
import re
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import torch
from torch import nn

import dynascope
from dynascope.probes.tensors import W_NORM_EVERY

README = Path(__file__).resolve().parents[1] / "README.md"
VOCAB, PROMPT, RESPONSE, GROUP = 12, 4, 4, 4


def readme_snippet() -> str:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 32)
        self.mix = nn.Linear(32, 32)
        self.head = nn.Linear(32, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (batch, time) → next-token logits
        h = torch.cumsum(self.embed(tokens), dim=1) / torch.arange(1, tokens.shape[1] + 1).view(1, -1, 1)
        return self.head(torch.tanh(self.mix(h)))


def _logprobs(policy: TinyLM, seq: torch.Tensor) -> torch.Tensor:
    """Log-probability of each response token given what precedes it: (batch, RESPONSE)."""
    logits = policy(seq[:, :-1])[:, PROMPT - 1:]
    return torch.log_softmax(logits, -1).gather(-1, seq[:, PROMPT:, None]).squeeze(-1)


def reader_names(seed: int = 0) -> dict:
    """What the snippet expects the reader to have: a model, its optimizer and the loop's functions."""
    torch.manual_seed(seed)
    policy = TinyLM()
    reference = TinyLM()
    reference.load_state_dict(policy.state_dict())
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    prompts = torch.randint(1, VOCAB, (8, PROMPT))

    def sft_loss(model: TinyLM, demos: torch.Tensor) -> torch.Tensor:  # the response copies the prompt
        seq = torch.cat([demos, demos], dim=1)
        return -_logprobs(model, seq).mean()

    @torch.no_grad()
    def generate(model: TinyLM, prompts: torch.Tensor) -> SimpleNamespace:
        seq = prompts.repeat_interleave(GROUP, 0)
        for _ in range(RESPONSE):
            nxt = torch.multinomial(torch.softmax(model(seq)[:, -1], -1), 1)
            seq = torch.cat([seq, nxt], dim=1)
        return SimpleNamespace(seq=seq, lens=[RESPONSE] * len(seq),
                               groups=torch.arange(len(prompts)).repeat_interleave(GROUP).tolist())

    def score(batch: SimpleNamespace) -> list[float]:
        return (batch.seq[:, PROMPT:] == batch.seq[:, :PROMPT]).float().mean(1).tolist()

    def grpo_loss(model: TinyLM, batch: SimpleNamespace, rewards: list[float]) -> tuple[torch.Tensor, float]:
        r = torch.tensor(rewards).view(-1, GROUP)
        adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)).view(-1, 1)
        lp = _logprobs(model, batch.seq)
        with torch.no_grad():
            kl = (lp - _logprobs(reference, batch.seq)).mean()
        return -(adv * lp).mean() + 0.05 * kl, float(kl)

    return {"model": policy, "policy": policy, "optimizer": optimizer, "prompts": prompts, "demos": prompts,
            "sft_steps": 10, "rl_steps": 30, "sft_loss": sft_loss, "generate": generate, "score": score,
            "grpo_loss": grpo_loss}


def unbudgeted(watch, *args, **kwargs):
    """``watch`` as the snippet calls it, with the probe's and the spectral records' time budgets lifted."""
    if isinstance(kwargs.get("spectral"), dict):
        kwargs["spectral"] = {**kwargs["spectral"], "time_budget": None}
    return watch(*args, **kwargs, time_budget=None)


def run_snippet(code: str, names: dict) -> list:
    """Execute the snippet, keeping the value of every top-level expression statement in order."""
    tree = ast.parse(code)
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Expr):
            tree.body[i] = ast.parse("_values.append(None)").body[0]
            tree.body[i].value.args[0] = node.value
    ast.fix_missing_locations(tree)
    names["_values"] = []
    exec(compile(tree, str(README), "exec"), names)  # the README's own code, run as a user would
    return names["_values"]


def test_readme_python_snippet_runs_and_gives_numbers(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the snippet writes runs/grpo-1 relative to where it runs
    # Which steps the window covers, and which tensors each spectral record reaches, are set by time
    # budgets, shares of the measured step time, so on a model this small they depend on the machine's load
    # (test_probe_scope and test_spectral cover the budgets themselves). Lifting both here makes the
    # snippet's coverage, and so every number below, the same on any machine.
    monkeypatch.setattr(dynascope, "watch", functools.partial(unbudgeted, dynascope.watch))
    values = [v for v in run_snippet(readme_snippet(), reader_names()) if isinstance(v, pl.DataFrame)]
    first, stragglers, what_if, sparsity, fit = values
    # The first query: one row per step whose window covered a tensor, a real ratio on every row.
    assert first.columns == ["step", "tensors", "update_ratio"]
    assert first.height >= 3 and first.null_count().sum_horizontal()[0] == 0, first
    assert ((first["update_ratio"] > 0) & (first["update_ratio"] < 1)).all() and (first["tensors"] >= 1).all()
    # What the snippet's comment says of the other steps: their update columns are NULL (outside the
    # window), while every tensor has ‖g‖ at every one of the 40 optimizer steps, and ‖W‖ at every 8th
    # and wherever the window gave it an update ratio.
    with dynascope.open_store("runs/grpo-1") as con:
        per_step = con.frame("""SELECT step, count(*) AS tensors, count(w_norm) AS w_norms,
                                count(grad_norm) AS grad_norms, count(update_ratio) AS covered,
                                count(update_norm) AS windowed
                                FROM tensor_stats GROUP BY step ORDER BY step""")
    assert per_step["step"].to_list() == list(range(40))
    assert (per_step["grad_norms"] == per_step["tensors"]).all()
    full = per_step["step"] % W_NORM_EVERY == 0
    assert (per_step.filter(full)["w_norms"] == per_step.filter(full)["tensors"]).all()
    assert (per_step.filter(~full)["w_norms"] == per_step.filter(~full)["windowed"]).all()
    assert per_step.filter(pl.col("covered") > 0)["step"].to_list() == first["step"].to_list()
    # One process: nothing to compare across ranks, said as empty frames rather than errors.
    assert stragglers.is_empty() and what_if.filter(pl.col("rank").is_not_null()).height <= 1
    # SFT against RL over every kind, with numbers on both sides.
    row = sparsity.filter(pl.col("kind") == "all").row(0, named=True)
    for side in ("a", "b"):
        assert 0 <= row[f"step_unchanged_frac_{side}"] < 1
    assert (row["a"], row["b"]) == ("sft", "rl")
    # The low-rank summaries every 10 steps: a line fitted per 2-D tensor, with finite errors.
    assert fit.height >= 1 and fit["rel_error_last"].is_finite().all()
    assert all(math.isfinite(x) for x in fit["rank1_energy_last"])


def test_readme_settings_snippet_builds_one_configuration(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    section = README.read_text(encoding="utf-8").split("## Python API", 1)[1].split("\n## ", 1)[0]
    snippet = re.findall(r"```python\n(.*?)```", section, re.S)[1]  # the WatchSettings example
    names = reader_names()
    names["dynascope"] = dynascope
    exec(compile(snippet, str(README), "exec"), names)
    scope, settings = names["scope"], names["settings"]
    assert scope.stage == "sft" and settings.stage is None  # the keyword beside the object wins, on a copy
    assert scope.stats.memory_budget is None and scope.spectral is not None  # the object's own fields
    for _ in range(3):
        names["sft_loss"](names["policy"], names["prompts"]).backward()
        names["optimizer"].step()
        names["optimizer"].zero_grad()
    scope.close()
    with dynascope.open_store(scope.run_dir) as con:  # every=10: step 0 recorded, 1 and 2 not
        assert con.rows("SELECT DISTINCT step, stage FROM tensor_stats") == [(0, "sft")]
