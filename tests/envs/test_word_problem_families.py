"""``word_problems`` with ``phrasings="families"``: every family says its arithmetic (the numbers read back from
the text give the answer), hand examples, irrelevant sentences that cannot be part of the problem, and
the three splits disjoint by phrasing family and by arithmetic (a property over seeds)."""

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from posttrain.config import RunConfig
from posttrain.envs import TASKS
from posttrain.envs.task import split_of
from posttrain.envs.word_problem_families import FAMILIES, Family
from posttrain.envs.word_problem_phrasings import DISTRACTORS, Person, fill, heldout_families, render
from posttrain.envs.word_problems import WordProblemsTask
from posttrain.loop.builders import build_task

_SOLVE = {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b}
_MIA, _TOM = Person("Mia", "she", "her", "her"), Person("Tom", "he", "him", "his")


def _numbers(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def _family(family_id: str) -> Family:
    return next(f for fams in FAMILIES.values() for f in fams if f.id == family_id)


def _operands(prompt_id: str) -> tuple[str, int, int, str]:
    """``word_problems/add:3:8/add07`` -> ``("add", 3, 8, "add07")``."""
    _, pair, fam = prompt_id.split("/")
    op, a, b = pair.split(":")
    return op, int(a), int(b), fam


def test_twenty_or_more_families_per_operation_with_unique_ids_and_items_where_used() -> None:
    ids = [f.id for fams in FAMILIES.values() for f in fams]
    assert len(ids) == len(set(ids))
    for op, fams in FAMILIES.items():
        assert len(fams) >= 20 and all(f.op == op and f.id.startswith(op) for f in fams)
        for f in fams:
            assert bool(f.items) == any("{item}" in s for s in f.sentences), f.id
            text = " ".join(f.sentences)
            assert "{a}" in text and "{b}" in text and not re.search(r"\d", re.sub(r"\{\w+\}", "", text))


@pytest.mark.parametrize("op", ["add", "sub", "mul"])
def test_every_family_renders_its_operands_and_nothing_else_and_a_distractor_is_never_the_answer(op: str) -> None:
    rng = random.Random(0)
    hi = 9 if op == "mul" else 20
    for fam in FAMILIES[op]:
        for a, b in ((2, 2), (hi, 2), (7, 5), (hi, hi)):
            plain = render(fam, a, b, rng)
            assert sorted(_numbers(plain)) == sorted([a, b]), plain
            assert "{" not in plain and "}" not in plain and (plain[0].isupper() or plain[0].isdigit())
            assert plain.endswith(("?", ".")) and "  " not in plain
            noisy = render(fam, a, b, rng, distractor_rate=1.0)
            nums = _numbers(noisy)
            assert len(nums) == 3 and sorted(nums) != sorted([a, b]), noisy
            for x in (a, b):
                nums.remove(x)
            assert nums[0] not in (a, b, _SOLVE[op](a, b)) and 2 <= nums[0] <= 20, noisy
            last = re.split(r"(?<=[.?]) ", noisy)[-1]  # the family's last sentence still ends the problem
            assert not any(word in last for _, word in DISTRACTORS), noisy


def test_distractor_words_occur_in_no_family() -> None:
    family_text = " ".join(s for fams in FAMILIES.values() for f in fams for s in f.sentences).lower()
    for sentence, word in DISTRACTORS:
        assert word in sentence and word not in family_text, word


def test_hand_examples() -> None:
    def said(family_id: str, a: int, b: int, item: str = "") -> str:
        return " ".join(fill(_family(family_id), a, b, _MIA, _TOM, item))

    assert said("add24", 9, 4, "marbles") == \
        "Mia has 9 marbles. Tom has 4 more marbles than Mia. How many marbles does Tom have?"  # 13
    assert said("add06", 3, 8, "cards") == "How many cards are there in all if Mia has 3 cards and Tom has 8 cards?"
    assert said("sub10", 9, 4, "shells") == "Tom has 9 shells and Mia has 4 shells. How many more shells does Tom have than Mia?"
    assert said("sub12", 9, 4, "coins") == \
        "Find the number of coins left when 4 coins are taken away from a pile of 9 coins."  # 5
    assert said("mul03", 9, 4) == "Mia reads 4 pages every day. How many pages does she read in 9 days?"  # 36
    assert said("mul21", 3, 6, "eggs") == \
        "A farmer puts 6 eggs in each basket and fills 3 baskets. How many eggs did the farmer put in the baskets?"
    assert said("sub01", 8, 3, "beads") == "Mia had 8 beads. She gave 3 beads to Tom. How many beads does Mia have left?"


def test_examples_carry_op_family_and_answer_and_their_text_gives_the_answer() -> None:
    task = WordProblemsTask(phrasings="families", distractor_rate=0.3)
    for split in ("train", "heldout", "heldout_unseen"):
        for ex in task.examples(split, 60, seed=3):
            op, a, b, fam = _operands(ex.prompt_id)
            assert ex.meta["op"] == op and ex.meta["family"] == fam and _family(fam).op == op
            assert ex.reference == _SOLVE[op](a, b) == int(str(ex.meta["answer"])) >= 0
            nums = _numbers(ex.prompt)
            for x in (a, b):
                nums.remove(x)
            assert nums == [] or (len(nums) == 1 and nums[0] != ex.reference), ex.prompt


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10**6), distractor_rate=st.sampled_from([0.0, 0.5]))
def test_splits_are_disjoint_by_family_and_by_arithmetic(seed: int, distractor_rate: float) -> None:
    task = WordProblemsTask(phrasings="families", distractor_rate=distractor_rate)
    held_out = {fid for op in FAMILIES for fid in heldout_families(op, 0.25)}
    pairs, fams = {}, {}
    for split in ("train", "heldout", "heldout_unseen"):
        got = [_operands(e.prompt_id) for e in task.examples(split, 40, seed)]
        pairs[split] = {(op, a, b) for op, a, b, _ in got}
        fams[split] = {f for *_, f in got}
        for op, a, b, _ in got:
            assert split_of(f"word_problems|{op}:{a}:{b}", 0.2) == ("train" if split == "train" else "heldout")
    assert pairs["train"].isdisjoint(pairs["heldout"] | pairs["heldout_unseen"])
    assert fams["heldout_unseen"] <= held_out and (fams["train"] | fams["heldout"]).isdisjoint(held_out)


