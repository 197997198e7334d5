"""Partial rollout of multi-turn episodes: suspended between turns, resumed with their environment.

A scripted engine plays three kinds of episode per group (episode j of a group takes j + 1 turns),
so which episodes end in which turn round, and so what a call returns, is hand-computed.
"""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_episode_credit import ByEpisode  # noqa: E402
from test_episode_rollout import call, make_run  # noqa: E402

from posttrain.trajectory import Finish, Role, Status  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _ab(text):
    a, b = re.search(r"(\d+)\*(\d+)=\?", text).groups()
    return int(a), int(b)


def direct(text, turn):  # 1 turn: the right answer without the tool
    a, b = _ab(text)
    return f"<answer>{a * b}</answer>"


def tool_once(text, turn):  # 2 turns: call, then answer the tool's result
    a, b = _ab(text)
    return call(f"{a}*{b}") if turn == 0 else f"<answer>{re.findall(r'<[|]tool[|]>(-?[0-9]+)', text)[-1]}</answer>"


def tool_twice(text, turn):  # 3 turns: two calls (the second uses the first's result), then answer
    a, b = _ab(text)
    results = re.findall(r"<[|]tool[|]>(-?[0-9]+)", text)
    if turn == 0:
        return call(f"{a}*{b}")
    if turn == 1:
        return call(f"{results[-1]}+0")
    return f"<answer>{results[-1]}</answer>"


def _rollout(*extra):
    eng = ByEpisode([direct, tool_once, tool_twice])
    eng.version = 0
    # N = 2 groups x K = 3 episodes; lambda = 0.5 -> a call returns once ceil(0.5 * 6) = 3 have ended
    _, run, ro = make_run(eng, "system.partial_fraction=0.5", "env.max_turns=4", *extra)
    return eng, ro


def test_episodes_suspend_between_turns_and_resume_with_their_environment():
    eng, ro = _rollout()
    groups, info = ro.run_call(0)
    # round 1 ends the two `direct` episodes (2 < 3), round 2 the two `tool_once` ones (4 >= 3): stop.
    # Each group still has its `tool_twice` episode, suspended after 2 turns: nothing is emitted.
    assert groups == []
    assert info["episode/turn_rounds"] == 2.0 and info["partial/finished"] == 4.0
    assert info["partial/paused"] == 2.0 and len(ro.carry) == 2 and ro.inflight() == 6
    for e in ro.carry:
        assert e.turns == 2 and not e.done and e.traj_id.endswith("/2")
        assert e.roles[-1] is Role.OBSERVATION  # suspended after the environment answered its turn
    eng.version = 1  # a weight update between the two calls
    groups, info = ro.run_call(1)
    # the carried episodes resume (2 = one group's worth is not complete, so 2 fresh groups top up to
    # N*K); round 1 ends both resumed episodes and the two fresh `direct` ones (4 >= 3): stop.
    assert info["partial/resumed"] == 2.0 and info["partial/fresh_prompts"] == 2.0
    assert info["episode/turn_rounds"] == 1.0
    assert [len(g) for g in groups] == [3, 3]
    for g in groups:
        assert g[0].group_id.startswith("s1r0p")  # the groups of call 0, completed in call 1
        for t in g:
            assert t.status is Status.CORRECT and t.finish is Finish.TERMINAL
        two = g[2]
        # the environment kept its state across the pause: two tool calls, one of them before it
        assert two.reward.components["tool_calls"] == 2.0 and two.meta["pauses"] == 1
        act = two.action_mask.astype(bool)
        turn_of = np.cumsum(np.r_[0, np.diff(act.astype(int)) == 1])  # action runs are turns
        versions = [sorted(set(two.behavior_version[act & (turn_of == k)].tolist())) for k in np.unique(turn_of[act])]
        assert versions == [[0], [0], [1]]  # the third turn ran under the new weights
        assert two.meta["version_span"] == 1 and two.meta["pause_age"] == 1
        assert all(t.meta["pauses"] == 0 for t in g[:2])
    # the fresh groups' longer episodes are carried on
    assert len(ro.carry) == 4 and ro.inflight() == 6


