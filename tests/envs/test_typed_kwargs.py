"""Task and environment kwargs are validated against the factory's signature before anything is built.

The checks are the registries' own (``posttrain.algos.hyperparameters``: scalars strict, unknown keys
refused with the valid ones listed), so ``task.kwargs`` and ``env.kwargs`` obey the rules of
``loss.kwargs``.
"""

from __future__ import annotations

import dataclasses
import typing

import pytest

from posttrain.envs import TASKS
from posttrain.envs.episodes import build_env_task
from posttrain.envs.typed_kwargs import build_with_typed_kwargs

# The built-in factories that build their dataclass from the kwargs as given (FileTask reads files;
# reasoning_gym forwards to its library).
DATACLASS_TASKS = ["arithmetic", "chain_sum", "countdown", "instruction_following", "letter_run", "linear",
                   "word_problems"]


def test_a_bool_given_as_text_is_refused():
    """``on_topic: "no"`` used to reach the dataclass as a non-empty (truthy) string: the option was on."""
    with pytest.raises(ValueError, match=r"^task\.kwargs\.on_topic: Input should be a valid boolean, got 'no' "
                                         r"\(task 'instruction_following' takes on_topic: bool\)$"):
        TASKS["instruction_following"](on_topic="no")
    assert TASKS["instruction_following"](on_topic=False).on_topic is False


def test_a_fractional_int_is_refused_naming_key_and_type():
    """``train_max_constraints: 2.5`` passed every ``<=`` check."""
    with pytest.raises(ValueError, match=r"task\.kwargs\.train_max_constraints: .*got 2\.5 .*int \| None"):
        TASKS["instruction_following"](train_max_constraints=2.5)


def test_text_for_a_number_and_a_misspelt_literal_are_refused():
    with pytest.raises(ValueError, match=r"task\.kwargs\.max_constraints: .*got '2' \(text, not a number"):
        TASKS["instruction_following"](max_constraints="2")
    with pytest.raises(ValueError, match=r"task\.kwargs\.phrasings: Input should be 'classic' or 'families', "
                                         r"got 'famlies'"):
        TASKS["word_problems"](phrasings="famlies")


def test_an_unknown_key_is_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match=r"task\.kwargs\.bogus: unknown keyword of task 'chain_sum' "
                                         r"\(valid: terms, heldout_fraction, difficulty, verifier, name\)"):
        TASKS["chain_sum"](bogus=1)


def test_containers_and_ints_for_floats_are_converted():
    task = TASKS["word_problems"](ops=["add", "sub"], distractor_rate=0)
    assert task.ops == ("add", "sub") and isinstance(task.distractor_rate, float)


def test_the_task_built_is_the_one_the_plain_constructor_builds():
    """Well-typed kwargs: the same task, prompt for prompt."""
    from posttrain.envs.instruction_following import InstructionFollowingTask

    kw = {"on_topic": True, "max_constraints": 2}
    a, b = TASKS["instruction_following"](**kw), InstructionFollowingTask(**kw)  # type: ignore[arg-type]
    assert a == b
    assert [e.prompt for e in a.examples("heldout_unseen", 5, seed=0)] == [
        e.prompt for e in b.examples("heldout_unseen", 5, seed=0)]


@pytest.mark.parametrize("name", DATACLASS_TASKS)
def test_every_checkable_field_of_every_task_refuses_a_mapping(name):
    """A property over the registry: for each task and each of its typed fields, a mapping (no field's
    type is one) is refused with the field named."""
    cls = typing.get_type_hints(TASKS[name])["return"]
    hints = typing.get_type_hints(cls)
    checked = [f.name for f in dataclasses.fields(cls)
               if f.init and f.name != "verifier" and "Mapping" not in str(hints[f.name])]
    assert checked, name
    for key in checked:
        with pytest.raises(ValueError, match=rf"^task\.kwargs\.{key}: "):
            TASKS[name](**{key: {"not": "a value"}})


def test_environment_kwargs_are_checked_too():
    """``digits: 2.5`` used to fail inside the calculator's first draw; ``use_tools: "no"`` was truthy."""
    with pytest.raises(ValueError, match=r"env\.kwargs\.use_tools: Input should be a valid boolean, got 'no' "
                                         r"\(env 'calculator_tool' takes use_tools: bool\)"):
        build_env_task("calculator_tool", {"use_tools": "no"})
    with pytest.raises(ValueError, match=r"env\.kwargs\.digits: .*got 2\.5"):
        build_env_task("calculator_tool", {"digits": 2.5})
    with pytest.raises(ValueError, match=r"env\.kwargs\.bogus: unknown keyword of env 'python_tags'"):
        build_env_task("python_tags", {"bogus": 1})
    # well-typed kwargs reach the environment as given (they also tag its problem draw)
    assert dict(build_env_task("calculator_tool", {"digits": 3, "demo_direct_fraction": 0.5}).kwargs) == {
        "digits": 3, "demo_direct_fraction": 0.5}


def test_it_calls_any_factory_with_the_validated_values():
    def factory(n: int, scale: float = 1.0) -> tuple[int, float]:
        return n, scale

    assert build_with_typed_kwargs(factory, {"n": 2, "scale": 3}, what="task 'factory'") == (2, 3.0)
    with pytest.raises(ValueError, match=r"task\.kwargs: task 'factory' needs n"):
        build_with_typed_kwargs(factory, {}, what="task 'factory'")
