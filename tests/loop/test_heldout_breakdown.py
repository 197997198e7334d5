"""What a held-out evaluation reports beside accuracy (posttrain/loop/heldout_breakdown.py): the per-family
constraint rates of instruction following, hand-computed on a 3-problem toy, and the tool calls per held-out
episode of a tool environment under a scripted policy (0.0 is a value; no tools, no key)."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from posttrain.loop.heldout import evaluate, evaluate_episodes
from posttrain.loop.heldout_breakdown import constraint_rates, tool_calls_per_episode
from posttrain.rewards.instructions import InstructionsVerifier
from posttrain.rollout.types import Completion
from tests.loop._heldout_stubs import CodePointTokenizer, Example, StubTask
from tests.loop.test_episode_rollout import ScriptedEngine, call, make_run, solver

pytestmark = pytest.mark.timeout(120)

# Three problems: their constraint specs and the one (greedy) response each gets.
_TOY = {
    "a": ([{"family": "all_lowercase"}, {"family": "no_commas"}], "hello there, friend"),  # 1, 0
    "b": ([{"family": "all_lowercase"}, {"family": "words_at_most", "n": 3}], "Hi you"),  # 0, 1
    "c": ([{"family": "no_commas"}, {"family": "words_at_most", "n": 2}, {"family": "quoted"}],
          '"one two"'),  # 1, 1, 1: every constraint met
}


class _Tok(CodePointTokenizer):
    """A prompt is its characters' code points; a response token ``ord(p)`` decodes to problem ``p``'s response."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return _TOY[chr(ids[0])][1]


class _Engine:
    """One token per sample: the prompt's first (so the response is the problem's own)."""

    def generate(self, reqs: list[Any]) -> list[Completion]:
        return [Completion(request_id=r.request_id, sample_index=j, prompt_ids=r.prompt_ids,
                           token_ids=[r.prompt_ids[0]], logprobs=[0.0], versions=[0], finish_reason="eos")
                for r in reqs for j in range(r.params.n)]


def test_per_family_constraint_rates_of_a_three_problem_toy() -> None:
    examples = [Example(p, p, json.dumps(spec)) for p, (spec, _) in _TOY.items()]
    res = evaluate(_Engine(), _Tok(), StubTask(InstructionsVerifier()), examples, max_new_tokens=1)
    assert res.accuracy == pytest.approx(1 / 3)  # only c meets all its constraints
    # all_lowercase: a yes, b no -> 1/2; no_commas: a no, c yes -> 1/2; words_at_most: b, c -> 2/2; quoted: c -> 1/1
    assert res.constraint_rates == {"ifc/all_lowercase": 0.5, "ifc/no_commas": 0.5, "ifc/quoted": 1.0,
                                    "ifc/words_at_most": 1.0}
    m = res.as_metrics("heldout_unseen")
    assert {k: v for k, v in m.items() if "/ifc/" in k} == {
        "heldout_unseen/ifc/all_lowercase": 0.5, "heldout_unseen/ifc/no_commas": 0.5,
        "heldout_unseen/ifc/quoted": 1.0, "heldout_unseen/ifc/words_at_most": 1.0}  # only the families asked
    assert "heldout_unseen/tool_calls_mean" not in m  # no tools in this task


def test_constraint_rates_count_unmet_and_ignore_other_components() -> None:
    v = InstructionsVerifier()
    spec = json.dumps([{"family": "no_commas"}, {"family": "postscript"}])
    blank, ok = v.verify("  ", spec), v.verify("fine\nP.S. bye", spec)
    assert blank.status.value == "invalid"  # an empty response meets nothing
    assert constraint_rates([blank.components, ok.components]) == {"ifc/no_commas": 0.5, "ifc/postscript": 0.5}
    assert constraint_rates([{"task": 1.0, "format": 1.0}]) == {}  # a task without constraint families


def test_tool_calls_per_held_out_episode_under_a_scripted_policy() -> None:
    def thrice_on_odd_operand(text: str) -> str:
        """Three calculator turns when the first operand is odd, then the answer; none when it is even."""
        a, b = re.search(r"(\d+)\*(\d+)=\?", text).groups()
        results = re.findall(r"<\|tool\|>(-?\d+)", text)
        if int(a) % 2 == 0:
            return f"<answer>{int(a) * int(b)}</answer>"
        return f"<answer>{results[-1]}</answer>" if len(results) == 3 else call(f"{a}*{b}")

    _, _, ro = make_run(ScriptedEngine(thrice_on_odd_operand), "env.max_turns=4")
    exs = ro.run.task.examples("heldout", 4, seed=0)
    assert [ex.prompt for ex in exs] == ["63*84=?", "16*89=?", "36*12=?", "91*50=?"]
    res = evaluate_episodes(ro.player, exs)
    assert res.accuracy == 1.0
    assert res.tool_calls_mean == 1.5  # (3 + 0 + 0 + 3) / 4 episodes
    assert res.as_metrics()["heldout/tool_calls_mean"] == 1.5

    direct = evaluate_episodes(make_run(ScriptedEngine(lambda text: "<answer>0</answer>"))[2].player, exs)
    assert direct.tool_calls_mean == 0.0 and direct.as_metrics()["heldout/tool_calls_mean"] == 0.0  # a real 0

    _, _, ro1 = make_run(ScriptedEngine(solver))
    assert evaluate_episodes(ro1.player, exs).tool_calls_mean == 1.0  # one call, then the answer
    off = evaluate_episodes(ro1.player, exs, env_overrides={"use_tools": False})
    assert off.tool_calls_mean is None and "heldout/tool_calls_mean" not in off.as_metrics()  # no tools, no key


def test_tool_calls_per_episode_by_hand() -> None:
    assert tool_calls_per_episode([{"tool_calls": 3.0, "task": 1.0}, {"task": 0.0}]) == 1.5  # absent = no call
    assert tool_calls_per_episode([]) != tool_calls_per_episode([])  # NaN for no episode
