"""Tool calling the way chat models do it: JSON-schema tools, a per-family call parser, tool messages.

A :class:`Tool` is a name, a description, a JSON schema of its parameters (the OpenAI / Hugging
Face ``tools=`` format, :meth:`Tool.schema`) and a Python function. The episode renderer passes
the schemas to the tokenizer's chat template (``apply_chat_template(..., tools=...)``) or, for a
template without tool support, writes a plain-text preamble
(:func:`posttrain.envs.multiturn.tool_preamble`).

Calls are parsed from the model's text by a parser of :data:`TOOL_PARSERS`, one per model family:
``hermes`` (Hermes / Qwen2.5 / SmolLM style) reads ``<tool_call>{"name": ..., "arguments":
{...}}</tool_call>``. A malformed call (not JSON, no name, an unknown tool, arguments that do not
fit the schema) is an *invalid action*: it is not executed, and the observation says why. A tool
whose function raises returns ``"tool error: ..."`` as its result, which the model sees like any
other tool message.

:class:`ToolEnv` composes tools, a parser and a problem source into a multi-turn
:class:`~posttrain.envs.multiturn.Environment`; ``calculator_tool`` and ``python_tool`` are the
built-in ones (registered in :data:`posttrain.envs.episodes.ENVS`).
"""

from __future__ import annotations

import dataclasses
import json
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from posttrain.algos.registry import Registry
from posttrain.envs.multiturn import StepResult
from posttrain.envs.tools import answer_step

TOOL_PARSERS = Registry("tool_parser")
"""name -> ``parse(text) -> list[ParsedCall]`` (one per call the text attempts, in order)."""

_JSON_TYPES: dict[str, tuple[type, ...]] = {"string": (str,), "integer": (int,), "number": (int, float),
                                            "boolean": (bool,), "object": (dict,), "array": (list,)}


