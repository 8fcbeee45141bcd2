"""The real-model variant's verifiable task: small-number arithmetic with one exact integer answer.

A problem is ``a ± b`` with a, b in [1, 20]. The prompt is the model's own chat template around
"What is a ± b?", with the assistant turn already started as ``a ± b = ``, so the first tokens the
model writes are the answer (SmolLM2 splits numbers into single digits). The reward is exact: 1 when
the integer the response starts with equals the answer, else 0. Pretrained SmolLM2-135M-Instruct gets
about 30% of these right greedily, which leaves room for SFT and RL and gives GRPO groups with mixed
rewards from the first step.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

_ANSWER = re.compile(r"\s*(-?\d+)")


@dataclass(frozen=True)
class Problem:
    a: int
    op: str
    b: int

    @property
    def answer(self) -> int:
        return self.a + self.b if self.op == "+" else self.a - self.b

    @property
    def text(self) -> str:
        return f"{self.a} {self.op} {self.b}"


@dataclass(frozen=True)
class ArithConfig:
    low: int = 1
    high: int = 20
    max_new_tokens: int = 4  # "-19" plus one token that ends the number


def problems(n: int, cfg: ArithConfig, seed: int) -> list[Problem]:
    """``n`` problems drawn from their own generator (the held-out set uses a seed training never does)."""
    rng = random.Random(seed)
    return [Problem(rng.randint(cfg.low, cfg.high), rng.choice("+-"), rng.randint(cfg.low, cfg.high))
            for _ in range(n)]


def prompt(p: Problem, tok) -> str:
    """Chat-formatted question with the assistant's answer line begun, so the answer comes first."""
    chat = [{"role": "user", "content": f"What is {p.text}?"}]
    return tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) + f"{p.text} = "


def parse_answer(text: str) -> int | None:
    """The integer the response starts with, or None."""
    m = _ANSWER.match(text)
    return int(m.group(1)) if m else None


def reward(p: Problem, text: str) -> float:
    """Exact, verifiable reward: 1.0 iff the response starts with the right integer."""
    return float(parse_answer(text) == p.answer)


def sft_batch(batch: list[Problem], tok, device: str) -> dict[str, torch.Tensor]:
    """Teacher forcing on correct answers: labels only on the answer tokens and the end-of-turn token."""
    ids, labels = [], []
    for p in batch:
        q = tok(prompt(p, tok), add_special_tokens=False)["input_ids"]
        a = tok(f"{p.answer}{tok.eos_token}", add_special_tokens=False)["input_ids"]
        ids.append(q + a)
        labels.append([-100] * len(q) + a)
    width = max(len(x) for x in ids)
    pad = tok.pad_token_id
    out = {"input_ids": torch.tensor([x + [pad] * (width - len(x)) for x in ids]),
           "labels": torch.tensor([y + [-100] * (width - len(y)) for y in labels]),
           "attention_mask": torch.tensor([[1] * len(x) + [0] * (width - len(x)) for x in ids])}
    return {k: v.to(device) for k, v in out.items()}
