"""docs/trainers.md's per-trainer table is the one posttrain.config.trainer_keys generates from RULES, and the
table says what loading does: each refused key, typed on the command line for its trainer, is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.config import ConfigError
from posttrain.config.trainer_keys import trainer_keys, trainer_keys_markdown
from posttrain.loop.validate import load_run_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
BEGIN, END = "<!-- generated: python -m posttrain.config.trainer_keys -->\n", "<!-- end generated -->"


def test_the_docs_table_is_the_generated_one() -> None:
    text = DOC.read_text()
    table = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert table == trainer_keys_markdown(), "regenerate: python -m posttrain.config.trainer_keys"


# (recipe, a key its table refuses, a value): typed for that trainer, loading refuses it naming the key.
CASES = [("dpo", "sampling.group_size", "4"), ("dpo", "task.kwargs", "{terms: 2}"), ("dpo_online", "preference.data", "x"),
         ("dpo_online", "lora.rank", "8"), ("reward_model", "preference.loss", "ipo"),
         ("reward_model", "task.system_prompt", "hi"), ("grpo", "preference.batch_size", "8"),
         ("sft", "sampling.group_size", "4"), ("sft", "task.name", "chain_sum"), ("sft", "lora.rank", "8"),
         ("grpo", "sft.data", "x.jsonl"), ("dpo", "sft.packing", "true"), ("sft", "eval.heldout_seed", "0"),
         ("reward_model", "eval.heldout_seed", "0")]


@pytest.mark.parametrize("recipe, key, value", CASES, ids=[f"{r}:{k}" for r, k, _ in CASES])
def test_a_key_the_table_refuses_is_refused_at_load(recipe: str, key: str, value: str) -> None:
    trainer = {"dpo": "preference_offline", "dpo_online": "preference_online", "reward_model": "reward_model",
               "grpo": "rl", "sft": "sft"}[recipe]
    rules = trainer_keys(trainer).refused
    assert any(key == k or key.startswith(k + ".") for r in rules for k in r.keys), (trainer, key)
    with pytest.raises(ConfigError, match=rf"{key}=.* cannot take effect"):
        load_run_config(recipe, [f"{key}={value}"])


def test_every_registered_trainer_has_a_table() -> None:
    from posttrain.config.trainers import TRAINERS

    titles = [t.title for t in map(trainer_keys, ["rl", "preference_offline", "reward_model", "sft"])]
    assert titles[-1] == "`trainer: sft` (`sft`)" and len(set(titles)) == 4
    assert {k for r in trainer_keys("sft").refused for k in r.keys} >= {"sampling", "reward", "preference", "lora"}
    assert "sft" in trainer_keys("sft").reads and "optim" in trainer_keys("sft").reads
    assert {x.key for e in TRAINERS.values() for x in e.examples} == {
        "rl", "distill", "preference_offline", "preference_online", "reward_model", "sft"}


def test_distillation_alone_lists_the_reward_shaping() -> None:
    keys = {k for r in trainer_keys("distill").refused for k in r.keys}
    assert {"reward.weights", "reward.overlong_max_len", "credit.estimator", "preference"} <= keys
    assert "preference" not in trainer_keys("distill").reads and "reward" in trainer_keys("distill").reads
