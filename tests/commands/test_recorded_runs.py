"""Old run directories stay readable: a run's saved ``config.yaml`` holding a setting that a later version
refuses for new runs (here ``reward.overlong_max_len`` without an ``overlong`` weight, refused since the
DAPO penalty it computes is never paid) is read as recorded by the commands that only read a run
(``posttrain report``, ``eval``, ``compare``, ``view``), with one warning line naming the key, while
``posttrain train`` of that config, a new run or a resume, still refuses it in one line naming the key.
The training machine's checks (a GPU for ``learner.device=cuda``) do not stop an evaluation elsewhere."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from posttrain.cli import main
from tests._cli_errors import one_error_line
from tests._micro_run import MICRO_RUN

pytestmark = pytest.mark.timeout(300)

REFUSED_NOW = "reward.overlong_max_len"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """``(a micro run of 2 steps, its copy whose config.yaml holds a now-refused setting)``."""
    root = tmp_path_factory.mktemp("recorded")
    run = root / "run"
    assert main(["train", "grpo", *MICRO_RUN, "steps=2", "eval.every=1", "eval.size=8", "sft.steps=0",
                 "sft.examples=2000", "checkpoint_every=2", f"run_dir={run}", "--no-progress"]) == 0
    old = root / "old"
    shutil.copytree(run, old)
    cfg = yaml.safe_load((old / "config.yaml").read_text())
    assert cfg["reward"]["overlong_max_len"] is None and "overlong" not in cfg["reward"]["weights"]
    cfg["reward"]["overlong_max_len"] = 3  # what a run written before the refusal recorded
    (old / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return run, old


def _edit(run: Path, where: Path, top: dict[str, object], **sections: dict[str, object]) -> Path:
    shutil.copytree(run, where)
    cfg = yaml.safe_load((where / "config.yaml").read_text())
    cfg.update(top)
    for sec, keys in sections.items():
        cfg[sec].update(keys)
    (where / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    return where


def test_eval_reads_a_run_recorded_before_a_refusal_with_one_warning(runs, capsys, caplog) -> None:
    run, old = runs
    ckpt = old / "checkpoints" / "step_000002"
    assert main(["eval", str(ckpt), "--n", "4"]) == 0
    out = capsys.readouterr()
    res = json.loads(out.out[out.out.index("{"):])
    assert res["config_from"] == str(old / "config.yaml") and res["n"] == 4
    warned = [r.getMessage() for r in caplog.records if REFUSED_NOW in r.getMessage()]
    assert len(warned) == 1 and "read as recorded" in warned[0] and "reward.overlong_max_len=3" in warned[0]
    # the same weights through the unedited config: the same figures
    assert main(["eval", str(run / "checkpoints" / "step_000002"), "--n", "4"]) == 0
    same = capsys.readouterr().out
    assert json.loads(same[same.index("{"):])["heldout/accuracy"] == res["heldout/accuracy"]


def test_eval_of_a_gpu_run_resumed_with_force_needs_neither_the_gpu_nor_a_warning(runs, tmp_path, capsys,
                                                                                    caplog) -> None:
    """learner.device=cuda was checked against the training machine (evaluating runs on CPU here); a forced
    resume records resume and resume_force, and an evaluation resumes nothing (no resume_force warning)."""
    run, _ = runs
    gpu = _edit(run, tmp_path / "gpu", {"resume": True, "resume_force": True},
                learner={"device": "cuda", "strategy": "ddp"})
    assert main(["eval", str(gpu / "checkpoints" / "step_000002"), "--n", "2"]) == 0
    out = capsys.readouterr().out
    assert json.loads(out[out.index("{"):])["n"] == 2
    assert not [r for r in caplog.records if "read as recorded" in r.getMessage()]


def test_report_compare_and_view_read_the_old_run(runs, tmp_path, capsys) -> None:
    from posttrain.diagnostics.load import open_ledger

    run, old = runs
    assert main(["report", str(old)]) == 0
    assert (old / "diagnostics" / "diagnostics.json").is_file()
    assert main(["compare", str(old), str(run), "--out", str(tmp_path / "cmp")]) == 0
    assert (tmp_path / "cmp" / "compare.json").is_file()
    open_ledger(str(old))  # what `posttrain view` opens before it serves
    capsys.readouterr()


@pytest.mark.parametrize("resume", [False, True])
def test_training_from_the_old_config_still_refuses_it_in_one_line(runs, tmp_path, capsys, resume) -> None:
    _, old = runs
    where = shutil.copytree(old, tmp_path / "resumed") if resume else tmp_path / "new"
    argv = ["train", str(old / "config.yaml"), f"run_dir={where}", "steps=3"] + (["resume=true"] if resume else [])
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "reward.overlong_max_len=3 cannot take effect" in line and "'overlong' weight" in line
