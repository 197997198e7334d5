"""Tool environments: the calculator never evals, the Python tool runs in the sandbox."""

from posttrain.envs.tools import CalculatorEnv, PythonToolEnv
from posttrain.trajectory import Status


def test_calculator_protocol():
    env = CalculatorEnv(digits=2)
    obs = env.reset(3)
    assert obs == CalculatorEnv(digits=2).reset(3) and "<calc>" in obs
    r = env.step("<calc>12*(3+4)</calc>")
    assert r.observation == "84" and r.reward_parts == {"tool_calls": 1.0} and not r.done
    assert env.step("<calc>__import__('os')</calc>").observation.startswith("error:")
    hint = env.step("hmm")
    assert "answer" in hint.observation and hint.reward_parts == {"format": -1.0}
    end = env.step(f"<answer>{env.target}</answer>")
    assert end.done and end.reward_parts == {"task": 1.0} and end.info["status"] is Status.CORRECT


def test_python_tool_runs_in_the_sandbox():
    env = PythonToolEnv(wall_s=1.5)
    assert "<python>" in env.reset(0)
    assert env.step("<python>print(6*7)</python>").observation == "42"
    out = env.step("<python>while True: pass</python>").observation
    assert out.startswith(("error: timeout", "error: cpu_limit")), out
