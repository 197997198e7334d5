"""A key the config no longer has (``system.ray.weight_transport``: nothing read it, issue 39): a recipe that sets it
is refused naming it; an older run's ``config.yaml``, which recorded it with every other key, is still read, resumed
and compared as it ran."""

from __future__ import annotations

import pytest
import yaml

from posttrain.config import ConfigError, dump_config, parse_recorded_config
from posttrain.config.ray import REMOVED_KEYS
from posttrain.loop.run_dir import recipe_diff
from posttrain.loop.validate import load_run_config


def test_a_recipe_that_sets_a_removed_key_is_refused_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"system\.ray\.weight_transport was removed: nothing read it") as e:
        load_run_config("grpo", ["system.backend=ray", "system.ray.weight_transport=object_store"])
    assert "\n" not in str(e.value)


def test_an_older_runs_config_yaml_is_read_resumed_and_compared_without_it() -> None:
    cfg = load_run_config("grpo", [])
    new = yaml.safe_load(dump_config(cfg))
    old = yaml.safe_load(dump_config(cfg))
    old["system"]["ray"]["weight_transport"] = "object_store"  # as a run recorded it before the key went
    assert set(REMOVED_KEYS) == {"weight_transport"}
    assert parse_recorded_config(old, "config.yaml") == cfg
    assert recipe_diff(old, cfg.model_dump(mode="json")) == []
    assert recipe_diff(new, cfg.model_dump(mode="json")) == []
