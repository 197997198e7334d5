"""Reward model scorer: a tiny Qwen2ForSequenceClassification, batched == one at a time; failures are not scores."""

import json

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from posttrain.errors import UserError
from posttrain.models import build_char_tokenizer
from posttrain.rewards.reward_model import RENDER_FILE, RewardModelScorer, render_pair


@pytest.fixture(scope="module")
def scorer_parts():
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)
    return Qwen2ForSequenceClassification(cfg).eval(), tok


def test_batched_scores_equal_unbatched_despite_padding(scorer_parts):
    model, tok = scorer_parts
    prompts, responses = ["1+1=", "12+30=", "7*8="], ["2", "42", "fifty-six"]
    batched = RewardModelScorer(model, tok, batch_size=3).score(prompts, responses)
    single = [RewardModelScorer(model, tok, batch_size=1).score([p], [r])[0] for p, r in zip(prompts, responses, strict=True)]
    assert batched == pytest.approx(single, abs=1e-5)
    # the score is the model's logit on prompt+response (left-padded by the char tokenizer)
    with torch.no_grad():
        ref = model(**tok(["1+1=2"], return_tensors="pt")).logits[0, 0].item()
    assert batched[0] == pytest.approx(ref, abs=1e-5)
    assert len(set(round(s, 6) for s in batched)) == 3


def test_score_rows_makes_a_failed_batch_and_a_nonfinite_score_failures_not_zeros(scorer_parts):
    model, tok = scorer_parts
    s = RewardModelScorer(model, tok, batch_size=2)
    good = s.score(["a", "b", "c"], ["1", "2", "3"])
    calls = []
    real = s.score

    def flaky(p, r):  # the second batch (row "c") raises; the first is scored
        calls.append(list(p))
        if "c" in p:
            raise RuntimeError("CUDA out of memory")
        return real(p, r)

    s.score = flaky
    out = s.score_rows(["a", "b", "c"], ["1", "2", "3"])
    assert calls == [["a", "b"], ["c"]]
    assert out[:2] == pytest.approx(good[:2], abs=1e-6)
    assert isinstance(out[2], str) and "RuntimeError: CUDA out of memory" in out[2]
    s.score = lambda p, r: [float("nan")] * len(p)
    assert all(isinstance(x, str) and "nan" in x for x in s.score_rows(["a"], ["1"]))


def test_chat_template_rendering_changes_the_input(scorer_parts):
    model, tok = scorer_parts
    plain = RewardModelScorer(model, tok)._render("hi", "yo")
    chat = RewardModelScorer(model, tok, use_chat_template=True)._render("hi", "yo")
    assert plain == "hiyo" and chat == "<|user|>hi<|assistant|>yo<eos>"
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"}]
    assert render_pair(tok, msgs, "yo", use_chat_template=True) == "<|system|>S<|user|>hi<|assistant|>yo<eos>"
    assert render_pair(tok, msgs, "yo", use_chat_template=False) == "S\nhiyo"


def test_from_pretrained_reads_the_rendering_a_trained_directory_records(scorer_parts, tmp_path):
    model, tok = scorer_parts
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    (tmp_path / RENDER_FILE).write_text(json.dumps({"use_chat_template": True, "max_length": 64}))
    s = RewardModelScorer.from_pretrained(tmp_path, batch_size=4)
    assert (s.use_chat_template, s.max_length, s.batch_size) == (True, 64, 4)
    assert s.score(["1+1="], ["2"]) == pytest.approx(
        RewardModelScorer(model, tok, use_chat_template=True).score(["1+1="], ["2"]), abs=1e-5)
    with pytest.raises(UserError, match="no such model directory"):
        RewardModelScorer.from_pretrained(tmp_path / "nope")


def test_model_without_pad_token_is_rejected(scorer_parts):
    model, tok = scorer_parts
    cfg = model.config.__class__(**{**model.config.to_dict(), "pad_token_id": None})
    with pytest.raises(ValueError, match="pad_token_id"):
        RewardModelScorer(Qwen2ForSequenceClassification(cfg), tok)