def test_held_out_families_per_operation() -> None:
    for op, fams in FAMILIES.items():
        out = heldout_families(op, 0.25)
        assert len(out) == 6 == -(-len(fams) // 4) and out <= {f.id for f in fams}  # ceil(24 / 4)
        assert heldout_families(op, 0.25) == out and len(heldout_families(op, 0.01)) == 1
    assert heldout_families("add", 0.25) == {"add06", "add16", "add17", "add21", "add22", "add23"}  # fixed forever


def test_deterministic_in_split_n_seed_and_knobs() -> None:
    task = WordProblemsTask(phrasings="families", distractor_rate=0.2)
    a = task.examples("heldout_unseen", 50, seed=7)
    assert a == WordProblemsTask(phrasings="families", distractor_rate=0.2).examples("heldout_unseen", 50, seed=7)
    assert a != task.examples("heldout_unseen", 50, seed=8)
    assert a != WordProblemsTask(phrasings="families").examples("heldout_unseen", 50, seed=7)
    assert a != task.examples("heldout", 50, seed=7)


def test_two_hundred_distinct_problems_in_each_held_out_set_and_the_pair_space() -> None:
    """The arithmetic space (``+`` 19 x 19 ordered pairs, ``-`` 190 with ``a >= b``, ``*`` 8 x 8) splits into
    85 / 36 / 13 held-out pairs (134), each told by 18 training families (``heldout``, 2412 problems)
    or 6 held-out ones (``heldout_unseen``, 804). 200 problems share pairs (a third are ``*``, of 13 pairs):
    about 90 (``heldout``) and 105 (``heldout_unseen``) distinct pairs."""
    held = {op: [(a, b) for a in range(2, hi + 1) for b in range(2, hi + 1)
                 if (op != "sub" or a >= b) and split_of(f"word_problems|{op}:{a}:{b}", 0.2) == "heldout"]
            for op, hi in (("add", 20), ("sub", 20), ("mul", 9))}
    assert {op: len(p) for op, p in held.items()} == {"add": 85, "sub": 36, "mul": 13}
    task = WordProblemsTask(phrasings="families")
    for split in ("heldout", "heldout_unseen"):
        exs = task.examples(split, 200, seed=0)
        assert len({e.prompt_id for e in exs}) == 200 and len({e.prompt for e in exs}) == 200
        distinct_pairs = {_operands(e.prompt_id)[:3] for e in exs}
        families = {e.meta["family"] for e in exs}
        assert 80 <= len(distinct_pairs) <= 134, (split, len(distinct_pairs))  # seed 0: 89 and 107
        assert len(families) >= 45 if split == "heldout" else families == {  # seed 0: 51 of 54, all 18
            fid for op in FAMILIES for fid in heldout_families(op, 0.25)}


def test_offered_splits_and_refusals() -> None:
    fam = WordProblemsTask(phrasings="families")
    assert fam.eval_splits == ("heldout", "heldout_unseen") and WordProblemsTask().eval_splits == ("heldout",)
    with pytest.raises(ValueError, match=r"task 'word_problems' has no split 'heldout_unseen'.*eval_splits\) are heldout"):
        WordProblemsTask().examples("heldout_unseen", 3, 0)
    with pytest.raises(ValueError, match="unknown split 'test'; valid: train, heldout, heldout_unseen"):
        fam.examples("test", 3, 0)
    with pytest.raises(ValueError, match="task 'arithmetic' has no split 'heldout_unseen'"):  # no phrasing families
        TASKS["arithmetic"]().examples("heldout_unseen", 3, 0)
    with pytest.raises(ValueError, match="distractor_rate, family_heldout_fraction cannot take effect"):
        WordProblemsTask(distractor_rate=0.2, family_heldout_fraction=0.3)
    with pytest.raises(ValueError, match="phrasings must be one of classic, families"):
        WordProblemsTask(phrasings="many")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="family_heldout_fraction must be in"):
        WordProblemsTask(phrasings="families", family_heldout_fraction=1.0)
    with pytest.raises(ValueError, match="distractor_rate must be in"):
        WordProblemsTask(phrasings="families", distractor_rate=1.5)


def test_recipe_and_config_build_the_families_task() -> None:
    from posttrain.loop.validate import load_run_config

    task = build_task(load_run_config("smollm2_word_problems", []))
    assert task.eval_splits == ("heldout", "heldout_unseen")
    cfg = RunConfig.model_validate({"task": {"name": "word_problems", "kwargs": {"phrasings": "families"}}})
    assert build_task(cfg).examples("heldout_unseen", 2, 0)[0].meta["family"] in heldout_families("add", 0.25) | \
        heldout_families("sub", 0.25) | heldout_families("mul", 0.25)
