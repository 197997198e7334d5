"""Issue 22 / deliverable 4: a dataset reference the task's verifier cannot read is a load-time error
naming the file and the row (before: an infra_error, or a silent ``wrong``, for every sample at run time)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.envs.files import file_task
from posttrain.envs.task import TaskExample, check_references
from posttrain.rewards.basic import IntegerVerifier
from posttrain.rewards.math_answer import MathVerifier


def _jsonl(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return path


def test_malformed_latex_reference_is_a_load_error_naming_file_and_row(tmp_path):
    p = _jsonl(tmp_path / "math.jsonl", ["1/2", "\\frac{3}{4}", "7", "\\frac{1}{", "\\sqrt{2}"])
    with pytest.raises(ValueError) as e:
        file_task(p, verifier="math")
    msg = str(e.value)
    assert msg.startswith(f"{p}: row 3: field 'answer' '\\\\frac{{1}}{{' cannot be read by the 'math' verifier")
    assert "\n" not in msg
    # the same file without the malformed row loads
    ok = file_task(_jsonl(tmp_path / "ok.jsonl", ["1/2", "\\frac{3}{4}", "7", "\\sqrt{2}"]), verifier="math")
    assert sum(len(r) for r in ok.rows.values()) == 4


@pytest.mark.parametrize("ref, readable", [("1/2", True), ("-5", True), ("\\frac{\\sqrt{3}}{2}", True),
                                           ("(-\\infty, 2]", True), ("x=3", True),
                                           ("\\frac{1}{", False), ("\\sqrt{", False), ("a+", False), ("", False),
                                           ("$", False)])
def test_math_check_reference(ref, readable):
    """Readable iff math-verify turns it into a mathematical object (a reference it cannot is compared as
    text or raises at run time: MathVerifier.verify raised for '' and '$' and judged '\\frac{1}{' by text)."""
    why = MathVerifier().check_reference(ref)
    assert (why is None) == readable, why


def test_integer_reference_that_is_not_an_integer_names_its_row(tmp_path):
    p = _jsonl(tmp_path / "ints.jsonl", ["3", "4", "3.0"])
    with pytest.raises(ValueError, match=r"ints.jsonl: row 2: field 'answer' '3.0' cannot be read by the 'integer' "
                                         r"verifier: not an integer"):
        file_task(p, verifier="integer")


class _Counting:
    """A verifier whose check_reference records what it was asked (and refuses 'bad')."""

    name = "counting"
    version = "1"

    def __init__(self) -> None:
        self.seen: list[object] = []

    def verify(self, response, reference, **context):  # pragma: no cover - not called here
        raise AssertionError

    def check_reference(self, reference):
        self.seen.append(reference)
        return "bad reference" if reference == "bad" else None


def _exs(refs):
    return [TaskExample(prompt_id=f"t/{i}", prompt=f"q{i}", reference=r, source=f"f.jsonl: row {i}")
            for i, r in enumerate(refs)]


def test_check_references_checks_each_distinct_reference_once_and_samples_above_the_limit():
    v = _Counting()
    assert check_references(_exs(["1", "2", "1", "2", "3"]), v) == 3 and v.seen == ["1", "2", "3"]
    v = _Counting()
    assert check_references(_exs([str(i) for i in range(40)]), v, limit=10) == 10
    assert len(set(v.seen)) == 10 and v.seen == sorted(v.seen, key=int)  # a sample, in file order
    with pytest.raises(ValueError, match=r"^f.jsonl: row 1: reference 'bad' cannot be read by the 'counting' "
                                         r"verifier: bad reference$"):
        check_references(_exs(["ok", "bad", "bad"]), _Counting())
    assert check_references(_exs(["12"]), IntegerVerifier()) == 1 and IntegerVerifier().check_reference("12") is None
    assert check_references(_exs(["x"]), object()) == 0  # a verifier without check_reference: not checked


def test_train_refuses_the_file_before_any_run_dir_exists(tmp_path, capsys):
    p = _jsonl(tmp_path / "math.jsonl", [str(i) for i in range(30)] + ["\\frac{1}{"])
    run_dir = tmp_path / "run"
    rc = main(["train", "grpo", "model.path=builtin:micro", "task.name=jsonl",
               f"task.kwargs={{path: {p}, verifier: math}}", f"run_dir={run_dir}", "steps=1", "sft.steps=0",
               "--no-progress"])
    assert rc == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{p}: row 30: field 'answer'" in last and "cannot be read by the 'math' verifier" in last
    assert not run_dir.exists()
