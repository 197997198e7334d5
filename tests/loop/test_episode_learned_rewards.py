"""Learned rewards on multi-turn episodes (posttrain/loop/episode_rollout.py): a reward model's or a judge's
component is added to each episode the environment scored, on (first observation, the episode after it).

A scripted engine plays the calculator_tool episodes (call the calculator, then answer with its result), so
the text the scorer sees is hand-computed; the end-to-end case runs ``train`` on the micro model against a
stub judge server on 127.0.0.1 that scores a response by its length.
"""

from __future__ import annotations

import re
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from posttrain.config import RunConfig
from posttrain.config.feedback import RewardConfig
from posttrain.envs.episodes import EnvTask
from posttrain.envs.tool_calling import calculator_tool_env
from posttrain.loop.rollout_stage import RolloutStage, build_rollout
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer
from posttrain.rewards.learned import ComponentScorer, LearnedRewards
from posttrain.rollout.types import Completion
from posttrain.trajectory import Role, Status
from tests._judge_stub import between_r_tags, chat_reply, serve

pytestmark = pytest.mark.timeout(300)
TOK = build_char_tokenizer()
ENV = ["model.path=builtin:micro", "env.name=calculator_tool", "env.kwargs={digits: 2}", "env.tool_prompt=none",
       "env.max_tokens=500", "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=120"]


def with_learned(cfg: RunConfig, **learned: object) -> RunConfig:
    """``cfg`` with ``reward.model`` / ``reward.judge`` set (their weights entered into reward.weights).

    Set on the loaded config so prompt templates with braces need no override quoting; loading them as
    overrides with ``env.name`` is tested in tests/rewards/test_judge.py."""
    return cfg.model_copy(update={"reward": RewardConfig(weights=dict(cfg.reward.weights), **learned)})


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


def solver(text: str) -> str:
    """Calls the calculator on the problem, then answers with the tool's result."""
    a, b = re.search(r"(\d+)\*(\d+)=\?", text).groups()
    results = re.findall(r"<\|tool\|>(-?\d+)", text)
    return f"<answer>{results[-1]}</answer>" if results else call(f"{a}*{b}")


class ScriptedEngine:
    """Each turn is ``solver(conversation)`` + eos; log-prob -0.5 and version 0 per token."""

    def generate(self, requests, finish_target=None):
        out = []
        for r in requests:
            ids = TOK(solver(TOK.decode(r.prompt_ids)), add_special_tokens=False).input_ids + [TOK.eos_token_id]
            out.append(Completion(r.request_id, 0, list(r.prompt_ids), ids, [-0.5] * len(ids), [0] * len(ids), "eos",
                                  params=r.params, seed=r.params.seed))
        return out


def play(cfg: RunConfig, score_rows) -> list:
    """One rollout call of ``cfg`` with the scripted engine and ``score_rows`` as the ``judge`` component."""
    task = EnvTask("calculator_tool", calculator_tool_env, cfg.env.kwargs)
    verify = LearnedRewards(lambda items: pytest.fail("episodes are not verified"), [ComponentScorer("judge", score_rows)])
    run = types.SimpleNamespace(cfg=cfg, engine=ScriptedEngine(), tokenizer=TOK, task=task, plain_model=None,
                                next_prompts=lambda n: task.examples("train", n, seed=1), verify_batch=verify)
    groups, _ = build_rollout(cfg, run, RolloutStage.from_config(cfg)).run_call(0)
    return [t for g in groups for t in g]


def test_the_judge_scores_each_episode_on_its_first_observation_and_the_turns_after_it() -> None:
    cfg = with_learned(load_run_config(None, ENV), judge={"url": "http://127.0.0.1:1", "weight": 0.5})
    seen: list[tuple[str, str]] = []

    def score_rows(prompts, responses):
        seen.extend(zip(prompts, responses, strict=True))
        return [float(len(r)) for r in responses]

    trajs = play(cfg, score_rows)
    assert len(trajs) == 4 and len(seen) == 4
    for t, (prompt, response) in zip(trajs, seen, strict=True):
        a, b = map(int, re.search(r"(\d+)\*(\d+)=\?", prompt).groups())
        assert TOK.decode([i for i, r in zip(t.token_ids, t.roles, strict=True) if r is Role.PROMPT],
                          skip_special_tokens=True) == prompt  # the first observation, as the policy read it
        # turn 1, the tool's result (its <|tool|> / <|assistant|> markers and the eos are special tokens), turn 2
        assert response == f"{call(f'{a}*{b}')}{a * b}<answer>{a * b}</answer>"
        assert t.status is Status.CORRECT
        c = t.reward.components
        assert (c["task"], c["tool_calls"], c["judge"]) == (1.0, 1.0, float(len(response)))
        assert t.reward.weights == {"task": 1.0, "judge": 0.5}
        assert t.reward.total == pytest.approx(1.0 + 0.5 * len(response), abs=1e-12)


