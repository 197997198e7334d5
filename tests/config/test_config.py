"""Recipe loading: every shipped recipe validates; bad keys and types name the key."""

import pytest

from posttrain.config import RECIPES_DIR, ConfigError, apply_overrides
from posttrain.loop.validate import load_run_config
from tests._required_keys import with_required

SHIPPED = sorted(p.stem for p in RECIPES_DIR.glob("*.yaml"))


def test_required_recipes_are_shipped():
    assert {"grpo", "dapo", "dr_grpo", "rloo", "reinforce_pp", "gspo", "cispo", "ppo", "demo"} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_validates_and_names_six_axes(name):
    cfg = load_run_config(name, with_required(name, []))
    assert set(cfg.axes()) == {"feedback", "sampling", "credit", "correction", "reduction", "system"}


def test_dapo_is_what_dapo_says():
    cfg = load_run_config("dapo")
    assert cfg.loss.kwargs["eps_high"] > cfg.loss.kwargs["eps_low"]  # clip-higher
    assert cfg.sampling.dynamic_sampling and cfg.loss.reduction == "token_mean"
    assert cfg.reward.overlong_max_len is not None and cfg.loss.kl_coef == 0.0


def test_overrides_are_typed_yaml_scalars():
    cfg = load_run_config("grpo", ["optim.lr=3e-4", "steps=7", "sampling.dynamic_sampling=true", "name=x"])
    assert cfg.optim.lr == 3e-4 and cfg.steps == 7 and cfg.sampling.dynamic_sampling is True
    assert apply_overrides({}, ["a.b.c=1"]) == {"a": {"b": {"c": 1}}}


@pytest.mark.parametrize(
    "override, needle",
    [
        ("optim.lrr=1", "optim.lrr: unknown key"),
        ("optim.lr=fast", "optim.lr"),
        ("sampling.top_p=1.5", "sampling.top_p"),
        ("credit.estimator=nope", "credit.estimator: unknown advantage estimator 'nope'"),
        ("loss.reduction=mean", "unknown loss reduction"),
        ("bogus=1", "bogus: unknown key"),
    ],
)
def test_bad_keys_and_values_name_the_key(override, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")):
        load_run_config("grpo", [override])


def test_cross_field_rules():
    with pytest.raises(ConfigError, match="needs critic.enabled"):
        load_run_config("grpo", ["credit.estimator=gae"])
    with pytest.raises(ConfigError, match="group_size >= 2"):
        load_run_config("grpo", ["sampling.group_size=1"])
    with pytest.raises(ConfigError, match="not found"):
        load_run_config("no_such_recipe")
    with pytest.raises(ConfigError, match="not key=value"):
        load_run_config("grpo", ["steps"])
