"""Task kwargs are validated against the task's dataclass fields before the task is built."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from posttrain.envs import TASKS
from posttrain.envs.typed_kwargs import build_with_typed_kwargs

# The factories that build their dataclass from the kwargs as given (FileTask's read files; reasoning_gym
# forwards to its library).
DATACLASS_TASKS = ["arithmetic", "chain_sum", "countdown", "instruction_following", "letter_run", "linear",
                   "word_problems"]


def test_a_bool_given_as_text_means_what_it_says():
    """``on_topic: "no"`` used to reach the dataclass as a non-empty (truthy) string: the option was on."""
    assert TASKS["instruction_following"](on_topic="no").on_topic is False
    assert TASKS["instruction_following"](on_topic="true").on_topic is True
    with pytest.raises(ValueError, match=r"task\.kwargs\.on_topic='maybe'.*InstructionFollowingTask\.on_topic \(bool\)"):
        TASKS["instruction_following"](on_topic="maybe")


def test_a_fractional_int_is_refused_naming_key_and_type():
    """``train_max_constraints: 2.5`` passed every ``<=`` check and capped nothing an int would."""
    with pytest.raises(ValueError, match=r"task\.kwargs\.train_max_constraints=2\.5 .*\(int \| None\).*fractional"):
        TASKS["instruction_following"](train_max_constraints=2.5)


def test_values_are_coerced_as_the_run_config_coerces_them():
    task = TASKS["instruction_following"](max_constraints="2", families=["no_commas", "title"])
    assert task.max_constraints == 2 and task.families == ("no_commas", "title")
    with pytest.raises(ValueError, match=r"task\.kwargs\.phrasings='famlies'.*'classic' or 'families'"):
        TASKS["word_problems"](phrasings="famlies")


def test_an_unknown_key_still_reaches_the_dataclass():
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        TASKS["chain_sum"](bogus=1)


def test_the_task_built_is_the_one_the_plain_constructor_builds():
    """Well-typed kwargs: the same task, prompt for prompt."""
    from posttrain.envs.instruction_following import InstructionFollowingTask

    kw = {"on_topic": True, "max_constraints": 2}
    a, b = TASKS["instruction_following"](**kw), InstructionFollowingTask(**kw)  # type: ignore[arg-type]
    assert a == b
    assert [e.prompt for e in a.examples("heldout_unseen", 5, seed=0)] == [
        e.prompt for e in b.examples("heldout_unseen", 5, seed=0)]


@pytest.mark.parametrize("name", DATACLASS_TASKS)
def test_every_checkable_field_of_every_task_refuses_a_dict(name):
    """A property over the registry: for each task and each of its typed fields, a mapping (no field's type
    is one) is refused with the field named; fields holding objects (the verifier) are not checked."""
    cls = typing.get_type_hints(TASKS[name])["return"]
    hints = typing.get_type_hints(cls)
    checked = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name != "verifier" and "Mapping" not in str(hints[f.name])]
    assert checked, name
    for key in checked:
        with pytest.raises(ValueError, match=rf"task\.kwargs\.{key}="):
            TASKS[name](**{key: {"not": "a value"}})


def test_it_needs_a_dataclass():
    with pytest.raises(TypeError, match="needs a dataclass"):
        build_with_typed_kwargs(dict, {})  # type: ignore[type-var]