def test_a_suspended_episode_past_the_version_span_is_dropped_and_counted():
    eng, ro = _rollout("system.max_version_span=0")
    ro.run_call(0)
    eng.version = 1
    groups, info = ro.run_call(1)
    assert info["partial/dropped_span"] == 2.0 and ro.dropped == 2
    assert [len(g) for g in groups] == [2, 2]  # the call-0 groups without their dropped episode
    assert all(t.traj_id[-2:] in ("/0", "/1") for g in groups for t in g)


def test_waiting_while_suspended_does_not_count_against_the_wall_time_limit():
    eng, ro = _rollout("env.max_wall_s=0.5")
    ro.run_call(0)
    time.sleep(0.6)  # longer than max_wall_s, spent suspended
    groups, _ = ro.run_call(1)
    assert all(t.status is Status.CORRECT and t.finish is Finish.TERMINAL for g in groups for t in g)


def test_without_partial_rollout_a_call_runs_every_episode_to_its_end():
    eng = ByEpisode([direct, tool_once, tool_twice])
    eng.version = 0
    _, _, ro = make_run(eng, "env.max_turns=4")
    groups, info = ro.run_call(0)
    assert [len(g) for g in groups] == [3, 3] and info["episode/turn_rounds"] == 3.0
    assert ro.carry == [] and ro.inflight() == 0


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_partial_rollout_of_episodes_trains_from_a_recipe(tmp_path, mode):
    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory import Ledger

    cfg = load_run_config(None, ["model.path=builtin:micro", "env.name=calculator_tool", "env.tool_prompt=none",
                             "env.max_turns=3", "env.max_tokens=160", "env.stop_strings=['e', 'o']",
                             "sampling.prompts_per_step=2", "sampling.group_size=3", "sampling.max_new_tokens=12",
                             "eval.size=2", "eval.every=4", "steps=4", "logging.progress=false", "seed=3",
                             "guards.max_truncation_rate=1.0", f"system.mode={mode}", "system.partial_fraction=0.5",
                             f"run_dir={tmp_path}"])
    st = train(cfg)
    assert st.step == 4
    trajs = Ledger(tmp_path / "ledger").read_trajectories()
    paused = [t for t in trajs if int(t.meta["pauses"]) > 0]
    assert paused, "no episode was suspended: the test would not exercise partial rollout"
    for t in trajs:
        act = t.action_mask.astype(bool)
        assert (t.behavior_version[act] >= 0).all() and (t.behavior_version[~act] == -1).all()
    if mode == "sync":  # every call follows an update: a resumed episode spans two versions
        assert any(len(set(t.behavior_version[t.action_mask.astype(bool)].tolist())) > 1 for t in paused)
    else:  # the worker may resume before the next update; the staleness bound still holds
        assert all(t.policy_lag is not None and t.policy_lag <= 1 for t in trajs)


def test_a_turn_the_workers_could_not_serve_is_an_infra_error_not_a_zero():
    """A worker set (``generate_detailed``) that fails one request: that episode ends ``infra_error``
    with no reward; the other episodes of the call go on."""
    from posttrain.loop.backends.base import FailedRequest, RolloutResult

    class FlakyWorkers(ByEpisode):
        def generate_detailed(self, requests, finish_target=None):
            bad = [r for r in requests if r.request_id.endswith("/1@t1")]  # every tool_once's second turn
            good = [r for r in requests if r not in bad]
            return RolloutResult(completions=self.generate(good),
                                 failed=[FailedRequest(r, "worker 0 died", 2) for r in bad])

    eng = FlakyWorkers([direct, tool_once, tool_twice])
    eng.version = 0
    _, _, ro = make_run(eng, "env.max_turns=4")
    groups, _ = ro.run_call(0)
    for g in groups:
        assert [t.status for t in g] == [Status.CORRECT, Status.INFRA_ERROR, Status.CORRECT]
        bad = g[1]
        assert bad.reward.total is None and "worker 0 died" in bad.meta["explanation"]
