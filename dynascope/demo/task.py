"""The verifiable task: reverse a short string of letters. Prompts are generated on the fly.

A prompt is ``<bos> s =`` and the correct response is ``reversed(s) <eos>``; the reward is exact (1 if
the response is exactly right, else 0), so nothing is learned from a judge. Response length equals the
string's length, so the length distribution of prompts sets the rollout long tail: ``long_tail=True``
draws most strings short and a few much longer, which is what makes a synchronous batch wait.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALPHABET = "abcdefghij"
PAD, BOS, SEP, EOS = 0, 1, 2, 3
_SPECIAL = ("<pad>", "<bos>", "=", "<eos>")


@dataclass(frozen=True)
class CharTokenizer:
    """Character-level tokenizer built locally from the task's alphabet (no hub download)."""

    alphabet: str = ALPHABET

    @property
    def vocab_size(self) -> int:
        return len(_SPECIAL) + len(self.alphabet)

    def encode(self, text: str) -> list[int]:
        return [len(_SPECIAL) + self.alphabet.index(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        """Letters up to the first <eos>; special tokens other than <eos> are dropped."""
        out = []
        for i in ids:
            if i == EOS:
                break
            if i >= len(_SPECIAL):
                out.append(self.alphabet[i - len(_SPECIAL)])
        return "".join(out)


@dataclass(frozen=True)
class TaskConfig:
    min_len: int = 2
    max_len: int = 7
    long_tail: bool = False
    tail_max_len: int = 14  # with long_tail, the rare long strings reach this length
    tail_prob: float = 0.1  # and this share of prompts are drawn from the tail

    @property
    def longest(self) -> int:
        return self.tail_max_len if self.long_tail else self.max_len

    @property
    def max_new_tokens(self) -> int:
        return self.longest + 2  # room for <eos> and one overshoot token before we stop generating


def sample_strings(n: int, cfg: TaskConfig, gen: torch.Generator) -> list[str]:
    """``n`` random letter strings; lengths uniform in [min_len, max_len], or a heavy tail if asked."""
    lens = torch.randint(cfg.min_len, cfg.max_len + 1, (n,), generator=gen)
    if cfg.long_tail:
        tail = torch.rand(n, generator=gen) < cfg.tail_prob
        long = torch.randint(cfg.max_len + 1, cfg.tail_max_len + 1, (n,), generator=gen)
        lens = torch.where(tail, long, lens)
    letters = torch.randint(0, len(ALPHABET), (n, int(lens.max())), generator=gen)
    return ["".join(ALPHABET[j] for j in row[:k].tolist()) for row, k in zip(letters, lens.tolist(), strict=True)]


def prompt_ids(s: str, tok: CharTokenizer) -> list[int]:
    return [BOS, *tok.encode(s), SEP]


def answer(s: str) -> str:
    return s[::-1]


def reward(s: str, response_ids: list[int], tok: CharTokenizer) -> float:
    """Exact, verifiable reward: 1.0 iff the response decodes to reversed(s) and ends with <eos>."""
    return float(EOS in response_ids and tok.decode(response_ids) == answer(s))


def sft_batch(strings: list[str], tok: CharTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """Teacher-forcing batch: (input ids, targets) with the loss only on response tokens (−100 elsewhere)."""
    seqs = [prompt_ids(s, tok) + tok.encode(answer(s)) + [EOS] for s in strings]
    width = max(len(q) for q in seqs)
    ids = torch.full((len(seqs), width), PAD, dtype=torch.long)
    tgt = torch.full((len(seqs), width), -100, dtype=torch.long)
    for i, (s, q) in enumerate(zip(strings, seqs, strict=True)):
        ids[i, : len(q)] = torch.tensor(q)
        p = len(s) + 2  # the prompt; targets are shifted left by one
        tgt[i, p - 1 : len(q) - 1] = torch.tensor(q[p:])
    return ids, tgt
