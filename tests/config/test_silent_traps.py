"""Silent traps: settings a trainer accepted that did nothing on its path, refused at load now.

Each case loaded cleanly before its fix (the test failed on the old code) and then ran without the
setting taking effect; now the load fails with one line naming the key and why. The same keys on the
paths where they act still load (the LIVE cases), so each refusal is tied to the path that ignores it.
"""

from __future__ import annotations

import logging

import pytest

from posttrain.config import ConfigError
from posttrain.loop.validate import load_run_config

JUDGE = "reward.judge={url: 'http://127.0.0.1:9'}"
OVERLONG = ["reward.weights={task: 1.0, overlong: 1.0}", "reward.overlong_max_len=3", "reward.overlong_cache_len=1"]

# (recipe, overrides, what the one error line must name)
REFUSED = [
    # The offline preference trainer and the reward-model trainer step a bare optimiser over the model
    # (posttrain/loop/preference_training.py, reward_model_training.py): no activation checkpointing.
    ("dpo", ["optim.gradient_checkpointing=true"], ["optim.gradient_checkpointing=True", "cannot take effect"]),
    ("reward_model", ["optim.gradient_checkpointing=true"], ["optim.gradient_checkpointing=True", "cannot take effect"]),
    # Online preference pairs are chosen by the task verifier's verdict (correct vs wrong); the reward total
    # enters only ODPO's score_diff, so a judge / shaping / extra weight was computed and never used.
    ("dpo_online", [JUDGE], ["reward.judge.url=", "cannot take effect", "preference.loss=odpo"]),
    ("dpo_online", OVERLONG, ["reward.overlong_max_len=3", "cannot take effect"]),
    ("dpo_online", ["reward.weights={task: 1.0, format: 0.5}"], ["reward.weights=", "cannot take effect"]),
    # Greedy sampling draws one response group_size times: every group-relative advantage is 0 (nothing
    # trains: grad_norm 0, every row no-signal) and an online preference group never holds a pair.
    ("grpo", ["sampling.temperature=0"], ["sampling.temperature=0", "sampling.group_size=8", "greedy"]),
    ("dpo_online", ["sampling.temperature=0"], ["sampling.temperature=0", "sampling.group_size=8"]),
    # Only an estimator that reads critic values returns the critic's targets (gae): with grpo / rloo the
    # critic was built, evaluated every step, never trained (no critic/* metric) and never read.
    (None, ["critic.enabled=true"], ["critic.enabled=true", "credit.estimator=grpo", "gae"]),
    (None, ["critic.enabled=true", "credit.estimator=rloo"], ["critic.enabled=true", "credit.estimator=rloo"]),
]

# The same keys where they act: they load without a warning.
LIVE = [
    ("dpo_online", ["optim.gradient_checkpointing=true"]),  # the RL learner's compute settings
    ("grpo", ["optim.gradient_checkpointing=true"]),
    ("dpo_online", ["preference.loss=odpo", JUDGE]),  # ODPO's score_diff is the pair's reward difference
    ("dpo_online", ["preference.loss=odpo", *OVERLONG]),
    ("grpo", [JUDGE]),
    ("ppo", ["sampling.temperature=0"]),
    (None, ["critic.enabled=true", "credit.estimator=gae", "sampling.group_size=1"]),  # group_size 1 (critic + GAE): one greedy sample, nothing repeated
]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("recipe, overrides, names", REFUSED, ids=[f"{r}:{','.join(o)}" for r, o, _ in REFUSED])
def test_a_setting_its_trainer_ignores_is_refused_at_load(recipe: str | None, overrides: list[str], names: list[str]) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config(recipe, overrides)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in names), msg


@pytest.mark.parametrize("recipe, overrides", LIVE, ids=[f"{r}:{','.join(o)}" for r, o in LIVE])
def test_the_same_setting_where_it_acts_loads(recipe: str | None, overrides: list[str],
                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        load_run_config(recipe, overrides)
    assert _warnings(caplog) == []


# ------------------------------------------------------------------ the held-out token budget
# Every training prompt was checked to fit the model's context with sampling.max_new_tokens, but a larger
# eval.max_new_tokens was not: the engine then cut each held-out response at the context, silently.
TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "steps=1"]


def test_an_eval_budget_beyond_the_context_fails_at_load_before_the_run_dir(tmp_path, capsys) -> None:
    from posttrain.cli import main
    from tests._cli_errors import one_error_line

    run_dir = tmp_path / "run"
    recipe = tmp_path / "t.yaml"
    recipe.write_text("name: t\n")
    assert main(["train", str(recipe), *TINY, "eval.max_new_tokens=100000", f"run_dir={run_dir}", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert "eval.max_new_tokens=100000" in line and "context" in line, line
    assert not run_dir.exists()


def test_posttrain_eval_refuses_a_budget_beyond_the_context_as_the_run_does() -> None:
    from posttrain.evaluation.heldout import HeldoutRun
    from posttrain.loop.builders import build_model

    cfg = load_run_config(None, [*TINY, "eval.max_new_tokens=100000"])
    tok, model = build_model(cfg)
    with pytest.raises(ValueError, match=r"eval.max_new_tokens=100000: .*context"):
        HeldoutRun.from_config(cfg, model, tok)
    ok = load_run_config(None, [*TINY, "eval.max_new_tokens=8"])  # room left: builds as before
    HeldoutRun.from_config(ok, model, tok).close()
