"""``posttrain eval``: a saved policy on a task's held-out prompts, or on whole multi-turn episodes."""

from __future__ import annotations

import json

import pytest
import yaml

from posttrain.cli import main
from posttrain.models import build_char_tokenizer, build_tiny_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("runs") / "r" / "checkpoints" / "step_000001"
    tok = build_char_tokenizer()
    build_tiny_model("micro", vocab_size=len(tok), seed=0).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _json(capsys):
    out = capsys.readouterr().out
    return json.loads(out[out.index("{"):])


def test_eval_on_a_task(model_dir, capsys):
    assert main(["eval", str(model_dir), "--task", "chain_sum", "--task-kwargs", '{"terms": 2}', "--n", "4",
                 "--max-new-tokens", "3"]) == 0
    res = _json(capsys)
    assert res["task"] == "chain_sum" and res["n"] == 4 and 0.0 <= res["heldout/accuracy"] <= 1.0


def test_eval_on_episodes_with_and_without_tools(model_dir, capsys):
    argv = ["eval", str(model_dir), "--env", "calculator_tool", "--task-kwargs", '{"digits": 2}', "--n", "3",
            "--max-new-tokens", "8", "--max-turns", "2", "--max-episode-tokens", "450"]
    assert main(argv) == 0
    res = _json(capsys)
    assert res["env"] == "calculator_tool" and res["tools"] is True and res["n"] == 3
    assert res["env_settings_from"] == "command line" and "heldout/accuracy" in res
    assert main([*argv, "--no-tools"]) == 0
    assert _json(capsys)["tools"] is False


def test_eval_on_episodes_takes_the_runs_env_settings(model_dir, capsys):
    run_cfg = model_dir.parent.parent / "config.yaml"
    run_cfg.write_text(yaml.safe_dump({"model": {"path": "builtin:micro"}, "env": {"name": "calculator_tool", "kwargs": {"digits": 2}, "max_turns": 2,
                                               "max_tokens": 200, "tool_prompt": "none",
                                               "stop_strings": ["</answer>"]}}))
    try:
        assert main(["eval", str(model_dir), "--env", "calculator_tool", "--n", "2", "--max-new-tokens", "8"]) == 0
        assert _json(capsys)["env_settings_from"] == str(run_cfg)
    finally:
        run_cfg.unlink()


def test_eval_needs_a_task_or_an_env_not_both(model_dir, capsys):
    # Outside a run (no config.yaml around the checkpoint) nothing names the task: a one-line error.
    assert main(["eval", str(model_dir)]) == 2
    assert "is not inside a run directory with a config.yaml: give --task NAME or --env NAME" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(model_dir), "--task", "chain_sum", "--env", "calculator_tool"])


@pytest.mark.parametrize(("argv", "needle"), [
    (["--env", "nope"], "env.name: unknown env 'nope'"),
    (["--env", "calculator_tool", "--max-turns", "0"], "env.max_turns"),
    (["--task", "chain_sum", "--no-tools"], "--no-tools is an --env option"),
    (["--env", "calculator_tool", "--task-kwargs", '{"digits": 0}'], "digits must be an int >= 1"),
    (["--task", "nope"], "unknown task 'nope'"),
])
def test_eval_errors_are_one_line(model_dir, capsys, argv, needle):
    assert main(["eval", str(model_dir), *argv, "--n", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert needle in err and "Traceback" not in err and "pydantic" not in err


def test_eval_weights_that_do_not_fit_the_runs_model_are_one_line(model_dir, capsys):
    run_cfg = model_dir.parent.parent / "config.yaml"
    run_cfg.write_text(yaml.safe_dump({"model": {"path": "builtin:tiny"}, "task": {"name": "chain_sum"}}))
    try:
        assert main(["eval", str(model_dir), "--n", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"{model_dir}: the weights do not fit the run's model.path=builtin:tiny ({run_cfg})" in err
        assert "size mismatch" in err
    finally:
        run_cfg.unlink()


def test_eval_says_when_the_runs_revision_at_that_step_was_rejected(model_dir, capsys):
    """The run evaluated the rejected weights, then restored the promoted ones and saved those."""
    run_cfg, meta = model_dir.parent.parent / "config.yaml", model_dir / "meta.json"
    run_cfg.write_text(yaml.safe_dump({"model": {"path": "builtin:micro"}, "task": {"name": "chain_sum"}}))
    decisions = [{"step": 0, "decision": "promoted", "accuracy": 0.5},
                 {"step": 1, "decision": "rejected", "reason": "held-out accuracy collapsed"}]
    meta.write_text(json.dumps({"format": 1, "step": 1,
                                "extra": {"run_state": {"promoted_step": 0, "decisions": decisions}}}))
    try:
        assert main(["eval", str(model_dir), "--n", "2", "--max-new-tokens", "2"]) == 0
        err = capsys.readouterr().err
        assert ("note: the run rejected its revision at step 1: step_000001 holds the restored promoted weights "
                "(step 0)") in err
    finally:
        run_cfg.unlink()
        meta.unlink()
