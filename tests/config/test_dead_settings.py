"""No dead settings (issue 22): a key set to a non-default value that cannot take effect in the resolved
config is refused at load with one line naming the key and why, or warned where posttrain/config/dead_settings.py
RULES says so; the same key where it acts loads silently. Environment reward weights are checked at load
against the parts the environment declares."""

from __future__ import annotations

import logging

import pytest
import yaml

from posttrain.config import RECIPES_DIR, ConfigError, dump_config, parse_config
from posttrain.loop.validate import load_run_config
from tests._required_keys import with_required

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))

# (overrides on the all-defaults config, the key the error must name). Each is a key without effect there.
REFUSED = [
    (["system.backend=ray", "system.ray.weight_sync=via_driver"], "system.ray.weight_sync"),  # single learner
    (["loss.kl_target=0.01"], "loss.kl_target"),  # no KL estimator
    (["loss.kl_estimator=k3", "loss.kl_target=0.01"], "loss.kl_target"),  # kl_coef=0: beta stays 0
    (["loss.kl_horizon=10"], "loss.kl_horizon"),  # no KL estimator
    (["loss.kl_estimator=k3", "loss.kl_coef=0.05", "loss.kl_horizon=10"], "loss.kl_horizon"),  # fixed coef
    (["credit.kl_in_reward=true"], "credit.kl_in_reward"),  # no estimator
    (["credit.kl_in_reward=true", "loss.kl_estimator=k1"], "credit.kl_in_reward"),  # coef 0
    (["system.max_queue=16"], "system.max_queue"),  # sync
    (["system.mode=one_step_off", "system.max_queue=16"], "system.max_queue"),  # one_step_off has no queue bound
    (["system.interrupt_on_update=false"], "system.interrupt_on_update"),
    (["system.mode=one_step_off", "system.interrupt_on_update=false"], "system.interrupt_on_update"),
    (["system.queue_timeout_s=30"], "system.queue_timeout_s"),  # sync waits on no queue
    (["system.max_version_span=2"], "system.max_version_span"),  # no partial rollout
    (["system.mode=async", "system.interrupt_on_update=false", "system.max_version_span=2"],
     "system.max_version_span"),  # async without interruption pauses nothing
    (["system.max_staleness=2"], "system.max_staleness"),  # sync, no partial rollout: lag 0
    (["system.ray.num_rollout_workers=3"], "system.ray.num_rollout_workers"),  # backend local
    (["system.backend=ray", "system.ray.cpus_per_learner=2"], "system.ray.cpus_per_learner"),  # embedded learner
    (["system.backend=ray", "system.ray.learner_timeout_s=60"], "system.ray.learner_timeout_s"),
    (["rollout.vllm.kv_cache_gib=2"], "rollout.vllm.kv_cache_gib"),  # engine builtin
    (["rollout.http.timeout_s=5"], "rollout.http.timeout_s"),
    (["learner.device=cpu"], "learner.device"),  # the embedded learner runs in the driver (cpu)
    (["lora.alpha=16"], "lora.alpha"),  # rank 0
    (["lora.target_modules=all-linear"], "lora.target_modules"),
    (["lora.dropout=0.1"], "lora.dropout"),
    (["critic.lr=0.01"], "critic.lr"),  # critic off
    (["critic.shared_backbone=true"], "critic.shared_backbone"),
    (["critic.value_clip=0.5"], "critic.value_clip"),
    (["sampling.max_sampling_rounds=2"], "sampling.max_sampling_rounds"),  # no dynamic sampling
    (["sampling.replay_truncation=false"], "sampling.replay_truncation"),  # the sampler does not truncate
    (["sampling.top_k=8", "sampling.temperature=0", "sampling.replay_truncation=false"], "sampling.replay_truncation"),
    (["sampling.temperature=0", "sampling.top_p=0.9"], "sampling.top_p"),  # greedy decoding
    (["reward.overlong_cache_len=2"], "reward.overlong_cache_len"),  # no overlong_max_len
    # the penalty computed but never weighted: `overlong` recorded, the total unchanged
    (["reward.overlong_max_len=8", "reward.overlong_cache_len=2"], "reward.overlong_max_len"),
    (["reward.weights={task: 1.0, format: 0.5}", "reward.overlong_max_len=8", "reward.overlong_cache_len=2"],
     "reward.overlong_max_len"),
    (["env.max_turns=2"], "env.max_turns"),  # env.name unset
    (["env.kwargs={digits: 2}"], "env.kwargs"),
    (["env.name=calculator_tool", "reward.extract=boxed"], "reward.extract"),  # episodes have no verifier
    (["env.name=calculator_tool", "reward.overlong_max_len=4"], "reward.overlong_max_len"),
    (["model.path=builtin:smollm2-135m-instruct", "model.init_seed=3"], "model.init_seed"),  # loaded weights
    (["env.name=calculator_tool", "reward.timeout_s=5"], "reward.timeout_s"),  # no verifier runs
    (["system.backend=ray", "reward.retries=0"], "reward.retries"),  # the Ray reward actors verify
    (["env.name=calculator_tool", "eval.hidden_verifier=integer"], "eval.hidden_verifier"),
]

