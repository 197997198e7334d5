"""run_episode: token roles and masks, chat-template rendering, truncation, env failures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from posttrain.envs.multiturn import StepResult, run_episode
from posttrain.envs.tools import CalculatorEnv
from posttrain.models import build_char_tokenizer
from posttrain.trajectory import Finish, Role, Status

TOK = build_char_tokenizer()
# A template whose assistant turn closes with "<eos>\n": the "\n" the model never samples must
# become an observation token.
NEWLINE_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'user' %}<|user|>{% elif m['role'] == 'assistant' %}<|assistant|>{% else %}<|tool|>{% endif %}"
    "{{ m['content'] }}{% if m['role'] == 'assistant' %}<eos>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def scripted(turns: list[str], *, eos: bool = True, version: int = 7):
    """A policy that replays ``turns``; log-prob of its k-th token is -0.1 * (k + 1)."""
    calls = []

    def gen(context_ids):
        calls.append(list(context_ids))
        text = turns[min(len(calls) - 1, len(turns) - 1)]
        ids = TOK(text, add_special_tokens=False).input_ids + ([TOK.eos_token_id] if eos else [])
        return ids, [-0.1 * (k + 1) for k in range(len(ids))], version, "stop" if eos else "length"

    gen.calls = calls
    return gen


def _answer(seed: int) -> int:
    env = CalculatorEnv()
    env.reset(seed)
    return env.target


def test_tool_episode_roles_masks_and_rendering():
    env, seed = CalculatorEnv(), 5
    obs0 = env.reset(seed)
    expr = obs0.split("=")[0]
    a, rest = expr.split("*")
    b, c = rest.split("+")
    gen = scripted([f"<calc>{a}*{b}</calc>", f"<answer>{_answer(seed)}</answer>"])
    t = run_episode(CalculatorEnv(), gen, TOK, seed=seed, traj_id="e0", group_id="g0", max_turns=4)
    assert t.finish is Finish.TERMINAL and t.status is Status.CORRECT
    assert t.reward.components == {"task": 1.0, "tool_calls": 1.0} and t.reward.total == 1.0
    # the whole sequence decodes to the chat template's rendering of the conversation
    msgs = [{"role": "user", "content": obs0}, {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
            {"role": "tool", "content": str(int(a) * int(b))},
            {"role": "assistant", "content": f"<answer>{_answer(seed)}</answer>"}]
    assert TOK.decode(t.token_ids) == TOK.apply_chat_template(msgs, tokenize=False)
    # roles: prompt, action (turn 1 + eos), observation, action (turn 2 + eos)
    n_p = len(TOK.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True).replace("<|user|>", "U")
              .replace("<|assistant|>", "A"))
    n_a1 = len(f"<calc>{a}*{b}</calc>") + 1
    n_o = 1 + len(str(int(a) * int(b))) + 1  # <|tool|> result <|assistant|>
    runs = [(r, sum(1 for _ in g)) for r, g in __import__("itertools").groupby(t.roles)]
    assert runs == [(Role.PROMPT, n_p), (Role.ACTION, n_a1), (Role.OBSERVATION, n_o), (Role.ACTION, t.num_actions - n_a1)]
    assert t.action_mask.tolist() == [int(r is Role.ACTION) for r in t.roles]
    obs = np.array([r is Role.OBSERVATION for r in t.roles])
    assert (t.behavior_logprob[obs] == 0).all() and (t.behavior_version[obs] == -1).all()
    assert t.behavior_logprob[n_p : n_p + 2].tolist() == pytest.approx([-0.1, -0.2])
    assert set(t.behavior_version[t.action_mask == 1].tolist()) == {7}
    # the policy was conditioned exactly on the recorded tokens
    assert gen.calls[1] == t.token_ids[: n_p + n_a1 + n_o].tolist()


def test_template_closing_not_sampled_becomes_observation_tokens():
    tok = build_char_tokenizer()
    tok.chat_template = NEWLINE_TEMPLATE
    gen = scripted(["<calc>2*3</calc>", f"<answer>{_answer(1)}</answer>"])
    t = run_episode(CalculatorEnv(), gen, tok, seed=1, traj_id="e1", group_id="g")
    obs_text = tok.decode([int(i) for i, r in zip(t.token_ids, t.roles, strict=True) if r is Role.OBSERVATION])
    assert obs_text == "\n<|tool|>6<|assistant|>"
    assert t.status is Status.CORRECT


def test_turn_limit_is_truncated_not_terminal():
    t = run_episode(CalculatorEnv(), scripted(["<calc>1+1</calc>"]), TOK, seed=0, traj_id="e", group_id="g",
                    max_turns=3)
    assert t.finish is Finish.TRUNCATED and t.meta["turns"] == 3 and "turn limit" in t.meta["explanation"]
    assert t.status is Status.INVALID and t.reward.components == {"tool_calls": 3.0, "task": 0.0}


def test_token_budget_and_length_finish_truncate():
    t = run_episode(CalculatorEnv(), scripted(["<calc>1+1</calc>"]), TOK, seed=0, traj_id="e", group_id="g",
                    max_turns=50, max_tokens=80)
    assert t.finish is Finish.TRUNCATED and "token budget" in t.meta["explanation"]
    assert t.length <= 80 + 40  # stops at the first turn boundary past the budget
    t2 = run_episode(CalculatorEnv(), scripted(["<calc>1+1"], eos=False), TOK, seed=0, traj_id="e", group_id="g")
    assert t2.finish is Finish.TRUNCATED and "length limit" in t2.meta["explanation"] and t2.meta["turns"] == 1


def test_plain_rendering_without_chat_template():
    seed = 2
    obs0 = CalculatorEnv().reset(seed)
    t = run_episode(CalculatorEnv(), scripted(["<calc>2*2</calc>", f"<answer>{_answer(seed)}</answer>"]), TOK,
                    seed=seed, traj_id="e", group_id="g", use_chat_template=False)
    assert TOK.decode(t.token_ids) == f"{obs0}<calc>2*2</calc><eos>\n4\n<answer>{_answer(seed)}</answer><eos>"


@dataclasses.dataclass
class Exploding(CalculatorEnv):
    name: str = "exploding"

    def step(self, action_text: str) -> StepResult:
        raise RuntimeError("simulator died")


def test_environment_crash_is_env_failure_without_reward():
    t = run_episode(Exploding(), scripted(["x"]), TOK, seed=0, traj_id="e", group_id="g")
    assert t.status is Status.ENV_FAILURE and t.reward.total is None and "simulator died" in t.meta["explanation"]


def test_wrong_answer_and_bad_generate_fn():
    t = run_episode(CalculatorEnv(), scripted(["<answer>-1</answer>"]), TOK, seed=0, traj_id="e", group_id="g")
    assert t.status is Status.WRONG and t.reward.total == 0.0 and t.finish is Finish.TERMINAL

    def bad(ids):
        return [5, 6], [-0.1], 0, "stop"

    t = run_episode(CalculatorEnv(), bad, TOK, seed=0, traj_id="e", group_id="g")
    assert t.status is Status.ENV_FAILURE and "log-probs" in t.meta["explanation"]


# ---------------------------------------------- declared reward parts (issue 22: weighting tool_calls works)
def _tool_answer(seed: int) -> int:
    from posttrain.envs.tool_calling import calculator_tool_env

    env = calculator_tool_env(digits=2)
    env.reset(seed)
    assert env.target is not None
    return env.target


def test_weighted_tool_calls_in_an_episode_without_a_call_is_zero_not_env_failure():
    """calculator_tool declares task / tool_calls / invalid_actions: a direct correct answer reports no
    tool_calls part, which is a count of 0 (before: 'weighted component(s) ['tool_calls'] missing')."""
    from posttrain.envs.tool_calling import calculator_tool_env

    w = {"task": 1.0, "tool_calls": 0.5}
    t = run_episode(calculator_tool_env(digits=2), scripted([f"<answer>{_tool_answer(3)}</answer>"]), TOK, seed=3,
                    traj_id="e", group_id="g", weights=w)
    assert t.status is Status.CORRECT and t.finish is Finish.TERMINAL
    assert t.reward.components == {"task": 1.0, "tool_calls": 0.0}
    assert t.reward.total == 1.0  # 1.0 * 1 + 0.5 * 0
    # one call, then the answer: 1.0 * 1 + 0.5 * 1 = 1.5 (hand-computed)
    call = '<tool_call>{"name": "calculator", "arguments": {"expression": "2*3"}}</tool_call>'
    t = run_episode(calculator_tool_env(digits=2), scripted([call, f"<answer>{_tool_answer(3)}</answer>"]), TOK,
                    seed=3, traj_id="e", group_id="g", weights=w)
    assert t.status is Status.CORRECT and t.reward.components["tool_calls"] == 1.0 and t.reward.total == 1.5


def test_weighted_format_of_the_tag_calculator_is_zero_when_never_reported():
    w = {"task": 1.0, "format": 0.25}
    t = run_episode(CalculatorEnv(), scripted([f"<answer>{_answer(4)}</answer>"]), TOK, seed=4, traj_id="e",
                    group_id="g", weights=w)
    assert t.status is Status.CORRECT and t.reward.components == {"task": 1.0, "format": 0.0}
    assert t.reward.total == 1.0
    # one turn with neither a call nor an answer (format -1), then the answer: 1 - 0.25 = 0.75
    t = run_episode(CalculatorEnv(), scripted(["hm", f"<answer>{_answer(4)}</answer>"]), TOK, seed=4, traj_id="e",
                    group_id="g", weights=w)
    assert t.reward.components["format"] == -1.0 and t.reward.total == 0.75


@dataclasses.dataclass
class Undeclared(CalculatorEnv):
    """An environment without its own declaration: a weighted part it never reports stays an env_failure."""

    name: str = "undeclared"
    reward_components = None  # type: ignore[assignment]


def test_an_undeclared_weighted_part_missing_from_a_terminal_episode_is_still_env_failure():
    t = run_episode(Undeclared(), scripted([f"<answer>{_answer(4)}</answer>"]), TOK, seed=4, traj_id="e",
                    group_id="g", weights={"task": 1.0, "bonus": 1.0})
    assert t.status is Status.ENV_FAILURE and "bonus" in t.meta["explanation"] and t.reward.total is None
