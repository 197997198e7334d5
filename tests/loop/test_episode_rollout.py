"""Multi-turn episodes in the loop (posttrain/loop/episode_rollout.py): batching, roles, limits, versions.

A scripted engine plays the policy (its turns are fixed functions of the conversation so far),
so every expectation is hand-computed; the end-to-end cases run ``train`` on the micro model.
"""

from __future__ import annotations

import dataclasses
import re
import types

import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.envs.episodes import EnvTask
from posttrain.envs.tool_calling import calculator_tool_env
from posttrain.loop.heldout import evaluate_episodes
from posttrain.loop.rollout_stage import RolloutStage, build_rollout
from posttrain.loop.validate import load_run_config
from posttrain.models import build_char_tokenizer
from posttrain.rollout.types import Completion
from posttrain.trajectory import Finish, Role, Status

pytestmark = pytest.mark.timeout(120)
TOK = build_char_tokenizer()


def call(expr: str) -> str:
    return '<tool_call>{"name": "calculator", "arguments": {"expression": "' + expr + '"}}</tool_call>'


class ScriptedEngine:
    """``policy(conversation_text) -> turn text``; every token gets log-prob -0.5 and the engine's
    version. ``pause_first``: the first generate call returns every row paused after 2 tokens and
    bumps the version (a weight update arriving mid-turn, as async's interrupt does)."""

    def __init__(self, policy, pause_first=False):
        self.policy, self.version, self.calls, self.pause_first = policy, 0, [], pause_first

    def generate(self, requests, finish_target=None):
        self.calls.append([r.request_id for r in requests])
        out = []
        for r in requests:
            prev = list(r.resume.token_ids) if r.resume is not None else []
            text = self.policy(TOK.decode(r.prompt_ids))
            ids = TOK(text, add_special_tokens=False).input_ids + [TOK.eos_token_id]
            ids = ids[: r.params.max_new_tokens]
            if self.pause_first and len(self.calls) == 1:
                new = ids[:2]
                out.append(Completion(r.request_id, 0, list(r.prompt_ids), new, [-0.5] * 2, [self.version] * 2,
                                      "paused", params=r.params, seed=r.params.seed))
                continue
            assert ids[: len(prev)] == prev
            new = ids[len(prev):]
            versions = (list(r.resume.versions) if r.resume is not None else []) + [self.version] * len(new)
            lps = (list(r.resume.logprobs) if r.resume is not None else []) + [-0.5] * len(new)
            reason = "eos" if ids[-1] == TOK.eos_token_id else "length"
            out.append(Completion(r.request_id, 0, list(r.prompt_ids), ids, lps, versions, reason, params=r.params,
                                  seed=r.params.seed))
        if self.pause_first and len(self.calls) == 1:
            self.version += 1
        return out


def solver(text: str) -> str:
    """Calls the calculator on the problem, then answers with the tool's result."""
    a, b = re.search(r"(\d+)\*(\d+)=\?", text).groups()
    results = re.findall(r"<\|tool\|>(-?\d+)", text)
    return f"<answer>{results[-1]}</answer>" if results else call(f"{a}*{b}")


def make_run(engine, *extra, env_factory=None):
    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", "env.kwargs={digits: 2}",
                             "sampling.prompts_per_step=2", "sampling.group_size=3", "sampling.max_new_tokens=120",
                             "env.max_tokens=500", "env.tool_prompt=none", *extra])
    task = EnvTask("calculator_tool", env_factory or calculator_tool_env, cfg.env.kwargs)
    cursor = {"n": 0}

    def next_prompts(n):
        cursor["n"] += n
        return task.examples("train", n, seed=cursor["n"])

    run = types.SimpleNamespace(cfg=cfg, engine=engine, tokenizer=TOK, task=task, next_prompts=next_prompts,
                                plain_model=None)
    return cfg, run, build_rollout(cfg, run, RolloutStage.from_config(cfg))


def runs_of(t):
    import itertools

    return [r for r, _ in itertools.groupby(t.roles)]


