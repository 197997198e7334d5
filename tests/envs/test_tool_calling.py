"""Tool calling: JSON-schema tools, the hermes parser, invalid actions, template vs preamble rendering."""

from __future__ import annotations

import json

import pytest

from posttrain.envs.episodes import ENVS, build_env_task
from posttrain.envs.multiturn import TurnRenderer, run_episode, tool_preamble
from posttrain.envs.tool_calling import CALCULATOR, TOOL_PARSERS, check_arguments, parse_hermes
from posttrain.models import build_char_tokenizer
from posttrain.trajectory import Status

TOK = build_char_tokenizer()
# A template that renders the tools it is given (as Qwen's / Hermes' templates do, in short).
TOOLS_TEMPLATE = (
    "{% if tools %}<|system|>TOOLS{% for t in tools %} {{ t['function']['name'] }}{% endfor %}{% endif %}"
    + TOK.chat_template
)


def call(name="calculator", **args):
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_hermes_parser_reads_calls_and_says_why_not():
    assert TOOL_PARSERS["hermes"] is parse_hermes
    (c,) = parse_hermes("I will compute. " + call(expression="2*3"))
    assert (c.name, dict(c.arguments), c.error) == ("calculator", {"expression": "2*3"}, None)
    two = parse_hermes(call(expression="1") + call(expression="2"))
    assert [dict(c.arguments) for c in two] == [{"expression": "1"}, {"expression": "2"}]
    assert "not valid JSON" in parse_hermes("<tool_call>{name: calc}</tool_call>")[0].error
    assert "unclosed" in parse_hermes('<tool_call>{"name": "calculator"')[0].error
    assert '"name"' in parse_hermes("<tool_call>[1, 2]</tool_call>")[0].error
    assert parse_hermes("no call here") == []
    # arguments given as a JSON string holding an object (some models do this)
    (c,) = parse_hermes('<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"4\\"}"}</tool_call>')
    assert dict(c.arguments) == {"expression": "4"}


def test_argument_check_against_the_schema():
    p = CALCULATOR.parameters
    assert check_arguments(p, {"expression": "1+1"}) is None
    assert "missing required" in check_arguments(p, {})
    assert "unknown argument" in check_arguments(p, {"expression": "1", "x": 2})
    assert "must be of type string" in check_arguments(p, {"expression": 12})
    assert "must be of type integer" in check_arguments({"properties": {"n": {"type": "integer"}}}, {"n": True})


def test_calculator_tool_env_steps():
    env = ENVS["calculator_tool"](digits=3)
    obs = env.reset(11)
    a, b = map(int, obs.removesuffix("=?").split("*"))
    assert 100 <= a < 1000 and 100 <= b < 1000 and env.target == a * b
    r = env.step(call(expression=f"{a}*{b}"))
    assert r.observation == str(a * b) and r.reward_parts == {"tool_calls": 1.0} and not r.done
    bad = env.step(call(name="abacus", expression="1"))
    assert bad.observation.startswith("invalid tool call: unknown tool 'abacus'")
    assert bad.reward_parts == {"invalid_actions": 1.0}
    assert env.step(call(expr="1")).observation.startswith("invalid tool call: missing required")
    assert env.step("<tool_call>{oops}</tool_call>").observation.startswith("invalid tool call: tool call is not valid JSON")
    crash = env.step(call(expression="1/0"))  # the tool raises: its message is the result the model sees
    assert crash.observation.startswith("tool error: ExpressionError") and crash.reward_parts == {"tool_calls": 1.0}
    assert env.step("thinking").observation.startswith("invalid action: no tool call")
    end = env.step(f"<answer>{a * b}</answer>")
    assert end.done and end.reward_parts == {"task": 1.0} and end.info["status"] is Status.CORRECT
    off = ENVS["calculator_tool"](digits=3, use_tools=False)
    off.reset(11)
    assert off.tools == [] and "tools are disabled" in off.step(call(expression="1")).observation


def test_python_tool_runs_in_the_hardened_sandbox(monkeypatch):
    import posttrain.sandbox as sb

    seen = []
    real = sb.run_python

    def spy(code, **kw):
        seen.append(code)
        return real(code, **kw)

    monkeypatch.setattr(sb, "run_python", spy)
    env = ENVS["python_tool"](digits=2, wall_s=2.0)
    env.reset(0)
    r = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>')
    assert r.observation == "42" and seen == ["print(6*7)"]


def test_tools_reach_the_template_or_a_preamble():
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    schemas = [CALCULATOR.schema()]
    r = TurnRenderer(tok, tools=schemas)  # auto: the template mentions tools
    assert r.tool_mode == "template"
    ids, _ = r.first("2*3=?")
    assert tok.decode(ids) == "<|system|>TOOLS calculator<|user|>2*3=?<|assistant|>"
    plain = TurnRenderer(TOK, tools=schemas)  # the char template has no tools: preamble as system message
    assert plain.tool_mode == "preamble"
    ids, _ = plain.first("2*3=?")
    assert TOK.decode(ids) == f"<|system|>{tool_preamble(schemas)}<|user|>2*3=?<|assistant|>"
    assert '{"name":"calculator"' in tool_preamble(schemas)
    assert TurnRenderer(TOK, tools=schemas, tool_prompt="none").tool_mode == "none"
    with pytest.raises(ValueError, match="tool_prompt"):
        TurnRenderer(TOK, tools=schemas, tool_prompt="bogus")


def test_tool_results_are_tool_messages_in_the_episode():
    tok = build_char_tokenizer()
    tok.chat_template = TOOLS_TEMPLATE
    env = ENVS["calculator_tool"](digits=2)
    obs = env.reset(4)
    a, b = obs.removesuffix("=?").split("*")
    turns = iter([call(expression=f"{a}*{b}"), f"<answer>{int(a) * int(b)}</answer>"])

    def gen(ids):
        t = tok(next(turns), add_special_tokens=False).input_ids + [tok.eos_token_id]
        return t, [-0.1] * len(t), 0, "stop"

    t = run_episode(ENVS["calculator_tool"](digits=2), gen, tok, seed=4, traj_id="e", group_id="g")
    assert t.status is Status.CORRECT
    msgs = [{"role": "user", "content": obs}, {"role": "assistant", "content": call(expression=f"{a}*{b}")},
            {"role": "tool", "content": str(int(a) * int(b))},
            {"role": "assistant", "content": f"<answer>{int(a) * int(b)}</answer>"}]
    assert tok.decode(t.token_ids) == tok.apply_chat_template(msgs, tools=[CALCULATOR.schema()], tokenize=False)


def test_env_task_splits_by_problem_and_is_deterministic():
    task = build_env_task("calculator_tool", {"digits": 3})
    tr, ho = task.examples("train", 50, seed=1), task.examples("heldout", 20, seed=1)
    assert tr == task.examples("train", 50, seed=1)
    assert not {e.prompt for e in tr} & {e.prompt for e in ho}
    ex = ho[0]
    assert ENVS["calculator_tool"](digits=3).reset(int(ex.meta["env_seed"])) == ex.prompt
    with pytest.raises(ValueError, match="env.kwargs"):
        build_env_task("calculator_tool", {"digitz": 3})
