"""The trainer registry (posttrain/config/trainers.py): ``trainer`` names an entry or is refused in one line
listing them; what the config and the commands read per trainer comes from the entry (hand-written table
below); the dead-settings rules of ``trainer: sft`` and of its keys."""

from __future__ import annotations

from typing import Any

import pytest

from posttrain.cli import main
from posttrain.config import ConfigError, RunConfig, parse_config
from posttrain.config.run import RECORDED
from posttrain.config.trainers import (
    TRAINERS,
    _by_name,
    recorded_trainer,
    trainer_entry,
    trainers_description,
)
from tests._cli_errors import one_error_line

PAIRS = {"data": "pairs.jsonl"}


def test_an_unknown_trainer_is_one_line_listing_the_known_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "grpo", "trainer=dpo", "--print-recipe"]) == 2
    line = one_error_line(capsys)
    assert line.endswith("trainer: unknown trainer 'dpo'; known: rl, preference, reward_model, sft"), line


def test_the_registry_is_the_one_list_of_names() -> None:
    assert list(TRAINERS) == ["rl", "preference", "reward_model", "sft"]
    assert all(name == e.name for name, e in TRAINERS.items())
    for name in TRAINERS:  # every registered name loads
        assert RunConfig.model_validate({"trainer": name}, context=RECORDED).trainer == name


def test_the_field_description_is_the_entries_summaries() -> None:
    desc = RunConfig.model_fields["trainer"].description
    assert desc == trainers_description()
    assert desc is not None and desc.startswith("what trains: rl (the policy on verifiable rewards), preference (")
    assert "sft (supervised fine-tuning on chat / prompt-completion JSONL or Parquet (sft.data), assistant-only " \
           "loss)" in desc


def test_a_name_registered_twice_is_refused() -> None:
    rl = TRAINERS["rl"]
    with pytest.raises(ValueError, match="trainer 'rl' is registered twice"):
        _by_name(rl, TRAINERS["sft"], rl)


# (trainer, config mapping) -> (samples, reads_pairs): what each configuration does, written by hand.
WHAT = [("rl", {}, True, False),
        ("preference", {"preference": PAIRS}, False, True),
        ("preference", {"preference": {"online": True}}, True, False),
        ("reward_model", {"preference": PAIRS}, False, True),
        ("sft", {"sft": {"data": "chats.jsonl"}}, False, False)]


@pytest.mark.parametrize("trainer, data, samples, pairs", WHAT,
                         ids=["rl", "preference_offline", "preference_online", "reward_model", "sft"])
def test_each_entry_says_whether_it_samples_and_reads_pairs(trainer: str, data: dict[str, Any], samples: bool,
                                                            pairs: bool) -> None:
    cfg = RunConfig.model_validate({"trainer": trainer, **data})
    entry = trainer_entry(trainer)
    assert (entry.samples(cfg), entry.reads_pairs(cfg)) == (samples, pairs)
    recorded, view = recorded_trainer({"trainer": trainer, **data}, "run/config.yaml")  # a saved config.yaml
    assert recorded is entry and (entry.samples(view), entry.reads_pairs(view)) == (samples, pairs)


def test_only_the_reward_model_writes_no_policy_and_only_rl_prints_the_rise() -> None:
    assert [n for n, e in TRAINERS.items() if not e.generates] == ["reward_model"]
    assert [n for n, e in TRAINERS.items() if e.heldout_rise] == ["rl"]


def test_every_entry_names_its_checks() -> None:
    assert TRAINERS["sft"].checks == "posttrain.commands.check_sft:sft_checks"
    assert all(e.checks is not None for e in TRAINERS.values())


@pytest.mark.parametrize("data, message", [
    ({"trainer": "reward_model"}, r"trainer=reward_model needs preference.data \(a JSONL or Parquet file of pairs\)$"),
    ({"trainer": "preference"}, r"trainer=preference needs preference.data \(a JSONL or Parquet file of pairs\) or "
     r"preference.online=true$"),
    ({"trainer": "sft"}, "trainer=sft needs sft.data"),
], ids=["reward_model", "preference", "sft"])
def test_each_trainers_config_check_runs_at_load(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_config(data, "recipe.yaml")


def test_a_recorded_config_of_no_known_trainer_names_its_file() -> None:
    assert recorded_trainer({}, "c.yaml")[0] is TRAINERS["rl"]  # an old config.yaml without the key
    with pytest.raises(ValueError, match=r"^run/config.yaml: trainer: unknown trainer 'ppo'; known: rl, "):
        recorded_trainer({"trainer": "ppo"}, "run/config.yaml")


SFT = {"trainer": "sft", "sft": {"data": "chats.jsonl"}}


@pytest.mark.parametrize("data, key", [
    ({**SFT, "sampling": {"group_size": 4}}, "sampling.group_size"),
    ({**SFT, "lora": {"rank": 8}}, "lora.rank"),
    ({**SFT, "preference": PAIRS}, "preference.data"),
    ({**SFT, "task": {"name": "chain_sum"}}, "task.name"),
    ({**SFT, "eval": {"temperature": 0.7}}, "eval.temperature"),
    ({**SFT, "optim": {"ppo_epochs": 2}}, "optim.ppo_epochs"),
    ({"trainer": "sft", "sft": {"data": "c.jsonl", "lr": 0.1}}, "sft.lr"),  # the RL warm-up's; trainer=sft: optim.lr
    ({"trainer": "sft", "sft": {"data": "c.jsonl", "heldout_data": "h.jsonl", "heldout_fraction": 0.2}},
     "sft.heldout_fraction"),
    ({"sft": {"data": "chats.jsonl"}}, "sft.data"),  # trainer=rl: the warm-up trains on the task's answers
    ({"sft": {"packing": True}}, "sft.packing"),
    ({"trainer": "preference", "preference": PAIRS, "sft": {"max_length": 64}}, "sft.max_length"),
    # the warm-up precedes the trainers that sample only: offline preference refuses its keys (was warned)
    ({"trainer": "preference", "preference": PAIRS, "sft": {"lr": 0.01}}, "sft.lr"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_a_key_the_sft_trainer_or_the_others_never_read_is_refused(data: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=rf"recipe.yaml: {key}=.* cannot take effect"):
        parse_config(data, "recipe.yaml")


def test_what_the_sft_trainer_reads_loads_silently(caplog: pytest.LogCaptureFixture) -> None:
    from posttrain.config.dead_settings import check_dead_settings

    cfg = parse_config({**SFT, "steps": 5, "seed": 1, "model": {"path": "builtin:tiny"},
                        "optim": {"lr": 0.01, "microbatch_tokens": 512},
                        "sft": {"data": "c.jsonl", "batch_size": 8, "max_length": 64, "packing": True,
                                "heldout_fraction": 0.2},
                        "task": {"chat_template": "true", "system_prompt": "Be brief."}, "eval": {"every": 2},
                        "logging": {"progress": False}}, "recipe.yaml")
    assert check_dead_settings(cfg) == []  # no warning either (sft.batch_size is the trainer's, not the warm-up's)

