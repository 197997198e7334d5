"""Tool-calling environments, the worked examples of :mod:`posttrain.envs.multiturn`.

``calculator``: the task is an expression too long to do in one's head (``"37*48+15"``); the
policy may call ``<calc>EXPR</calc>`` (evaluated by the safe countdown evaluator, never ``eval``)
and ends with ``<answer>N</answer>``. ``python``: the same protocol with ``<python>CODE</python>``
run in the code sandbox (stdout is the observation).

Reward parts (declared in ``reward_components``): ``task`` (1 on a correct answer, else 0, on the
final step), ``tool_calls`` (+1 per call, a raw count a config may weight, e.g. negatively as a
cost; 0 in an episode without a call) and ``format`` (-1 per turn with neither a call nor an answer).
"""

from __future__ import annotations

import dataclasses
import random
import re
from typing import ClassVar

from posttrain.envs.multiturn import StepResult
from posttrain.rewards.countdown import ExpressionError, safe_evaluate
from posttrain.trajectory import Status

_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_PY = re.compile(r"<python>(.*?)</python>", re.DOTALL)
_ANSWER = re.compile(r"<answer>\s*([+-]?\d+)\s*</answer>")


def answer_step(action_text: str, target: int) -> StepResult | None:
    """The episode's last step when ``action_text`` gives ``<answer>N</answer>`` (done; ``task`` 1.0 and
    status correct iff ``N == target``, else 0.0 and wrong), or ``None`` when it gives no answer."""
    ans = _ANSWER.search(action_text)
    if not ans:
        return None
    ok = int(ans.group(1)) == target
    return StepResult("", {"task": float(ok)}, done=True,
                      info={"status": Status.CORRECT if ok else Status.WRONG,
                            "explanation": f"answered {ans.group(1)}, expected {target}"})


def _problem(rng: random.Random, digits: int) -> tuple[str, int]:
    hi = 10**digits
    a, b, c = rng.randrange(2, hi), rng.randrange(2, hi), rng.randrange(hi)
    return f"{a}*{b}+{c}", a * b + c


@dataclasses.dataclass
class CalculatorEnv:
    """``reset(seed)`` -> ``"37*48+15=? <calc>"``-style statement; see the module docstring."""

    #: the reward parts its steps report (checked against ``reward.weights`` at config load)
    reward_components: ClassVar[tuple[str, ...]] = ("task", "tool_calls", "format")
    digits: int = 2
    name: str = "calculator"
    version: str = "1"
    target: int | None = dataclasses.field(default=None, init=False)
    calls: int = dataclasses.field(default=0, init=False)

    def reset(self, seed: int) -> str:
        """New problem from ``seed``; the statement names the tool syntax."""
        expr, self.target = _problem(random.Random(f"{self.name}|{seed}"), self.digits)
        self.calls = 0
        return f"{expr}=? tools: <calc>e</calc>, <answer>n</answer>"

    def _tool(self, body: str) -> str:
        try:
            value, _ = safe_evaluate(body)
        except ExpressionError as e:
            return f"error: {e}"
        return str(value)

    def step(self, action_text: str) -> StepResult:
        """Answer -> done with ``task``; tool call -> its result; else a format hint."""
        if self.target is None:
            raise RuntimeError(f"{self.name}: step() before reset()")
        final = answer_step(action_text, self.target)
        if final is not None:
            return final
        call = self._find_call(action_text)
        if call is None:
            return StepResult("error: call a tool or give <answer>n</answer>", {"format": -1.0})
        self.calls += 1
        return StepResult(self._tool(call), {"tool_calls": 1.0})

    def _find_call(self, text: str) -> str | None:
        m = _CALC.search(text)
        return m.group(1) if m else None


@dataclasses.dataclass
class PythonToolEnv(CalculatorEnv):
    """Like :class:`CalculatorEnv` but the tool is ``<python>CODE</python>`` in the sandbox."""

    name: str = "python_tool"
    wall_s: float = 5.0

    def reset(self, seed: int) -> str:
        """New problem from ``seed``."""
        return super().reset(seed).replace("<calc>e</calc>", "<python>code</python>")

    def _find_call(self, text: str) -> str | None:
        m = _PY.search(text)
        return m.group(1) if m else None

    def _tool(self, body: str) -> str:
        from posttrain.sandbox import SandboxLimits, run_python

        r = run_python(body, limits=SandboxLimits(wall_s=self.wall_s, output_bytes=4096))
        if r.outcome == "ok":
            return r.stdout.strip()[:200]
        return f"error: {r.outcome}: {r.reason}"[:200]
