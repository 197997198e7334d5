"""posttrain inspect task: prompts, model-free reference answers and their verdicts."""

import re

from posttrain.cli import main
from posttrain.envs import TASKS


def test_inspect_task_arithmetic(capsys):
    assert main(["inspect", "task", "arithmetic", "--n", "3"]) == 0
    out = capsys.readouterr().out
    prompts = re.findall(r"prompt:\s+'(.*)'", out)
    assert prompts == [e.prompt for e in TASKS["arithmetic"]().examples("train", 3, 0)]
    assert out.count("-> correct") == 3 and out.count("-> wrong") == 3 and "verifier=integer@1" in out


def test_inspect_options_reach_the_task(capsys):
    assert main(["inspect", "task", "countdown", "--n", "2", "--split", "heldout", "--difficulty", "3",
                 "--seed", "5", "--kwarg", "max_number=5"]) == 0
    out = capsys.readouterr().out
    want = TASKS["countdown"](difficulty=3, max_number=5).examples("heldout", 2, 5)
    assert re.findall(r"prompt:\s+'(.*)'", out) == [e.prompt for e in want]
    assert "split=heldout" in out and "seed=5" in out


def test_unknown_task_is_a_one_line_error(capsys):
    assert main(["inspect", "task", "nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown task 'nope'" in err and "arithmetic" in err