def test_one_engine_call_per_turn_round_and_roles_masks_versions():
    eng = ScriptedEngine(solver)
    cfg, run, ro = make_run(eng)
    groups, info = ro.run_call(0)
    assert [len(g) for g in groups] == [3, 3]
    # 6 live episodes: round 1 (tool calls) and round 2 (answers), one engine call each, all 6 rows in it
    assert [len(c) for c in eng.calls] == [6, 6] and info["episode/engine_calls"] == 2.0
    for g in groups:
        assert len({t.env_seed for t in g}) == 1  # a group shares its start state
        for t in g:
            assert t.status is Status.CORRECT and t.finish is Finish.TERMINAL and t.reward.total == 1.0
            assert t.reward.components == {"task": 1.0, "tool_calls": 1.0}
            assert runs_of(t) == [Role.PROMPT, Role.ACTION, Role.OBSERVATION, Role.ACTION]
            obs = np.array([r is Role.OBSERVATION for r in t.roles])
            assert (t.action_mask[obs] == 0).all() and (t.behavior_version[obs] == -1).all()
            assert (t.behavior_logprob[obs] == 0).all()
            assert (t.behavior_logprob[t.action_mask == 1] == -0.5).all()
            assert set(t.behavior_version[t.action_mask == 1].tolist()) == {0}
            assert t.steps.rewards == (0.0, 1.0)  # weights {task: 1}: the answer step only


def test_turn_limit_truncates_and_invalid_calls_are_observations():
    eng = ScriptedEngine(lambda text: '<tool_call>{"name": "abacus", "arguments": {}}</tool_call>')
    _, _, ro = make_run(eng, "env.max_turns=2", "sampling.prompts_per_step=1")
    (g,), _ = ro.run_call(0)
    t = g[0]
    assert t.finish is Finish.TRUNCATED and t.status is Status.INVALID and "turn limit 2" in t.meta["explanation"]
    assert t.reward.total == 0.0 and t.reward.components["invalid_actions"] == 2.0
    assert "unknown tool 'abacus'" in t.meta["transcript"]


def test_wall_time_limit_truncates(monkeypatch):
    import posttrain.envs.multiturn as mt

    clock = {"t": 0.0}

    def tick():
        clock["t"] += 10.0  # every reading of the clock is 10 s later
        return clock["t"]

    monkeypatch.setattr(mt.time, "perf_counter", tick)
    _, _, ro = make_run(ScriptedEngine(solver), "env.max_wall_s=15", "sampling.prompts_per_step=1")
    (g,), _ = ro.run_call(0)
    assert all(t.finish is Finish.TRUNCATED and "wall-time limit" in t.meta["explanation"] for t in g)


@dataclasses.dataclass
class BrokenStep:
    name: str = "broken"
    version: str = "1"

    def reset(self, seed):
        return f"{seed % 90 + 10}*{seed % 7 + 10}=?"

    def step(self, text):
        raise RuntimeError("simulator died")


def test_environment_exception_is_env_failure_and_tool_crash_is_an_observation():
    _, _, ro = make_run(ScriptedEngine(lambda text: "x"), "sampling.prompts_per_step=1",
                        env_factory=lambda **kw: BrokenStep())
    (g,), info = ro.run_call(0)
    assert all(t.status is Status.ENV_FAILURE and t.reward.total is None for t in g)
    assert info["episode/env_failures"] == 3.0
    # a calculator error (division by zero) comes back as the tool's message, the episode goes on
    eng = ScriptedEngine(lambda text: call("1/0") if "<|tool|>" not in text else "<answer>1</answer>")
    _, _, ro = make_run(eng, "sampling.prompts_per_step=1")
    (g,), _ = ro.run_call(0)
    t = g[0]
    assert t.status is Status.WRONG and "tool error: ExpressionError" in t.meta["transcript"]


def test_env_failure_is_excluded_from_the_update_not_zero():
    from posttrain.loop.training_loop import update_step

    _, _, ro = make_run(ScriptedEngine(lambda text: "x"), "sampling.prompts_per_step=1",
                        env_factory=lambda **kw: BrokenStep())
    (g,), info = ro.run_call(0)
    seen = {}

    def finish_step(step, trajs, metrics, t):
        seen.update(trajs=trajs, metrics=metrics)

    run = types.SimpleNamespace(cfg=ro.cfg, state=None, finish_step=finish_step)
    prod = types.SimpleNamespace(trajectories=g, info=info, dropped=[])
    m, _ = update_step(run, None, 1, prod, 0.0)  # nothing usable: the step is skipped, nothing is trained
    assert m["skipped"] == 1.0 and len(seen["trajs"]) == 3


def test_paused_turn_resumes_under_the_new_version():
    eng = ScriptedEngine(solver, pause_first=True)
    _, _, ro = make_run(eng, "sampling.prompts_per_step=1")
    (g,), info = ro.run_call(0)
    assert info["episode/engine_calls"] == 3.0  # round 1 paused + resumed, round 2
    for t in g:
        v = t.behavior_version[t.action_mask == 1].tolist()
        assert v[:2] == [0, 0] and set(v[2:]) == {1}  # the turn spans versions 0 -> 1
        assert t.status is Status.CORRECT and t.meta["version_span"] == 1


