"""``word_problems``: English one-step problems whose split follows the arithmetic, not the surface;
answers recomputed from the prompt's own numbers; free-form answers read by ``reward.extract``."""

import re

import pytest

from posttrain.config import RunConfig
from posttrain.envs import TASKS
from posttrain.envs.word_problems import WordProblemsTask, phrase
from posttrain.loop.builders import build_task

_PATTERNS = {
    "add": (r"(\w+) has (\d+) (\w+)\. \1 gets (\d+) more \3\. How many \3 does \1 have now\?", lambda a, b: a + b),
    "sub": (r"(\w+) has (\d+) (\w+)\. \1 gives away (\d+) \3\. How many \3 does \1 have left\?", lambda a, b: a - b),
    "mul": (r"(\w+) has (\d+) boxes with (\d+) (\w+) in each box\. How many \4 does \1 have in total\?",
            lambda a, b: a * b),
}


def _solve(ex):
    op = ex.meta["op"]
    m = re.fullmatch(_PATTERNS[op][0], ex.prompt)
    assert m, ex.prompt
    a, b = (int(m.group(2)), int(m.group(4))) if op != "mul" else (int(m.group(2)), int(m.group(3)))
    return op, a, b, _PATTERNS[op][1](a, b)


def test_answers_follow_from_the_prompt_and_splits_are_disjoint_by_arithmetic():
    task = TASKS["word_problems"]()
    train = task.examples("train", 200, seed=1)
    assert train == task.examples("train", 200, seed=1) and train != task.examples("train", 200, seed=2)
    held = [e for s in range(3) for e in task.examples("heldout", 40, seed=s)]
    arith = {}
    for e in train + held:
        op, a, b, ans = _solve(e)
        assert e.reference == ans == int(e.meta["answer"]) and ans >= 0
        assert 2 <= a <= (9 if op == "mul" else 20) and 2 <= b <= (9 if op == "mul" else 20)
        arith[e.prompt] = (op, a, b)
    assert {arith[e.prompt] for e in train}.isdisjoint({arith[e.prompt] for e in held})
    assert {e.meta["op"] for e in train} == {"add", "sub", "mul"}


def test_knobs_and_bad_input():
    assert {e.meta["op"] for e in WordProblemsTask(ops="mul").examples("train", 30, 0)} == {"mul"}
    assert all(_solve(e)[1] <= 5 for e in WordProblemsTask(ops=["add"], difficulty=5).examples("train", 20, 0))
    with pytest.raises(ValueError, match="ops must be"):
        WordProblemsTask(ops=["div"])
    with pytest.raises(ValueError, match="max_operand"):
        WordProblemsTask(max_operand=2)
    with pytest.raises(ValueError, match="unknown op"):
        phrase("div", 1, 2, "Tom", "apples")


def test_free_form_answers_are_read_as_the_last_number_and_no_number_is_invalid():
    cfg = RunConfig.model_validate({"task": {"name": "word_problems"}, "reward": {"extract": "last_number"}})
    task = build_task(cfg)
    ex = task.examples("heldout", 1, seed=0)[0]
    ans = ex.reference
    good = task.verifier.verify(f"She has {ans + 3} - 3 = {ans} things.\nThe answer is: {ans}", ex.reference)
    wrong = task.verifier.verify(f"The answer is {ans + 1}.", ex.reference)
    none = task.verifier.verify("I cannot tell.", ex.reference)
    assert (good.correct, wrong.correct, none.correct) == (True, False, False)
    assert (good.status.value, wrong.status.value, none.status.value) == ("correct", "wrong", "invalid")


def test_classic_phrasings_are_the_default_and_give_the_sentences_and_split_of_earlier_runs():
    """Recorded from the task before phrasing families existed (issue 24): run dirs evaluate as they trained."""
    from posttrain.envs.task import TaskExample

    task = WordProblemsTask()
    assert task == WordProblemsTask(phrasings="classic") and task.eval_splits == ("heldout",)
    assert task.examples("train", 2, seed=0) == [
        TaskExample("word_problems/add:5:13", "Anna has 5 pencils. Anna gets 13 more pencils. How many pencils does "
                    "Anna have now?", 18, {"answer": "18", "difficulty": 20, "op": "add"}),
        TaskExample("word_problems/mul:4:9", "Mia has 4 boxes with 9 cards in each box. How many cards does Mia have "
                    "in total?", 36, {"answer": "36", "difficulty": 20, "op": "mul"})]
    assert task.examples("heldout", 2, seed=0) == [
        TaskExample("word_problems/add:7:17", "Noah has 7 cards. Noah gets 17 more cards. How many cards does Noah "
                    "have now?", 24, {"answer": "24", "difficulty": 20, "op": "add"}),
        TaskExample("word_problems/sub:18:14", "Zoe has 18 books. Zoe gives away 14 books. How many books does Zoe "
                    "have left?", 4, {"answer": "4", "difficulty": 20, "op": "sub"})]
