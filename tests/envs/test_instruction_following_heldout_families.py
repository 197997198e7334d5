"""instruction_following's ``heldout_families``: whole constraint families kept out of ``train``,
``heldout`` and ``heldout_unseen`` and asked only by the split ``heldout_families`` (issue 43), and the
splits without the knob byte-identical to before it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from posttrain.envs import TASKS, TaskExample, split_of
from posttrain.envs import instruction_following as inf

HELD = ("json_keys", "all_capitals")
SPLITS3 = ("heldout", "heldout_unseen", "heldout_families")


def _digest(exs: list[TaskExample]) -> str:
    h = hashlib.sha256()
    for e in exs:
        h.update(json.dumps([e.prompt_id, e.prompt, e.reference, e.meta], sort_keys=True).encode())
    return h.hexdigest()[:16]


def _families(ex: TaskExample) -> set[str]:
    return set(str(ex.meta["combo"]).split("+"))


def _wordings(prompt_id: str) -> set[tuple[str, int]]:
    """(family, wording index) pairs of a prompt id ``name/tNN.rR/fam.wK+fam.wK/digest``; request = ``request``."""
    _, head, parts, _ = prompt_id.split("/")
    out = {("request", int(head.split(".r")[1]))}
    for part in parts.split("+"):
        fam, w = part.rsplit(".w", 1)
        out.add((fam, int(w)))
    return out


@pytest.fixture(scope="module")
def task() -> inf.InstructionFollowingTask:
    return inf.InstructionFollowingTask(heldout_families=HELD, eval_splits=SPLITS3)


# Digests of examples(split, n, seed) taken from the code before heldout_families existed.
BEFORE = [
    ({}, "train", 200, 0, "9a83f1833e5affa9"),
    ({}, "heldout", 100, 1, "49bdc87371e50042"),
    ({}, "heldout_unseen", 100, 2, "b5c41ebcfd593e65"),
    ({"on_topic": True, "train_max_constraints": 2}, "train", 100, 3, "791936a0df3be253"),
    ({"families": ("no_commas", "words_at_most", "title", "json_keys"), "min_constraints": 2}, "heldout", 50, 4,
     "18b702e846158028"),
]


@pytest.mark.parametrize(("kwargs", "split", "n", "seed", "digest"), BEFORE)
def test_without_heldout_families_every_split_is_byte_identical_to_before(
        kwargs: dict[str, object], split: str, n: int, seed: int, digest: str) -> None:
    assert _digest(inf.InstructionFollowingTask(**kwargs).examples(split, n, seed)) == digest  # type: ignore[arg-type]
    explicit = inf.InstructionFollowingTask(heldout_families=(), **kwargs)  # type: ignore[arg-type]
    assert _digest(explicit.examples(split, n, seed)) == digest


def test_trained_splits_never_carry_a_heldout_family(task: inf.InstructionFollowingTask) -> None:
    rest = inf.InstructionFollowingTask(families=[f for f in inf.FAMILIES if f not in HELD])
    for split, n in (("train", 400), ("heldout", 200), ("heldout_unseen", 200)):
        exs = task.examples(split, n, seed=5)
        assert len(exs) == n
        assert all(not _families(e) & set(HELD) for e in exs), split
        # exactly the splits of families = the other families: same prompts, ids, references
        assert exs == rest.examples(split, n, seed=5), split


def test_heldout_families_split_carries_one_and_is_otherwise_in_distribution(
        task: inf.InstructionFollowingTask) -> None:
    exs = task.examples("heldout_families", 300, seed=0)
    assert len({e.prompt_id for e in exs}) == 300
    assert all(_families(e) & set(HELD) for e in exs)
    assert {f for e in exs for f in _families(e)} >= {*HELD, "include_keywords", "words_at_most"}  # trained ones beside
    assert {e.meta["n_constraints"] for e in exs} == {1, 2, 3}
    held_topics = inf.heldout_topics()
    for e in exs:  # the family is the only unseen part: training topic, combination and wordings
        assert e.meta["topic"] not in held_topics
        assert split_of(f"instruction_following|combo|{e.meta['combo']}", task.combo_heldout_fraction) == "train"
        assert all(w != inf.heldout_wording(f) for f, w in _wordings(e.prompt_id)), e.prompt_id
        # never trained even had the family been: its (topic, constraints) is an in-distribution held-out problem
        specs = [s for s in json.loads(e.reference) if s["family"] != "mentions_any"]
        key = json.dumps([e.meta["topic"], specs], sort_keys=True)
        assert split_of(f"instruction_following|{key}", task.heldout_fraction) == "heldout"
    # with a held-out family and on_topic the references still get the topic constraint
    topical = inf.InstructionFollowingTask(heldout_families=HELD, eval_splits=SPLITS3, on_topic=True)
    assert [e.prompt_id for e in topical.examples("heldout_families", 20, seed=0)] == [
        e.prompt_id for e in exs[:20]]


def test_deterministic_in_split_n_seed(task: inf.InstructionFollowingTask) -> None:
    a = task.examples("heldout_families", 40, seed=3)
    assert a == task.examples("heldout_families", 40, seed=3)
    assert a == inf.InstructionFollowingTask(heldout_families=HELD, eval_splits=SPLITS3).examples(
        "heldout_families", 40, seed=3)
    assert a != task.examples("heldout_families", 40, seed=4)
    assert a[:10] == task.examples("heldout_families", 10, seed=3)
    assert task.examples("heldout_families", 0, seed=0) == []
    one = inf.InstructionFollowingTask(heldout_families=("json_keys",), eval_splits=SPLITS3)
    assert all("json_keys" in _families(e) for e in one.examples("heldout_families", 40, seed=3))


def test_the_loop_names_its_metrics_after_the_split(task: inf.InstructionFollowingTask) -> None:
    from posttrain.loop.heldout import eval_splits

    assert eval_splits(task) == SPLITS3  # metrics heldout_families/accuracy, heldout_families/ifc/<family>
    built = TASKS["instruction_following"](heldout_families=list(HELD), eval_splits=list(SPLITS3))
    assert built.heldout_families == HELD and built.eval_splits == SPLITS3


def test_refusals() -> None:
    make = inf.InstructionFollowingTask
    with pytest.raises(ValueError, match="'haiku' is not one of families"):
        make(heldout_families=("haiku",))
    with pytest.raises(ValueError, match="'json_keys' is not one of families \\['no_commas', 'title'\\]"):
        make(families=("no_commas", "title"), heldout_families=("json_keys",))
    with pytest.raises(ValueError, match="names a family twice"):
        make(heldout_families=("json_keys", "json_keys"))
    with pytest.raises(ValueError, match="hold out every family of families"):
        make(heldout_families=tuple(inf.FAMILIES))
    with pytest.raises(ValueError, match="cannot hold min_constraints=2"):  # all_lowercase, all_capitals: exclusive
        make(families=("all_lowercase", "all_capitals", "no_commas"), heldout_families=("no_commas",),
             min_constraints=2)
    with pytest.raises(ValueError, match="held-out family 'all_capitals' fits in no compatible set"):
        make(families=("all_capitals", "all_lowercase", "words_at_most", "no_commas"),
             heldout_families=("all_capitals",), min_constraints=3)
    with pytest.raises(ValueError, match="heldout_families needs the task kwarg heldout_families"):
        make(eval_splits=SPLITS3)
    with pytest.raises(ValueError, match="unknown split 'heldout_families'"):
        make(heldout_families=HELD).examples("heldout_families", 1, seed=0)
    with pytest.raises(ValueError, match="heldout_families"):
        TASKS["instruction_following"](heldout_families="json_keys")


def test_the_recipe_override_and_the_doc_line_build_the_task() -> None:
    """``posttrain check smollm2_instruction_following "task.kwargs={...}"``'s config path (parse, validate,
    build the task, list its held-out sets), and docs/tasks_and_verifiers.md's example line, as written."""
    import re

    import yaml

    from posttrain.loop.builders import build_task
    from posttrain.loop.heldout import eval_splits
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("smollm2_instruction_following", [
        "task.kwargs={on_topic: true, heldout_families: [json_keys], eval_splits: [heldout, heldout_unseen, "
        "heldout_families]}"])
    built = build_task(cfg)
    assert built.heldout_families == ("json_keys",) and eval_splits(built) == SPLITS3
    assert all("json_keys" in _families(e) for e in built.examples("heldout_families", 20, seed=0))
    doc = (Path(__file__).parents[2] / "docs" / "tasks_and_verifiers.md").read_text()
    sec = doc.split("## Verifiable instruction following", 1)[1].split("\n## ", 1)[0]
    (line,) = re.findall(r"```yaml\n(.*?)```", sec, re.S)
    task_cfg = yaml.safe_load(line)["task"]
    assert task_cfg["name"] == "instruction_following"
    from_doc = TASKS["instruction_following"](**task_cfg["kwargs"])
    assert from_doc.heldout_families == HELD and from_doc.eval_splits == SPLITS3


