"""Reward model scorer: a tiny Qwen2ForSequenceClassification, batched == one at a time."""

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from posttrain.models import build_char_tokenizer
from posttrain.rewards.reward_model import RewardModelScorer
from posttrain.rewards.verdict import Verdict, infra_error
from posttrain.trajectory import Status


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


def test_add_to_merges_a_component_and_skips_infra_errors(scorer_parts):
    model, tok = scorer_parts
    s = RewardModelScorer(model, tok, batch_size=2, component="rm")
    vs = [Verdict(Status.CORRECT, {"task": 1.0}), infra_error("x"), Verdict(Status.WRONG, {"task": 0.0})]
    out = s.add_to(vs, ["a", "b", "c"], ["1", "2", "3"])
    assert set(out[0].components) == {"task", "rm"} and out[1] is vs[1] and "rm" in out[2].components
    assert out[2].components["rm"] == pytest.approx(s.score(["c"], ["3"])[0], abs=1e-5)


def test_chat_template_rendering_changes_the_input(scorer_parts):
    model, tok = scorer_parts
    plain = RewardModelScorer(model, tok)._render("hi", "yo")
    chat = RewardModelScorer(model, tok, use_chat_template=True)._render("hi", "yo")
    assert plain == "hiyo" and chat == "<|user|>hi<|assistant|>yo<eos>"


def test_model_without_pad_token_is_rejected(scorer_parts):
    model, tok = scorer_parts
    cfg = model.config.__class__(**{**model.config.to_dict(), "pad_token_id": None})
    with pytest.raises(ValueError, match="pad_token_id"):
        RewardModelScorer(Qwen2ForSequenceClassification(cfg), tok)
