"""Issue 38 item 3: which teacher a distillation run trains against is part of the run.

- a teacher given as a run's checkpoint ``RUN/checkpoints/step_N`` (the form ``posttrain eval`` takes) is its
  ``actor/`` (it failed with a message cut mid-sentence: "Couldn't instantiate the backend tokenizer from one of:");
- a directory that holds no model is one line naming ``loss.distill.teacher`` and ``config.json``;
- each checkpoint records the teacher's weights fingerprint, and ``resume=true`` against a teacher directory whose
  weights were replaced is refused naming ``loss.distill.teacher`` (it resumed silently: reverse KL 2.08 -> 3.58),
  unless ``resume_force=true``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

import posttrain
from posttrain.cli import main
from posttrain.errors import ConfigError
from posttrain.learner.checkpoint import latest_checkpoint, load_checkpoint
from posttrain.learner.fingerprint import weights_fingerprint
from posttrain.loop.preflight import preflight
from posttrain.loop.validate import load_run_config
from posttrain.models import build_tiny_model

pytestmark = [pytest.mark.timeout(600)]

MICRO_TEACHER = Path(posttrain.__file__).parent / "recipes" / "data" / "distill_teacher_micro"
SHORT = ["sft.steps=0", "sampling.prompts_per_step=4", "sampling.group_size=2", "optim.num_minibatches=1",
         "eval.size=8", "eval.every=100", "logging.progress=false", "checkpoint_every=1"]


def _as_checkpoint(tmp: Path) -> Path:
    """The shipped micro teacher laid out as a run's checkpoint ``RUN/checkpoints/step_000003/actor``."""
    step = tmp / "teacher_run" / "checkpoints" / "step_000003"
    shutil.copytree(MICRO_TEACHER, step / "actor")
    return step


def test_a_teacher_given_as_a_run_checkpoint_is_its_actor(tmp_path: Path) -> None:
    step = _as_checkpoint(tmp_path)
    cfg = load_run_config("distill", [f"loss.distill.teacher={step}", f"run_dir={tmp_path / 'run'}"])
    assert preflight(cfg) is None
    from posttrain.loop.builders import build_teacher, load_tokenizer

    teacher = build_teacher(cfg, load_tokenizer(cfg.model.path))
    assert teacher is not None
    shipped = build_teacher(load_run_config("distill", [f"run_dir={tmp_path / 'run'}"]),
                            load_tokenizer(cfg.model.path))
    assert shipped is not None and weights_fingerprint(teacher) == weights_fingerprint(shipped)


def test_a_directory_without_a_model_is_one_line_naming_the_key(tmp_path: Path) -> None:
    empty = tmp_path / "not_a_model"
    (empty / "sub").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"^loss\.distill\.teacher=.*not_a_model: no config\.json there") as e:
        preflight(load_run_config("distill", [f"loss.distill.teacher={empty}", f"run_dir={tmp_path / 'run'}"]))
    assert "\n" not in str(e.value)


def test_the_fingerprint_is_of_the_weights() -> None:
    a = build_tiny_model("micro", vocab_size=40, seed=0, dtype=torch.float32)
    b = build_tiny_model("micro", vocab_size=40, seed=0, dtype=torch.float32)
    assert weights_fingerprint(a) == weights_fingerprint(b)
    with torch.no_grad():
        next(b.parameters()).view(-1)[7] += 1e-6
    assert weights_fingerprint(a) != weights_fingerprint(b)


def test_resume_against_a_replaced_teacher_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    teacher = tmp_path / "teacher"
    shutil.copytree(MICRO_TEACHER, teacher)
    run = tmp_path / "run"
    base = ["distill", *SHORT, f"loss.distill.teacher={teacher}", f"run_dir={run}"]
    assert main(["train", *base, "steps=1"]) == 0
    ck = latest_checkpoint(run)
    assert ck is not None
    recorded = load_checkpoint(ck).extra["teacher"]
    assert recorded["path"] == str(teacher) and len(recorded["fingerprint"]) == 32
    capsys.readouterr()
    # The same directory, other weights (same architecture and tokenizer: only the fingerprint can tell).
    from safetensors.torch import load_file, save_file

    sd = load_file(str(teacher / "model.safetensors"))
    save_file({k: v + 0.01 for k, v in sd.items()}, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    assert main(["train", *base, "steps=2", "resume=true"]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = err.strip().splitlines()[-1]  # after transformers' weight-loading bar: the teacher is loaded to know it
    assert "resume=true with another distillation teacher: loss.distill.teacher=" in line, line
    assert "resume_force=true" in line
    assert latest_checkpoint(run) == ck  # nothing trained against the new teacher
    # resume_force: goes on, and the next checkpoint records the new teacher.
    assert main(["train", *base, "steps=2", "resume=true", "resume_force=true"]) == 0
    again = latest_checkpoint(run)
    assert again is not None and again != ck
    assert load_checkpoint(again).extra["teacher"]["fingerprint"] != recorded["fingerprint"]
