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
    # Online preference steps have no advantages, no behaviour-vs-learner log-prob check and no entropy: the
    # guards on them read metrics that step never logs, so they never fired.
    ("dpo_online", ["guards.min_entropy=0.5"], ["guards.min_entropy=0.5", "cannot take effect"]),
    ("dpo_online", ["guards.max_abs_log_kappa=0.5"], ["guards.max_abs_log_kappa=0.5", "cannot take effect"]),
    ("dpo_online", ["guards.max_zero_adv_fraction=0.5"], ["guards.max_zero_adv_fraction=0.5", "cannot take effect"]),
    # The Ray rollout workers have no sleep hook: every update logged "keeps its memory" and went on.
    (None, ["system.backend=ray", "system.engine_sleep=true"], ["system.engine_sleep=True", "cannot take effect"]),
    # Episodes score themselves (learned rewards are scored in the driver): the Ray reward actors were
    # started and never called; without reward actors their settings had nothing to set.
    (None, ["system.backend=ray", "env.name=calculator_tool", "system.ray.num_reward_workers=2"],
     ["system.ray.num_reward_workers=2", "env.name"]),
    (None, ["system.backend=ray", "env.name=calculator_tool", "system.ray.verify_retries=3"],
     ["system.ray.verify_retries=3", "env.name"]),
    (None, ["system.backend=ray", "system.ray.num_reward_workers=0", "system.ray.verify_timeout_s=5"],
     ["system.ray.verify_timeout_s=5", "num_reward_workers=0"]),
    (None, ["system.backend=ray", "system.ray.num_reward_workers=0", "system.ray.cpus_per_reward_worker=1"],
     ["system.ray.cpus_per_reward_worker=1", "num_reward_workers=0"]),
    # An environment without a use_tools switch: the run wrote config.yaml and metrics.jsonl, then its step-0
    # evaluation failed blaming env.kwargs.
    (None, ["env.name=calculator_tags", "env.eval_without_tools=true"],
     ["env.eval_without_tools=true", "calculator_tags", "use_tools"]),
    # The tool prompt renders an environment's tool schemas: an environment without tools has none to render.
    (None, ["env.name=calculator_tags", "env.tool_prompt=preamble"], ["env.tool_prompt=preamble", "calculator_tags"]),
    # Adapter dropout breaks checkpointing's recompute (pi_theta != pi_old): it passed --print-recipe and failed
    # while the learner was built, naming peft's module paths instead of the keys.
    (None, ["lora.rank=4", "lora.dropout=0.1", "optim.gradient_checkpointing=true"],
     ["lora.dropout=0.1", "optim.gradient_checkpointing=true"]),
    # resume_force is read only by a resume=true (the recipe against config.yaml): alone it did nothing.
    (None, ["resume_force=true"], ["resume_force=True", "resume is not true"]),
]