@dataclasses.dataclass(frozen=True)
class Tool:
    """A callable tool: ``fn(**arguments) -> str`` with arguments described by ``parameters``
    (a JSON schema of type ``object``)."""

    name: str
    description: str
    parameters: Mapping[str, Any]
    fn: Callable[..., str]

    def schema(self) -> dict[str, Any]:
        """The tool as the chat templates expect it: ``{"type": "function", "function": {...}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": dict(self.parameters)}}


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    """One attempted call: ``name`` / ``arguments`` when well formed, else ``error`` says why."""

    name: str | None
    arguments: Mapping[str, Any]
    error: str | None = None


@TOOL_PARSERS.register("hermes")
def parse_hermes(text: str) -> list[ParsedCall]:
    """Hermes / Qwen tool calls: every ``<tool_call>JSON</tool_call>`` block (an unclosed last block
    counts as an attempt). The JSON must be an object with a string ``name`` and an object
    ``arguments`` (a JSON string holding an object is accepted, as some models emit it)."""
    out: list[ParsedCall] = []
    for m in re.finditer(r"<tool_call>(.*?)(</tool_call>|$)", text, re.DOTALL):
        body, closed = m.group(1).strip(), bool(m.group(2))
        if not closed:
            out.append(ParsedCall(None, {}, "unclosed <tool_call> (missing </tool_call>)"))
            continue
        try:
            obj = json.loads(body)
        except json.JSONDecodeError as e:
            out.append(ParsedCall(None, {}, f"tool call is not valid JSON ({e.msg} at char {e.pos})"))
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            out.append(ParsedCall(None, {}, 'tool call must be a JSON object with a string "name"'))
            continue
        args = obj.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                pass
        if not isinstance(args, dict):
            out.append(ParsedCall(obj["name"], {}, '"arguments" must be a JSON object'))
            continue
        out.append(ParsedCall(obj["name"], args))
    return out


def check_arguments(parameters: Mapping[str, Any], arguments: Mapping[str, Any]) -> str | None:
    """Why ``arguments`` do not fit the object schema ``parameters`` (None when they do).

    Checks the subset of JSON Schema tool declarations use: ``required`` keys, no keys outside
    ``properties`` (unless ``additionalProperties`` is true), and each value's ``type``.
    """
    props: Mapping[str, Any] = parameters.get("properties", {}) or {}
    missing = [k for k in parameters.get("required", []) if k not in arguments]
    if missing:
        return f"missing required argument(s) {missing}"
    if not parameters.get("additionalProperties", False):
        extra = sorted(k for k in arguments if k not in props)
        if extra:
            return f"unknown argument(s) {extra}"
    for k, v in arguments.items():
        want = (props.get(k) or {}).get("type")
        types = _JSON_TYPES.get(want) if isinstance(want, str) else None
        if types is not None and (not isinstance(v, types) or (want != "boolean" and isinstance(v, bool))):
            return f"argument {k!r} must be of type {want}, got {type(v).__name__}"
    return None


@dataclasses.dataclass
class ToolEnv:
    """A multi-turn tool environment: a problem per seed, tools the model may call, an answer tag.

    ``problem(seed) -> (statement, answer)`` draws the task. Each policy turn is either a final
    ``<answer>N</answer>`` (done; reward part ``task`` = 1 if ``N == answer`` else 0) or tool calls
    in the ``parser``'s format. Valid calls run and their results, one per line, are the
    observation (reward part ``tool_calls`` +1 each); invalid calls and turns with neither are
    invalid actions (``invalid_actions`` +1, the observation says why). ``use_tools=False``
    declares no tools and refuses calls (the no-tool baseline of the same problems).
    ``max_calls`` bounds calls per episode (more are invalid actions). ``canonical(statement)``, when
    given, names the problem a statement states (:meth:`problem_key`: ``a*b`` and ``b*a`` are one).
    """

    #: the reward parts its steps report (checked against ``reward.weights`` at config load; a part an
    #: episode never reported is 0 in its verdict, e.g. ``tool_calls`` of an episode that answered directly)
    reward_components: ClassVar[tuple[str, ...]] = ("task", "tool_calls", "invalid_actions")
    name: str
    tools: list[Tool]
    problem: Callable[[int], tuple[str, int]]
    parser: str = "hermes"
    use_tools: bool = True
    max_calls: int = 8
    version: str = "1"
    demonstrate: Callable[[int], list[str]] | None = None
    canonical: Callable[[str], str] | None = None
    target: int | None = dataclasses.field(default=None, init=False)
    calls: int = dataclasses.field(default=0, init=False)

    def __post_init__(self) -> None:
        self._parse = TOOL_PARSERS[self.parser]
        self._by_name = {t.name: t for t in self.tools}
        if not self.use_tools:
            self.tools = []

    def reset(self, seed: int) -> str:
        """A new problem from ``seed`` (same seed, same problem)."""
        statement, self.target = self.problem(seed)
        self.calls = 0
        return statement

    def step(self, action_text: str) -> StepResult:
        """Answer -> done with ``task``; tool calls -> their results; else an invalid-action note."""
        if self.target is None:
            raise RuntimeError(f"{self.name}: step() before reset()")
        final = answer_step(action_text, self.target)
        if final is not None:
            return final
        calls = self._parse(action_text)
        if not calls:
            return StepResult("invalid action: no tool call and no <answer>N</answer>", {"invalid_actions": 1.0})
        lines: list[str] = []
        parts = {"tool_calls": 0.0, "invalid_actions": 0.0}
        for c in calls:
            why = self._invalid(c)
            if why is not None:
                parts["invalid_actions"] += 1
                lines.append(f"invalid tool call: {why}")
                continue
            self.calls += 1
            parts["tool_calls"] += 1
            assert c.name is not None
            try:
                lines.append(str(self._by_name[c.name].fn(**c.arguments)))
            except Exception as e:  # noqa: BLE001 - a crashing tool is an observation the model sees
                lines.append(f"tool error: {type(e).__name__}: {e}"[:200])
        return StepResult("\n".join(lines), {k: v for k, v in parts.items() if v})

    def problem_key(self, statement: str) -> str:
        """The problem ``statement`` (a first observation) states: two statements with one key are the same
        problem (the SFT warm-up demonstrates no problem whose key a held-out statement has)."""
        return statement if self.canonical is None else self.canonical(statement)

    def demonstration(self, seed: int) -> list[str]:
        """Assistant turns of a demonstration episode of ``seed`` for the SFT warm-up (``demonstrate``)."""
        if self.demonstrate is None:
            raise ValueError(f"environment {self.name!r} has no demonstrations for an SFT warm-up (sft.steps > 0)")
        return self.demonstrate(seed)

    def _invalid(self, c: ParsedCall) -> str | None:
        if c.error is not None:
            return c.error
        if not self.use_tools:
            return "tools are disabled in this episode"
        if c.name not in self._by_name:
            return f"unknown tool {c.name!r} (tools: {sorted(self._by_name)})"
        if self.calls >= self.max_calls:
            return f"call limit {self.max_calls} reached"
        return check_arguments(self._by_name[c.name].parameters, c.arguments)


def _calculate(expression: str) -> str:
    from posttrain.rewards.countdown import safe_evaluate

    value, _ = safe_evaluate(expression)  # an ExpressionError becomes a "tool error" observation
    return str(value)


CALCULATOR = Tool(
    name="calculator", description="Evaluate an arithmetic expression (+ - * / and parentheses).",
    parameters={"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]},
    fn=_calculate)


def python_tool(wall_s: float = 5.0) -> Tool:
    """A tool running ``code`` in the hardened code sandbox (:func:`posttrain.sandbox.run_python`);
    its stdout (or the sandbox's outcome and reason) is the result."""

    def run(code: str) -> str:
        from posttrain.sandbox import SandboxLimits, run_python

        r = run_python(code, limits=SandboxLimits(wall_s=wall_s, output_bytes=4096))
        if r.outcome == "ok":
            return r.stdout.strip()[:200]
        return f"error: {r.outcome}: {r.reason}"[:200]

    return Tool(name="python", description="Run Python code in a sandbox and return its stdout.",
                parameters={"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]},
                fn=run)


def multiplication_problem(digits: Sequence[int] | int, name: str = "mul") -> Callable[[int], tuple[str, int]]:
    """``seed -> ("Compute a*b.", a*b)`` with ``a`` and ``b`` of ``digits`` decimal digits (an int,
    or ``[d_a, d_b]``); deterministic by seed."""
    da, db = (digits, digits) if isinstance(digits, int) else (int(digits[0]), int(digits[1]))
    if isinstance(digits, bool) or not (isinstance(da, int) and isinstance(db, int)) or da < 1 or db < 1:
        raise ValueError(f"{name}: digits must be an int >= 1 or a pair of them, got {digits!r}")

    def draw(seed: int) -> tuple[str, int]:
        rng = random.Random(f"{name}|{da}|{db}|{seed}")
        a, b = rng.randrange(10 ** (da - 1), 10**da), rng.randrange(10 ** (db - 1), 10**db)
        return f"{a}*{b}=?", a * b

    return draw


def product_key(statement: str) -> str:
    """The problem of a ``"a*b=?"`` statement with its factors sorted (``"7*3=?"`` -> ``"3*7"``): the
    same product whichever operand comes first."""
    return "*".join(sorted(statement.removesuffix("=?").split("*"), key=lambda f: (len(f), f)))


def hermes_call(name: str, **arguments: Any) -> str:
    """A compact Hermes-style call ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}, separators=(",", ":")) + "</tool_call>"


def format_demonstrations(problem: Callable[[int], tuple[str, int]], direct_fraction: float
                          ) -> Callable[[int], list[str]]:
    """Demonstrations that teach the *formats* only, never arithmetic: with probability
    ``direct_fraction`` (by seed) a direct ``<answer>`` holding a wrong guess of the right size,
    else a calculator call on the problem's expression followed by an ``<answer>`` that copies
    the tool's result. Which one pays is left to RL (a direct guess is never right)."""
    if not 0.0 <= direct_fraction <= 1.0:
        raise ValueError(f"direct_fraction must be in [0, 1], got {direct_fraction}")

    def demo(seed: int) -> list[str]:
        statement, target = problem(seed)
        rng = random.Random(f"demo|{seed}")
        if rng.random() < direct_fraction:
            lo, hi = 10 ** (len(str(target)) - 1), 10 ** len(str(target))
            guess = rng.randrange(lo, hi)
            return [f"<answer>{guess if guess != target else guess + 1}</answer>"]
        return [hermes_call("calculator", expression=statement.split("=")[0]), f"<answer>{target}</answer>"]

    return demo


def calculator_tool_env(digits: Sequence[int] | int = 3, parser: str = "hermes", use_tools: bool = True,
                        max_calls: int = 4, demo_direct_fraction: float = 0.5) -> ToolEnv:
    """Multiplication of ``digits``-digit numbers with a ``calculator`` tool (JSON-schema declared);
    SFT demonstrations: :func:`format_demonstrations` with ``demo_direct_fraction``."""
    problem = multiplication_problem(digits, "calculator_tool")
    return ToolEnv("calculator_tool", [CALCULATOR], problem, parser=parser, use_tools=use_tools, max_calls=max_calls,
                   demonstrate=format_demonstrations(problem, demo_direct_fraction), canonical=product_key)


def python_tool_env(digits: Sequence[int] | int = 3, parser: str = "hermes", use_tools: bool = True,
                    max_calls: int = 4, wall_s: float = 5.0) -> ToolEnv:
    """The same problems with a ``python`` tool that runs in the hardened sandbox."""
    return ToolEnv("python_tool_env", [python_tool(wall_s)], multiplication_problem(digits, "python_tool_env"),
                   parser=parser, use_tools=use_tools, max_calls=max_calls)


__all__ = ["CALCULATOR", "TOOL_PARSERS", "ParsedCall", "Tool", "ToolEnv", "calculator_tool_env", "check_arguments",
           "format_demonstrations", "hermes_call",
           "multiplication_problem", "parse_hermes", "product_key", "python_tool", "python_tool_env"]
