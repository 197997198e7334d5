"""OpenEnv environments in posttrain: the adapter maps reset / step / reward / done by hand-checked
cases, and examples/openenv_guess (an environment written to OpenEnv's interface) trains from its
recipe through ``posttrain train``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from posttrain.envs.multiturn import Environment
from posttrain.envs.openenv_adapter import OpenEnvAdapter, action_class_of, openenv
from posttrain.trajectory import Ledger, Role

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.openenv_guess.guess import GuessAction, GuessEnv  # noqa: E402

ENV = "examples.openenv_guess.guess:GuessEnv"


def test_reset_step_reward_done() -> None:
    env = openenv(ENV, {"tries": 2})
    assert isinstance(env, Environment) and env.name == "GuessEnv" and env.action_field == "text"
    first = env.reset(seed=3)
    letter = first.removeprefix("say ")
    assert first == f"say {letter}" and len(letter) == 1  # the observation's only text field, "prompt"
    wrong = env.step("?")
    assert (wrong.observation, dict(wrong.reward_parts), wrong.done) == (f"no: say {letter}", {"task": 0.0}, False)
    right = env.step(f"{letter}!")
    assert (right.observation, dict(right.reward_parts), right.done) == ("right", {"task": 1.0}, True)
    env.reset(seed=3)
    env.step("?")
    last = env.step("?")  # the second wrong try ends the episode with reward 0
    assert (dict(last.reward_parts), last.done) == ({"task": 0.0}, True)


def test_action_type_and_fields_are_read_or_refused() -> None:
    assert action_class_of(GuessEnv) is GuessAction

    class TwoTexts(BaseModel):
        a: str
        b: str

    with pytest.raises(ValueError, match="action_field"):
        OpenEnvAdapter(GuessEnv(), TwoTexts)
    with pytest.raises(ValueError, match="no field 'c'"):
        OpenEnvAdapter(GuessEnv(), TwoTexts, action_field="c")
    assert OpenEnvAdapter(GuessEnv(), TwoTexts, action_field="b").action_field == "b"
    with pytest.raises(ValueError, match="openenv env: module 'examples.openenv_guess.guess' has no attribute 'Nope'"):
        openenv("examples.openenv_guess.guess:Nope")
    with pytest.raises(ValueError, match="does not declare its Action"):
        openenv("collections:OrderedDict")


@pytest.mark.timeout(600)
def test_openenv_recipe_trains(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "posttrain.cli", "train", "examples/openenv_guess/recipe.yaml",
                        f"run_dir={tmp_path / 'run'}", "--no-progress"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    trajs = Ledger(tmp_path / "run" / "ledger").read_trajectories()
    assert len(trajs) == 2 * 2 * 4 and {t.verifier for t in trajs} == {"GuessEnv@openenv"}
    versions = {int(v) for t in trajs for v in t.behavior_version.tolist() if v >= 0}
    assert versions == {0, 1}  # step 2 sampled with the weights step 1 trained
    two = [t for t in trajs if t.meta["turns"] == 2]
    assert two, "no episode reached the second try"
    for t in two:  # the hint is an observation between the two policy turns, never trained on
        runs = [r for i, r in enumerate(t.roles) if i == 0 or t.roles[i - 1] is not r]
        assert runs[:4] == [Role.PROMPT, Role.ACTION, Role.OBSERVATION, Role.ACTION]
        assert all(m == (r is Role.ACTION) for m, r in zip(t.action_mask.tolist(), t.roles, strict=True))