# The same keys where they act: they load without a warning.
LIVE = [
    ("dpo_online", ["optim.gradient_checkpointing=true"]),  # the RL learner's compute settings
    ("grpo", ["optim.gradient_checkpointing=true"]),
    ("dpo_online", ["preference.loss=odpo", JUDGE]),  # ODPO's score_diff is the pair's reward difference
    ("dpo_online", ["preference.loss=odpo", *OVERLONG]),
    ("grpo", [JUDGE]),
    ("ppo", ["sampling.temperature=0"]),
    (None, ["critic.enabled=true", "credit.estimator=gae", "sampling.group_size=1"]),
    ("dpo_online", ["guards.min_response_length=2", "guards.max_truncation_rate=0.5"]),  # lengths are logged
    ("grpo", ["guards.min_entropy=0.5", "guards.max_zero_adv_fraction=0.5"]),
    (None, ["system.backend=ray", "system.ray.num_reward_workers=2", "system.ray.verify_retries=3",
            "system.ray.verify_timeout_s=5", "system.ray.cpus_per_reward_worker=1",  # single-turn: they verify
            "system.ray.local_num_cpus=4"]),  # 2 x 0.5 + 2 x 1 = 3 CPUs reserved
    (None, ["env.name=calculator_tool", "env.eval_without_tools=true"]),  # it has the switch
    (None, ["env.name=calculator_tool", "env.tool_prompt=preamble"]),  # it has tools
    (None, ["lora.rank=4", "lora.dropout=0.1"]),  # dropout without checkpointing
    (None, ["lora.rank=4", "optim.gradient_checkpointing=true"]),
    (None, ["system.engine_sleep=true"]),  # the built-in engine frees its weights during each update
    (None, ["system.engine_sleep=true", "rollout.process=server"]),  # over HTTP, the server engine's hook  # group_size 1 (critic + GAE): one greedy sample, nothing repeated
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


# ------------------------------------------------------------------ the sampled held-out evaluation's sampler
class _Recording:
    """An engine that records every request's sampling parameters and lets the built-in engine answer."""

    def __init__(self, engine) -> None:
        self.engine, self.params = engine, []

    def generate(self, requests, *, finish_target=None):
        self.params += [r.params for r in requests]
        return self.engine.generate(requests, finish_target=finish_target)

    def __getattr__(self, name):
        return getattr(self.engine, name)


@pytest.mark.parametrize("episodes", [False, True], ids=["single_turn", "episodes"])
def test_a_sampled_evaluation_draws_from_the_runs_truncated_sampler_on_every_path(episodes: bool) -> None:
    # Episodes were evaluated with sampling.top_k / top_p (the turn sampler), single-turn prompts without
    # them (the full softmax at eval.sampled_temperature): one config, two samplers, by path.
    import dataclasses

    from posttrain.evaluation.heldout import HeldoutRun
    from posttrain.loop.builders import build_model
    from posttrain.loop.heldout import evaluate_run

    base = (["env.name=calculator_tool", "env.kwargs={digits: 2}", "env.tool_prompt=none", "env.max_tokens=240",
             "env.max_turns=1", "model.path=builtin:micro", "eval.size=2", "sampling.max_new_tokens=2"] if episodes
            else [*TINY, "eval.size=2"])
    cfg = load_run_config(None, [*base, "sampling.top_k=5", "sampling.top_p=0.9", "eval.sampled_temperature=0.8"])
    tok, model = build_model(cfg)
    hr = HeldoutRun.from_config(cfg, model, tok)
    rec = _Recording(hr.engine)
    try:
        evaluate_run(dataclasses.replace(hr, engine=rec), cfg.eval.sampled_temperature)
        greedy = len(rec.params)
        evaluate_run(dataclasses.replace(hr, engine=rec))  # eval.temperature=0: greedy, truncation moot
    finally:
        hr.close()
    sampled = rec.params[:greedy]
    assert sampled and all((p.temperature, p.top_k, p.top_p) == (0.8, 5, 0.9) for p in sampled), sampled[0]
    assert all(p.temperature == 0.0 for p in rec.params[greedy:])


def test_an_online_preference_step_logs_the_lengths_its_guards_read(tmp_path) -> None:
    # guards.min_response_length / max_truncation_rate read length/mean and finish/truncated_rate, which the
    # online preference step did not log: a collapse or a blow-up of the sampled responses went unseen.
    import json

    from posttrain.cli import main

    run_dir = tmp_path / "online"
    assert main(["train", "dpo_online", "model.path=builtin:micro", "sft.steps=0", "steps=1", "eval.size=4",
                 "sampling.prompts_per_step=2", "sampling.group_size=2", "guards.min_response_length=1000",
                 f"run_dir={run_dir}", "--no-progress"]) == 0
    (row,) = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1]
    assert 1 <= row["length/mean"] <= 4 and 0 <= row["finish/truncated_rate"] <= 1  # max_new_tokens=4
    assert "response-length collapse" in row["guards"]