# (overrides, the key the warning must name): refusing these would break shipped recipes or common overrides.
WARNED = [
    (["sft.lr=0.01"], "sft.lr"),  # e.g. `posttrain train demo sft.steps=0`
    (["sft.examples=100"], "sft.examples"),
    (["learner.rank_timeout_s=5"], "learner.rank_timeout_s"),  # strategy single: a base recipe's rank bounds
    (["learner.weight_bucket_mb=1"], "learner.weight_bucket_mb"),
    (["env.name=calculator_tool", "task.name=chain_sum"], "task.name"),  # a single-turn recipe + env.name
    (["optim.ppo_epochs=2", "optim.fuse_old_logprob=false"], "optim.fuse_old_logprob"),
    (["reward.weights.format=1.0"], "reward.weights"),  # the override replaced the default {task: 1.0}
]

# The same keys where they act: accepted without a warning.
LIVE = [
    # learner ranks on Ray are placed with the learner keys (posttrain/loop/backends/ray_learner.py)
    ["system.backend=ray", "learner.strategy=fsdp2", "learner.world_size=2", "system.ray.cpus_per_learner=1",
     "system.ray.learner_resources={learner_node: 1}", "system.ray.local_num_cpus=4"],  # 3.25 CPUs reserved
    ["loss.kl_estimator=k3", "loss.kl_coef=0.05", "loss.kl_target=0.01", "loss.kl_horizon=10"],
    ["credit.kl_in_reward=true", "loss.kl_estimator=k1", "loss.kl_coef=0.05"],
    ["system.mode=async", "system.max_queue=16", "system.interrupt_on_update=false", "system.queue_timeout_s=30"],
    ["system.mode=one_step_off", "system.queue_timeout_s=30"],
    ["system.partial_fraction=0.5", "system.max_version_span=2", "system.max_staleness=1"],
    ["system.mode=async", "system.max_version_span=2"],  # an update pauses the running generation
    ["system.backend=ray", "system.ray.num_rollout_workers=3"],
    ["system.backend=ray", "system.ray.num_reward_workers=0", "reward.retries=0", "reward.timeout_s=5"],
    ["eval.hidden_verifier=integer"],
    ["rollout.engine=http", "rollout.http.url=http://127.0.0.1:9", "rollout.http.timeout_s=5"],
    ["learner.strategy=ddp", "learner.world_size=2", "learner.rank_timeout_s=5", "learner.weight_bucket_mb=1"],
    ["lora.rank=4", "lora.alpha=16", "lora.target_modules=all-linear", "lora.dropout=0.1"],
    ["critic.enabled=true", "credit.estimator=gae", "critic.lr=0.01", "critic.value_clip=0.5"],
    ["sampling.dynamic_sampling=true", "sampling.max_sampling_rounds=2"],
    ["sampling.top_k=8", "sampling.replay_truncation=false"],
    ["sampling.temperature=0.7", "sampling.top_p=0.9"],
    ["reward.overlong_max_len=8", "reward.overlong_cache_len=2", "reward.weights={task: 1.0, overlong: 1.0}"],
    ["env.name=calculator_tool", "env.max_turns=2", "env.kwargs={digits: 2}"],
    ["sft.steps=5", "sft.lr=0.01", "sft.examples=100"],
    ["optim.fuse_old_logprob=false"],
    ["model.init_seed=3"],
    ["critic.lr=0.001", "critic.enabled=true", "credit.estimator=gae", "lora.rank=8", "lora.alpha=null"],  # defaults, acting
]


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.parametrize("overrides, key", REFUSED, ids=[k + ":" + ",".join(o) for o, k in REFUSED])
def test_a_set_key_without_effect_is_refused_naming_it(overrides: list[str], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config(None, overrides)
    msg = str(e.value)
    assert "\n" not in msg and f"{key}=" in msg and "cannot take effect" in msg


@pytest.mark.parametrize("overrides, key", WARNED, ids=[k for _, k in WARNED])
def test_a_key_without_effect_that_recipes_commonly_set_is_warned(
        overrides: list[str], key: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        load_run_config(None, overrides)
    hits = [w for w in _warnings(caplog) if f"{key}=" in w]
    assert len(hits) == 1 and "\n" not in hits[0], _warnings(caplog)


@pytest.mark.parametrize("overrides", LIVE, ids=[",".join(o) for o in LIVE])
def test_the_same_keys_where_they_act_load_silently(overrides: list[str], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        load_run_config(None, overrides)
    assert _warnings(caplog) == []


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_and_its_saved_config_load_clean(name: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        cfg = load_run_config(name, with_required(name, ["steps=3"]))  # steps > 0 (the lr=0 warning is another rule)
        # The run's config.yaml lists every key (defaults included): it loads like the recipe that wrote it.
        again = parse_config(yaml.safe_load(dump_config(cfg)), "config.yaml")
    assert _warnings(caplog) == [] and again == cfg


def test_correction_kwargs_without_a_correction_is_still_refused() -> None:
    with pytest.raises(ConfigError, match="correction.kwargs"):
        load_run_config(None, ["correction.kwargs={cap: 2.0}"])


# --------------------------------------------------------------- environment reward weights at load
@pytest.mark.parametrize("env, part", [("calculator_tool", "tool_callz"), ("calculator_tool", "format"),
                                       ("calculator_tags", "invalid_actions")])
def test_env_reward_weight_of_an_undeclared_part_is_refused_at_load(env: str, part: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_run_config(None, [f"env.name={env}", "reward.weights.task=1.0", f"reward.weights.{part}=0.5"])
    assert f"reward.weights.{part}" in str(e.value) and "tool_calls" in str(e.value)  # names the key and the parts


def test_env_reward_weights_of_declared_parts_load() -> None:
    cfg = load_run_config("tool_calc", ["reward.weights.task=1.0", "reward.weights.tool_calls=0.5",
                                    "reward.weights.invalid_actions=-0.1"])
    assert cfg.reward.weights == {"task": 1.0, "tool_calls": 0.5, "invalid_actions": -0.1}
    cfg = load_run_config(None, ["env.name=calculator_tags", "reward.weights={task: 1.0, format: 0.2}"])
    assert cfg.reward.weights == {"task": 1.0, "format": 0.2}


def test_env_kwargs_that_do_not_fit_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match="env.kwargs"):
        load_run_config(None, ["env.name=calculator_tool", "env.kwargs={digitz: 2}"])


# Issue 38 items 5 and 7: a key typed on the command line is what the user asked for, whatever its value.
TYPED_AT_DEFAULT = [
    ("dpo", ["task.name=arithmetic"], "task.name"),  # offline DPO reads preference.data's pairs, not a task
    ("dpo", ["preference.pairs_per_group=one"], "preference.pairs_per_group"),  # no sampled groups
    ("reward_model", ["preference.loss=dpo"], "preference.loss"),
    ("reward_model", ["preference.pairs_per_group=one"], "preference.pairs_per_group"),
    (None, ["critic.lr=0.001"], "critic.lr"),  # no critic is built
]


@pytest.mark.parametrize("recipe, overrides, key", TYPED_AT_DEFAULT,
                         ids=[f"{r}:{k}" for r, _, k in TYPED_AT_DEFAULT])
def test_a_typed_key_without_effect_is_refused_at_its_default_value(recipe: str | None, overrides: list[str],
                                                                     key: str) -> None:
    with pytest.raises(ConfigError, match=rf": {key}=.* cannot take effect: "):
        load_run_config(recipe, overrides)


def test_a_typed_value_that_switches_a_key_off_is_not_refused(caplog: pytest.LogCaptureFixture) -> None:
    """``key=null`` (or false / 0 / empty) typed at the default says what the run does anyway: dropping a recipe's
    shaping or KL target that way is how a user switches it off, never an error."""
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        cfg = load_run_config("smollm2_word_problems", ["reward.weights={task: 1.0}", "reward.overlong_max_len=null",
                                                        "reward.overlong_cache_len=0", "loss.kl_target=null",
                                                        "task.kwargs={}"])
    assert cfg.reward.overlong_max_len is None and _warnings(caplog) == []


def test_a_default_written_in_a_recipe_file_still_loads_silently(tmp_path, caplog: pytest.LogCaptureFixture) -> None:
    """A saved config.yaml lists every key at its value: only what is typed on the command line counts at its
    default (so a recorded run, or a recipe written from one, loads like the recipe that wrote it)."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("critic: {lr: 0.001}\nlora: {alpha: null}\n")
    with caplog.at_level(logging.WARNING, logger="posttrain.config"):
        load_run_config(str(recipe), [])
    assert _warnings(caplog) == []


def test_a_key_a_validator_derived_is_not_named_instead_of_the_typed_one() -> None:
    """``system.mode=async`` on offline DPO: the validator derives ``system.max_staleness=1``; the error names the
    key the user typed, once (it named the derived key first and repeated the reason)."""
    with pytest.raises(ConfigError) as e:
        load_run_config("dpo", ["system.mode=async"])
    msg = str(e.value)
    assert "system.mode='async' cannot take effect: trainer=preference (offline)" in msg, msg
    assert "max_staleness" not in msg and msg.count("cannot take effect") == 1, msg
    # Written by the user, the bound is named too.
    with pytest.raises(ConfigError) as e:
        load_run_config("dpo", ["system.mode=async", "system.max_staleness=2"])
    assert "system.max_staleness=2 cannot take effect" in str(e.value)