def test_an_episode_the_judge_cannot_score_is_infra_error_never_zero() -> None:
    cfg = with_learned(load_run_config(None, ENV), judge={"url": "http://127.0.0.1:1"})
    trajs = play(cfg, lambda prompts, responses: ["judge unreachable"] * len(responses))
    assert [t.status for t in trajs] == [Status.INFRA_ERROR] * 4
    for t in trajs:
        assert t.reward.total is None and t.reward.components == {}
        assert "judge unreachable; the verifier said correct" in str(t.meta["explanation"])


@pytest.fixture
def length_judge() -> Iterator[tuple[list[dict], str]]:
    """A stub OpenAI-compatible judge on 127.0.0.1: ``score: <length of the text between <r> and </r>>``."""
    requests: list[dict] = []

    def reply(path: str, body: dict) -> tuple[int, bytes]:
        requests.append(body)
        return chat_reply(f"score: {len(between_r_tags(body))}")

    with serve(reply) as url:
        yield requests, url


def test_a_multi_turn_run_records_the_judges_component_of_each_episode(length_judge, tmp_path: Path) -> None:
    """One GRPO step of builtin:micro on calculator_tool episodes with the stub judge: every episode the
    environment scored carries judge = the length of its text after the first observation (decoded from
    the ledger's tokens), and total = task + 0.25 judge."""
    from posttrain.loop.training_loop import train
    from posttrain.trajectory import Ledger

    requests, url = length_judge
    d = tmp_path / "episodes_judge"
    cfg = load_run_config("grpo", [
        *ENV, "sampling.max_new_tokens=6", "env.max_turns=2", "eval.size=2", "eval.every=100", "steps=1",
        "checkpoint_every=0", "sft.steps=0", "logging.progress=false", f"run_dir={d}"])
    train(with_learned(cfg, judge={"url": url, "parse": "score", "weight": 0.25, "timeout_s": 5,
                                   "prompt_template": "Q: {prompt} A: <r>{response}</r>"}))
    trajs = Ledger(d / "ledger").read_trajectories()
    assert len(trajs) == 4 and len(requests) == 4
    for t in trajs:
        assert t.status not in (Status.INFRA_ERROR, Status.ENV_FAILURE), t.meta["explanation"]
        after = [i for i, r in zip(t.token_ids, t.roles, strict=True) if r is not Role.PROMPT]
        c = t.reward.components
        assert c["judge"] == float(len(TOK.decode(after, skip_special_tokens=True)))
        assert t.reward.total == pytest.approx(c["task"] + 0.25 * c["judge"], abs=1e-12)


@pytest.fixture
def digit_judge() -> Iterator[str]:
    """A stub judge on 127.0.0.1: ``score: <digits in the text between <r> and </r>>``."""
    with serve(lambda path, body: chat_reply(f"score: {sum(ch.isdigit() for ch in between_r_tags(body))}")) as url:
        yield url


def test_rl_on_the_judge_alone_raises_its_score_on_episodes(digit_judge, tmp_path: Path) -> None:
    """GRPO on calculator_tool episodes of the random micro model rewarded by a judge counting the digits of
    each episode's response, no task weight: the judge's mean score rises (measured, seeds 0-2: 0.3-0.5 over
    steps 1-3 -> 2.9 of at most 3 over steps 10-12). A 3-token turn hits its length limit, which ends the
    episode: these episodes have one turn (the scripted tests above have observations between turns)."""
    from posttrain.loop.training_loop import train
    from posttrain.trajectory import Ledger

    d = tmp_path / "episodes_digits"
    cfg = load_run_config("grpo", [
        *ENV, "sampling.prompts_per_step=8", "sampling.group_size=4", "sampling.max_new_tokens=3",
        "env.max_turns=2", "eval.size=2", "eval.every=100", "steps=12", "checkpoint_every=0", "sft.steps=0",
        "optim.lr=1e-2", "guards.max_truncation_rate=1.0", "logging.progress=false", f"run_dir={d}"])
    cfg = with_learned(cfg, judge={"url": digit_judge, "parse": "score", "timeout_s": 5,
                                   "prompt_template": "Q: {prompt} A: <r>{response}</r>"})
    train(cfg.model_copy(update={"reward": cfg.reward.model_copy(update={"weights": {"judge": 1.0}})}))
    by_step: dict[int, list[float]] = {}
    for t in Ledger(d / "ledger").read_trajectories():
        m = re.match(r"s(\d+)", t.traj_id)
        if m is not None and t.reward.total is not None:
            by_step.setdefault(int(m.group(1)), []).append(t.reward.components["judge"])
    mean = {s: sum(v) / len(v) for s, v in by_step.items()}
    first, last = sum(mean[s] for s in (1, 2, 3)) / 3, sum(mean[s] for s in (10, 11, 12)) / 3
    assert last > first + 1.0, (first, last, mean)
