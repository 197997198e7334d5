"""OpenEnv settings a real observation refutes, and an empty environment split, are refused in one line
before the run directory is written (issue 38, item 4).

A wrong ``env.kwargs.observation_field`` used to pass preflight and surface at step 1 as every episode's
env_failure, after the run directory and a checkpoint were written (so the corrected command was then
refused: "already holds a run"). Preflight now resets one environment and renders its first observation.
An environment none of whose first observations hashes into held-out used to stop with "no problem of split
'heldout' found; widen the difficulty", naming neither the environment nor ``env.heldout_fraction``.

The ten first observations of ``GuessEnv`` are ``say a`` .. ``say j``; an episode is held out iff
``sha256('GuessEnv|' + observation)``'s first 8 bytes mod 10^6 < ``heldout_fraction * 10^6``. Those ten
values, worked out once by hand with hashlib, are 385 (``say a``), 29538 (e), 143485 (i), 342789 (j),
368568 (f), 413340 (b), 527613 (g), 749919 (c), 829532 (h), 891103 (d): at 0.0003 (300) none is held
out, at 0.0004 (400) only ``say a``, at 0.9 (900000) all ten.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from posttrain.cli import main
from posttrain.envs.episodes import build_env_task
from posttrain.envs.openenv_adapter import OpenEnvAdapter
from posttrain.errors import ConfigError
from tests._cli_errors import one_error_line

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from examples.openenv_guess.guess import GuessAction, GuessEnv  # noqa: E402

RECIPE = str(ROOT / "examples" / "openenv_guess" / "recipe.yaml")
Capture = pytest.CaptureFixture[str]
FACTORY = "posttrain.envs.openenv_adapter:openenv"
ENV = "examples.openenv_guess.guess:GuessEnv"
FIELD_ERROR = ("env.kwargs.observation_field='promt': the observation of OpenEnv environment 'GuessEnv' "
               "(examples.openenv_guess.guess:GuessEnv), a GuessObservation, has no such field; its fields: "
               "done, metadata, prompt, reward")


def test_a_wrong_observation_field_names_the_key_the_fields_and_the_env() -> None:
    with pytest.raises(ConfigError) as e:
        OpenEnvAdapter(GuessEnv(), GuessAction, observation_field="promt").reset(3)
    assert str(e.value) == FIELD_ERROR
    assert OpenEnvAdapter(GuessEnv(), GuessAction, observation_field="done").reset(3) == "False"

    class NotPydantic:  # returns plain dicts
        def reset(self, seed: int | None = None, episode_id: str | None = None, **kw: Any) -> Any:
            return {"prompt": "say a"}

        def step(self, action: Any, timeout_s: float | None = None, **kw: Any) -> Any:
            return {"prompt": "right"}

    with pytest.raises(ConfigError, match=r"^env\.kwargs\.env: OpenEnv environment 'NotPydantic' .* "
                                          r"returned a dict, not a pydantic Observation"):
        OpenEnvAdapter(NotPydantic(), GuessAction).reset(3)


def test_a_wrong_observation_field_is_refused_before_the_run_dir(tmp_path: Path, capsys: Capture) -> None:
    run_dir = tmp_path / "run"
    argv = ["train", RECIPE, f"run_dir={run_dir}"]
    assert main([*argv, "env.kwargs.observation_field=promt", "--no-progress"]) == 2
    line = one_error_line(capsys)
    prefix = f"posttrain train: error: env.name={FACTORY}: the first observation (reset(seed="
    assert line.startswith(prefix), line
    assert line.endswith(FIELD_ERROR), line
    assert not run_dir.exists()
    # the corrected command is not refused (preflight passes; --print-recipe writes nothing either)
    assert main([*argv, "env.kwargs.observation_field=prompt", "--print-recipe"]) == 0
    assert not run_dir.exists()


def test_an_empty_heldout_split_names_the_env_and_heldout_fraction() -> None:
    with pytest.raises(ValueError) as e:
        build_env_task(FACTORY, {"env": ENV}, heldout_fraction=0.0003).examples("heldout", 4, seed=0)
    # 800 resets: 200 tries per example x 4 examples (posttrain.envs.task.sample_unique)
    assert str(e.value) == (
        f"env.name={FACTORY}: environment 'GuessEnv' has no episode of split 'heldout': none of the 10 "
        "distinct first observations of 800 resets are held out at env.heldout_fraction=0.0003 (an episode "
        "is held out iff sha256('GuessEnv|' + its first observation)[:8] mod 10^6 < env.heldout_fraction "
        "* 10^6); raise env.heldout_fraction, or make the environment's first observations more varied (its "
        "name is hashed with them)")
    held = build_env_task(FACTORY, {"env": ENV}, heldout_fraction=0.0004).examples("heldout", 2, seed=0)
    assert [ex.prompt for ex in held] == ["say a", "say a"]  # only 'say a' (385 < 400), repeated to fill 2
    with pytest.raises(ValueError, match=r"no episode of split 'train': all of the 10 distinct first "
                                         r"observations of 200 resets are held out at "
                                         r"env\.heldout_fraction=0\.9 .*; lower env\.heldout_fraction$"):
        build_env_task(FACTORY, {"env": ENV}, heldout_fraction=0.9).examples("train", 1, seed=0)


def test_an_empty_heldout_split_stops_the_cli_without_a_run_dir(tmp_path: Path, capsys: Capture) -> None:
    run_dir = tmp_path / "run"
    assert main(["train", RECIPE, f"run_dir={run_dir}", "env.heldout_fraction=0.0003", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert f"env.name={FACTORY}: environment 'GuessEnv' has no episode of split 'heldout'" in line, line
    assert "env.heldout_fraction=0.0003" in line and "raise env.heldout_fraction" in line, line
    assert not run_dir.exists()
