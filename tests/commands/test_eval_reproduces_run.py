"""``posttrain eval RUN/checkpoints/step_N`` reproduces the run's own held-out record (issue 22, part 5).

Each test trains a tiny run a few steps, then evaluates its checkpoints with ``posttrain eval`` and
compares every ``heldout*`` figure with the run's ``metrics.jsonl`` line of that step. The runs use
non-default evaluation settings (``reward.extract``, ``task.system_prompt``, ``sampling.max_new_tokens``,
``seed``, ``eval.size``; for episodes ``env.*``), which an evaluation that ignores the run's
``config.yaml`` gets wrong. The checkpoint's weights are the ones the run's engine evaluated at that step
(``eval.reject_drop=1.0``: no revision is rejected, so no weights are restored before the checkpoint),
and the evaluation builds the same engine over the same held-out list, so the batches have the same
shapes: counts (statuses, accuracy = correct / N, lengths) must be equal, not merely close; the reward mean
is compared with ``pytest.approx`` (a float mean).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

pytestmark = pytest.mark.timeout(300)

def _json(capsys) -> tuple[dict, str]:
    cap = capsys.readouterr()
    return json.loads(cap.out[cap.out.index("{"):]), cap.err


def _recorded(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "heldout/accuracy" in r}


def _assert_same(evald: dict, rec: dict, n: int) -> None:
    """The greedy ``heldout/*`` figures first (accuracy, statuses, length, reward), then every other
    ``heldout_*`` family the run logged (sampled, no-tool), and no figure the run did not log."""
    greedy = sorted(k for k in rec if k.startswith("heldout/"))
    others = sorted(k for k in rec if k.startswith("heldout") and k not in greedy)
    for k in [*greedy, *others]:
        got = evald.get(k, "<missing>")
        if k.endswith("reward_mean"):
            assert got == pytest.approx(rec[k], rel=1e-9), (k, got, rec[k])
        else:  # ratios and means of integer counts over the same N: equal
            assert got == rec[k], (k, got, rec[k])
    assert {k for k in evald if k.startswith("heldout")} == set(greedy) | set(others)
    assert evald["n"] == n


def test_eval_of_a_checkpoint_equals_the_runs_record_single_turn(tmp_path, capsys):
    # A short SFT warm-up gives the policy a few right sums (held-out greedy accuracy ~0.1 at steps 1-2,
    # not 0: the comparison is not 0 == 0); the system prompt, the extraction, the 6-token budget, seed 3
    # and the 24-prompt split are all the run's own, none of them the eval command's defaults.
    run_dir = tmp_path / "single"
    train(load_run_config(None, [
        "model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}",
        "task.system_prompt=Add up", "reward.extract=last_number", "seed=3",
        "sft.steps=100", "sft.lr=1e-2", "sft.batch_size=32",
        "sampling.prompts_per_step=2", "sampling.group_size=4", "sampling.max_new_tokens=6", "optim.lr=1e-3",
        "eval.size=24", "eval.every=1", "eval.reject_drop=1.0", "eval.sampled_temperature=1.0",
        "logging.progress=false", "steps=2", "checkpoint_every=1", f"run_dir={run_dir}"]))
    rec = _recorded(run_dir)
    assert sorted(rec) == [0, 1, 2]
    for step in (1, 2):
        ckpt = run_dir / "checkpoints" / f"step_{step:06d}"
        # The run's own task named, as a user would: the rest must come from the run's config.yaml.
        assert main(["eval", str(ckpt), "--task", "chain_sum"]) == 0
        out, err = _json(capsys)
        _assert_same(out, rec[step], n=24)
        assert f"evaluating as the run {run_dir} did (config.yaml)" in err
        assert "extract last_number" in err and "system_prompt 'Add up'" in err and "no flag overrides" in err
        assert out["config_from"] == str(run_dir / "config.yaml") and out["overridden"] == []
    # The actor/ folder of a checkpoint is inside the run too; flags override and are named.
    assert main(["eval", str(run_dir / "checkpoints" / "step_000002" / "actor"), "--n", "5"]) == 0
    out, err = _json(capsys)
    assert out["n"] == 5 and out["overridden"] == ["--n (eval.size 24 -> 5)"]
    assert "overridden: --n (eval.size 24 -> 5)" in err


def test_eval_of_a_checkpoint_equals_the_runs_record_multi_turn(tmp_path, capsys):
    run_dir = tmp_path / "episodes"
    train(load_run_config(None, [
        "model.path=builtin:micro", "env.name=calculator_tool", "env.kwargs={digits: 2}", "env.tool_prompt=none",
        "env.max_turns=2", "env.max_tokens=120", "env.stop_strings=['e', 'o']", "env.eval_without_tools=true",
        "seed=5", "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=5",
        "eval.size=4", "eval.every=1", "eval.reject_drop=1.0", "steps=1", "checkpoint_every=1",
        "logging.progress=false", "guards.max_truncation_rate=1.0", f"run_dir={run_dir}"]))
    rec = _recorded(run_dir)
    assert sorted(rec) == [0, 1]
    assert main(["eval", str(run_dir / "checkpoints" / "step_000001"), "--env", "calculator_tool"]) == 0
    out, err = _json(capsys)
    _assert_same(out, rec[1], n=4)
    assert "evaluating as the run" in err and "max_new_tokens 5" in err and "no flag overrides" in err
    assert out["env_settings_from"] == str(run_dir / "config.yaml") and out["tools"] is True


def test_eval_of_a_run_checkpoint_needs_no_task_flag(tmp_path, capsys):
    """Inside a run the config names the task; outside one, --task / --env is a one-line error."""
    run_dir = tmp_path / "r"
    train(load_run_config(None, ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}",
                             "sampling.prompts_per_step=2",
                             "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=3", "steps=1",
                             "logging.progress=false", f"run_dir={run_dir}"]))
    ckpt = run_dir / "checkpoints" / "step_000001"
    assert main(["eval", str(ckpt)]) == 0
    out, err = _json(capsys)
    assert out["task"] == "chain_sum" and out["n"] == 3 and "task chain_sum" in err
    assert out["heldout/accuracy"] == _recorded(run_dir)[1]["heldout/accuracy"]
    # --task of another task drops the run's task kwargs (they belong to its task) and says so.
    assert main(["eval", str(ckpt), "--task", "arithmetic"]) == 0
    out, err = _json(capsys)
    assert out["task"] == "arithmetic" and "--task (task.name 'chain_sum' -> 'arithmetic')" in err