def test_versions_differ_across_turns_when_weights_update_between_rounds():
    eng = ScriptedEngine(solver)
    orig = eng.generate

    def gen(requests, finish_target=None):
        out = orig(requests, finish_target)
        eng.version += 1  # an update lands between turn rounds
        return out

    eng.generate = gen
    _, _, ro = make_run(eng, "sampling.prompts_per_step=1")
    (g,), _ = ro.run_call(0)
    for t in g:
        roles = np.array([r.value for r in t.roles])
        acts = np.flatnonzero(roles == "action")
        first_turn_end = np.flatnonzero(roles == "observation")[0]
        assert set(t.behavior_version[acts[acts < first_turn_end]].tolist()) == {0}
        assert set(t.behavior_version[acts[acts > first_turn_end]].tolist()) == {1}


def test_heldout_episode_evaluation_with_and_without_tools():
    _, _, ro = make_run(ScriptedEngine(solver))
    exs = ro.run.task.examples("heldout", 3, seed=0)
    res = evaluate_episodes(ro.player, exs)
    assert res.accuracy == 1.0 and res.n == 3
    off = evaluate_episodes(ro.player, exs, env_overrides={"use_tools": False})
    assert off.accuracy == 0.0 and off.status_counts == {"invalid": 3}  # calls refused until the turn limit


def test_env_config_errors_name_the_key():
    assert load_run_config(None, ["env.name=calculator_tool"]).axes()["feedback"].startswith("env calculator_tool")
    with pytest.raises(ConfigError, match="env.name: unknown env 'nope'"):
        load_run_config(None, ["env.name=nope"])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        load_run_config("dapo", ["env.name=calculator_tool"])
    with pytest.raises(ConfigError, match="env.max_turns"):
        load_run_config(None, ["env.name=calculator_tool", "env.max_turns=0"])
    _, _, ro = make_run(ScriptedEngine(solver), "env.max_tokens=5")
    with pytest.raises(ValueError, match="env.max_tokens=5"):
        ro.run_call(0)


@pytest.mark.parametrize("mode", ["one_step_off", "async"])
def test_episodes_train_in_background_modes(tmp_path, mode):
    from posttrain.loop.training_loop import train
    from posttrain.trajectory import Ledger

    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none",
                             "env.max_turns=2", "env.max_tokens=120", "env.stop_strings=['e', 'o', '1']",
                             "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=20",
                             "eval.size=2", "eval.every=3", "steps=3", "logging.progress=false",
                             "guards.max_truncation_rate=1.0", f"system.mode={mode}", f"run_dir={tmp_path}"])
    st = train(cfg)
    assert st.step == 3
    trajs = Ledger(tmp_path / "ledger").read_trajectories()
    assert len(trajs) == 3 * 4
    for t in trajs:
        act = t.action_mask.astype(bool)
        assert (t.behavior_version[act] >= 0).all() and (t.behavior_version[~act] == -1).all()
        assert t.policy_lag is not None and t.policy_lag <= 1  # one_step_off lag 1; async max_staleness 1


def test_sft_pairs_replay_demonstrations_as_the_rollout_renders_them():
    from posttrain.envs.tool_calling import hermes_call
    from posttrain.loop.episode_rollout import sft_pairs

    _, run, ro = make_run(ScriptedEngine(solver), "env.kwargs={digits: 2, demo_direct_fraction: 0.5}")
    exs = run.task.examples("train", 12, seed=3)
    pairs = sft_pairs(ro.player, exs)
    by_prompt = {}
    for p, a in pairs:
        by_prompt.setdefault(TOK.decode(p).split("<|assistant|>")[0], []).append((TOK.decode(p), TOK.decode(a)))
    n_tool = 0
    for ex in exs:
        env = run.task.make_env()
        obs = env.reset(int(ex.meta["env_seed"]))
        turns = by_prompt[f"<|user|>{obs}"]
        assert turns[0][0] == f"<|user|>{obs}<|assistant|>"  # exactly the rollout's first context
        if len(turns) == 2:  # tool path: the call, then an answer copying the tool's result
            n_tool += 1
            a, b = obs.removesuffix("=?").split("*")
            assert turns[0][1] == hermes_call("calculator", expression=f"{a}*{b}") + "<eos>"
            assert turns[1][0].endswith(f"<|tool|>{int(a) * int(b)}<|assistant|>")
            assert turns[1][1] == f"<answer>{int(a) * int(b)}</answer><eos>"
        else:  # direct path: a wrong guess (the warm-up never teaches a product)
            (guess,) = re.findall(r"<answer>(\d+)</answer>", turns[0][1])
            assert int(guess) != env.target and len(guess) == len(str(env.target))
    assert 0 < n_tool < len(exs)