@pytest.mark.timeout(600)
def test_a_micro_run_logs_the_split_as_heldout_families(tmp_path: Path) -> None:
    """End to end (micro model, one step): the loop names the split's metrics after it with no change of its
    own, ``heldout_families/accuracy`` and ``heldout_families/ifc/<family>`` for the families it asks, and the
    trained sets never ask a held-out family."""
    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config

    kwargs = "{heldout_families: [json_keys, all_capitals], eval_splits: [heldout, heldout_unseen, heldout_families]}"
    train(load_run_config(None, [
        "model.path=builtin:micro", "sampling.prompts_per_step=2", "sampling.group_size=2", "steps=1", "eval.every=1",
        "logging.progress=false", "guards.max_truncation_rate=1.0", "task.name=instruction_following",
        f"task.kwargs={kwargs}", "sampling.max_new_tokens=6", "eval.size=6", "seed=2", f"run_dir={tmp_path}"]))
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    evs = [r for r in rows if "heldout/accuracy" in r]
    assert [r["step"] for r in evs] == [0, 1]
    task = inf.InstructionFollowingTask(heldout_families=HELD, eval_splits=SPLITS3)
    for split in SPLITS3:
        asked = {s["family"] for ex in task.examples(split, 6, seed=2) for s in json.loads(ex.reference)}
        assert bool(asked & set(HELD)) == (split == "heldout_families"), split
        for r in evs:
            assert 0.0 <= r[f"{split}/accuracy"] <= 1.0
            rates = {k[len(split) + len("/ifc/"):] for k in r if k.startswith(f"{split}/ifc/")}
            assert rates == asked, (split, r["step"])
