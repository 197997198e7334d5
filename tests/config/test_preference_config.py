"""The preference section and trainer key: defaults, refusals of keys that cannot take effect, required data."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from posttrain.algos import PREFERENCE_LOSSES
from posttrain.config import RunConfig
from posttrain.config.preference import PREFERENCE_LOSS_NAMES


def _cfg(**kw: object) -> RunConfig:
    return RunConfig.model_validate(kw)


def test_loss_names_are_the_registry() -> None:
    assert set(PREFERENCE_LOSS_NAMES) == set(PREFERENCE_LOSSES)


def test_defaults_keep_today_rl() -> None:
    cfg = RunConfig()
    assert cfg.trainer == "rl"
    assert cfg.preference.loss == "dpo" and cfg.preference.data is None and not cfg.preference.online


def test_preference_key_refused_with_rl_trainer() -> None:
    with pytest.raises(ValidationError, match=r"preference.loss='ipo' cannot take effect: trainer=rl"):
        _cfg(preference={"loss": "ipo"})
    with pytest.raises(ValidationError, match=r"preference.online=True cannot take effect: trainer=rl"):
        _cfg(preference={"online": True})


def test_offline_needs_data() -> None:
    with pytest.raises(ValidationError, match="trainer=preference needs preference.data"):
        _cfg(trainer="preference")
    _cfg(trainer="preference", preference={"data": "pairs.jsonl", "loss": "ipo", "kwargs": {"tau": 0.5}})


@pytest.mark.parametrize("override", [{"sampling": {"group_size": 4}}, {"loss": {"policy_loss": "cispo"}},
                                      {"task": {"name": "countdown"}}, {"lora": {"rank": 4}},
                                      {"preference": {"data": "p.jsonl", "pairs_per_group": "all"}}])
def test_offline_refuses_rl_keys(override: dict[str, dict[str, object]]) -> None:
    kw: dict[str, object] = {"trainer": "preference", "preference": {"data": "p.jsonl"}, **override}
    with pytest.raises(ValidationError, match="cannot take effect"):
        _cfg(**kw)


def test_offline_keeps_chat_template_keys() -> None:
    cfg = _cfg(trainer="preference", preference={"data": "p.jsonl"}, task={"system_prompt": "Be brief."})
    assert cfg.task.system_prompt == "Be brief."


def test_online_refuses_offline_keys_and_keeps_sampling() -> None:
    _cfg(trainer="preference", preference={"online": True, "pairs_per_group": "all"}, sampling={"group_size": 4})
    with pytest.raises(ValidationError, match=r"preference.data='p.jsonl' cannot take effect: preference.online=true"):
        _cfg(trainer="preference", preference={"online": True, "data": "p.jsonl"})
    with pytest.raises(ValidationError, match=r"credit.estimator='rloo' cannot take effect"):
        _cfg(trainer="preference", preference={"online": True}, credit={"estimator": "rloo"})


def test_reward_model_reads_data_but_not_the_loss() -> None:
    _cfg(trainer="reward_model", preference={"data": "p.jsonl", "batch_size": 4, "max_length": 64,
                                                  "heldout_fraction": 0.2})
    with pytest.raises(ValidationError, match=r"preference.loss='ipo' cannot take effect: trainer=reward_model"):
        _cfg(trainer="reward_model", preference={"data": "p.jsonl", "loss": "ipo"})


def test_bad_values_refused() -> None:
    with pytest.raises(ValidationError, match="preference.fields: unknown key"):
        _cfg(trainer="preference", preference={"data": "p.jsonl", "fields": {"answer": "a"}})
    with pytest.raises(ValidationError, match="prompt or messages, not both"):
        _cfg(trainer="preference", preference={"data": "p.jsonl", "fields": {"prompt": "a", "messages": "m"}})
    with pytest.raises(ValidationError, match="loss"):
        _cfg(trainer="preference", preference={"data": "p.jsonl", "loss": "ppo"})
    with pytest.raises(ValidationError, match="unknown trainer 'dpo'"):
        _cfg(trainer="dpo")
