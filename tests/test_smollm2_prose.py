"""The forgetting measure's prose: windows of CPython's own docs text, tokenized by a tokenizer trained on it
locally, scored by a tiny Llama: per window the mean next-token log-loss, equal to the log-softmax by hand;
and ``token_logprobs_split``, the trainer's second pass, gives the first pass's log-probs to float precision."""

from __future__ import annotations

from pydoc_data.topics import topics

import pytest
import torch
import transformers

from dynascope.demo.smollm2 import Rollout, token_logprobs, token_logprobs_split
from dynascope.demo.smollm2_prose import prose_nll, prose_source, prose_windows


def _tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(list(topics.values()), trainers.WordLevelTrainer(vocab_size=200, special_tokens=["[UNK]", "[PAD]"]))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")


def _model(vocab: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg)


def test_windows_are_evenly_spaced_through_the_docs_text():
    tok = _tokenizer()
    ids = tok("\n\n".join(topics[k] for k in sorted(topics)), add_special_tokens=False)["input_ids"]
    w = prose_windows(tok, 5, 16)
    all_windows = torch.tensor(ids[: len(ids) // 16 * 16]).view(-1, 16)
    last = len(all_windows) - 1
    assert torch.equal(w[0], all_windows[0]) and torch.equal(w[-1], all_windows[last])
    assert torch.equal(w[2], all_windows[round(last / 2)])
    with pytest.raises(ValueError, match="fewer than"):
        prose_windows(tok, len(all_windows) + 1, 16)
    assert prose_source().startswith("pydoc_data.topics of Python 3.")


def test_prose_nll_is_the_mean_next_token_log_loss_per_window():
    tok = _tokenizer()
    w = prose_windows(tok, 6, 12)
    model = _model(len(tok)).train()
    got = prose_nll(model, w)
    assert model.training  # left as it was found
    with torch.no_grad():
        logp = torch.log_softmax(model.eval()(input_ids=w).logits[:, :-1].double(), -1)
    want = -logp.gather(-1, w[:, 1:, None]).squeeze(-1).mean(1)
    assert got == pytest.approx(want.tolist(), rel=1e-5)


def test_second_pass_in_micro_batches_recomputes_the_same_log_probs():
    model = _model(50).eval()
    torch.manual_seed(1)
    prompts = torch.randint(2, 50, (4, 6))
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[:2, :3] = 0  # the first group's prompts are shorter: left padding the second group does not need
    mask[2:, :1] = 0
    response = torch.randint(2, 50, (4, 5))
    r = Rollout(prompts, mask, response, torch.ones(4, 5, dtype=torch.bool), [""] * 4)
    with torch.no_grad():
        first = token_logprobs(model, r)
    second = token_logprobs_split(model, r, 2)
    assert second.shape == first.shape
    assert torch.allclose(second, first, atol=1e-5)  # the same tokens: a float-rounding floor, not a second policy
