"""TRL's ``GRPOTrainer`` on a tiny GPT-2 built from a config, for ``accelerate launch`` (tests of the HF/TRL
callback under the launcher users start it with):

    accelerate launch --multi_gpu --num_processes 2 tests/helpers/grpo_worker.py RUN

The tokenizer is trained here on a few words (``tokenizers``), so nothing comes from a hub. Each rank saves
every parameter's ‖W‖, ‖ΔW‖ and changed count at each optimizer step to ``RUN.truth<rank>.json``: the
test holds the store's statistics to them.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import datasets
import torch
import transformers
import trl
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from dynascope.integrations.hf import DynascopeCallback

TEXTS = ["one two three four five", "six seven eight nine ten", "red green blue", "a b c d e f g h"]
PROMPTS = ["one two", "six seven", "red green", "a b"]
STEPS, PER_DEVICE, GENERATIONS, COMPLETION = 3, 4, 4, 6


class Truth(transformers.TrainerCallback):
    """The weights around each optimizer step, from the model itself (float64 norms, exact counts)."""

    def __init__(self) -> None:
        self.steps: list[dict[str, list[float]]] = []
        self._old: dict[str, torch.Tensor] = {}

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        self._old = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_optimizer_step(self, args: Any, state: Any, control: Any, model: Any = None, **kw: Any) -> None:
        new = {n: p.detach() for n, p in model.named_parameters()}
        self.steps.append({n.removeprefix("module."): [float(new[n].double().norm()),
                                                       float((new[n].double() - o.double()).norm()),
                                                       int((new[n] != o).sum())] for n, o in self._old.items()})


def tokenizer() -> transformers.PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[EOS]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                eos_token="[EOS]")


def reward_len(completions: list[str], **kwargs: Any) -> list[float]:
    return [float(len(c.split())) for c in completions]


def main(run: str) -> None:
    tok = tokenizer()
    cfg = transformers.GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=1, n_head=2,
                                  bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id,
                                  pad_token_id=tok.pad_token_id)
    transformers.set_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    args = trl.GRPOConfig(output_dir=run + ".out", per_device_train_batch_size=PER_DEVICE,
                          num_generations=GENERATIONS, max_completion_length=COMPLETION, max_steps=STEPS,
                          logging_steps=1, report_to=[], use_cpu=True, save_strategy="no", learning_rate=1e-2,
                          beta=0.0, disable_tqdm=True, seed=0, dataloader_num_workers=0)
    truth = Truth()
    trainer = trl.GRPOTrainer(model=model, reward_funcs=[reward_len], args=args, processing_class=tok,
                              train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS * 4}),
                              callbacks=[truth, DynascopeCallback(run=run, system_interval_s=None,
                                                                  memory_budget=None)])
    trainer.train()
    with open(f"{run}.truth{int(os.environ['RANK'])}.json", "w") as f:
        json.dump(truth.steps, f)


if __name__ == "__main__":
    main(sys.argv[1])
