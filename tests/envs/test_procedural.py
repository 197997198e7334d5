"""Built-in procedural tasks: deterministic, disjoint splits, difficulty knob, compact prompts,
and the verifier accepts the model-free reference answer."""

import re

import pytest

from posttrain.envs import TASKS
from posttrain.envs.arithmetic import ArithmeticTask
from posttrain.envs.countdown import CountdownTask
from posttrain.envs.linear import LinearTask, render
from posttrain.models import build_char_tokenizer
from posttrain.rewards.countdown import safe_evaluate

BUILTINS = [("arithmetic", {}), ("arithmetic", {"digits": 1, "ops": "+"}), ("countdown", {}),
            ("countdown", {"difficulty": 4}), ("linear", {}), ("linear", {"difficulty": 3})]


@pytest.mark.parametrize("name, kw", BUILTINS)
def test_deterministic_disjoint_and_self_consistent(name, kw):
    task = TASKS[name](**kw)
    a, b = task.examples("train", 50, seed=3), task.examples("train", 50, seed=3)
    assert a == b
    assert task.examples("train", 50, seed=4) != a
    train = {e.prompt for s in range(4) for e in task.examples("train", 100, seed=s)}
    held = {e.prompt for s in range(4) for e in task.examples("heldout", 30, seed=s)}
    assert train.isdisjoint(held)
    tok = build_char_tokenizer()
    for e in a[:20]:
        assert task.verifier.verify(str(e.meta["answer"]), e.reference).correct, e
        assert tok.unk_token_id not in tok(e.prompt).input_ids and len(e.prompt) <= 16


def test_arithmetic_hand_example_and_knobs():
    ex = ArithmeticTask(digits=2, ops="-").examples("train", 30, 0)
    for e in ex:
        a, b = map(int, re.fullmatch(r"(\d+)-(\d+)=", e.prompt).groups())
        assert e.reference == a - b >= 0  # allow_negative=False orders the operands
    assert all(len(e.prompt) <= 4 for e in ArithmeticTask(difficulty=1, ops="+").examples("train", 20, 0))
    assert ArithmeticTask(difficulty=3).digits == 3
    with pytest.raises(ValueError, match="ops"):
        ArithmeticTask(ops="/")


def test_arithmetic_split_does_not_depend_on_the_difficulty():
    # "5+3" drawn at digits=1 and at digits=2 must land in the same split
    d1 = {e.prompt: "train" for e in ArithmeticTask(digits=1, ops="+").examples("train", 60, 0)}
    d1.update({e.prompt: "heldout" for e in ArithmeticTask(digits=1, ops="+").examples("heldout", 10, 0)})
    d2_held = {e.prompt for s in range(30) for e in ArithmeticTask(digits=2, ops="+").examples("heldout", 50, s)}
    assert all(d1[p] == "heldout" for p in d2_held if p in d1)


def test_countdown_prompt_and_reference_solution():
    for e in CountdownTask(difficulty=3).examples("train", 30, 1):
        nums, target = e.prompt[:-1].split(">")
        assert sorted(map(int, nums.split())) == e.reference["numbers"] and int(target) == e.reference["target"]
        value, used = safe_evaluate(str(e.meta["answer"]))
        assert value == e.reference["target"] and sorted(used) == e.reference["numbers"]
    with pytest.raises(ValueError, match="difficulty"):
        CountdownTask(difficulty=9)


def test_linear_render_and_solution():
    assert render(3, 5, 20) == "3x+5=20" and render(1, -4, 2) == "x-4=2" and render(2, 0, 8) == "2x=8"
    for e in LinearTask(difficulty=2).examples("heldout", 20, 0):
        m = re.fullmatch(r"(\d*)x([+-]\d+)?=(-?\d+),x=", e.prompt)
        a, b, c = int(m.group(1) or 1), int(m.group(2) or 0), int(m.group(3))
        assert a * e.reference + b == c
