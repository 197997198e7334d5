"""The command line: help lists every command; user errors are one clear line, exit code 2."""

import pytest

from posttrain.cli import main


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("train", "demo", "eval", "bench", "inspect", "check"):
        assert cmd in out


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["train", "no_such_recipe"], "recipe 'no_such_recipe' not found"),
        (["train", "grpo", "optim.lrr=1"], "optim.lrr: unknown key"),
        (["train", "grpo", "sampling.temperature=-1"], "sampling.temperature"),
        (["train", "grpo", "task.name=arithmetic", "task.kwargs={terms: 3}", "run_dir={tmp}"],
         "task.kwargs.terms: unknown keyword of task 'arithmetic'"),
        (["inspect", "ledger", "/nonexistent/run"], "no ledger steps"),
    ],
)
def test_user_errors_are_one_line(capsys, tmp_path, argv, needle):
    assert main([a.replace("{tmp}", str(tmp_path)) for a in argv]) == 2
    err = capsys.readouterr().err.strip()
    assert needle in err and "\n" not in err and "Traceback" not in err


def test_print_recipe_shows_the_six_axes(capsys):
    assert main(["train", "dapo", "--print-recipe"]) == 0
    out = capsys.readouterr().out
    for axis in ("feedback", "sampling", "credit", "correction", "reduction", "system"):
        assert f"  {axis}" in out
    assert "dynamic sampling" in out and "eps_high" in out
