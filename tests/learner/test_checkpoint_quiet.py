"""A checkpoint write prints no transformers progress bar and leaves the user's bar setting as it was."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.utils import logging as hf_logging

from posttrain.learner.checkpoint import save_checkpoint
from posttrain.models import build_char_tokenizer, build_tiny_model


@pytest.mark.parametrize("enabled", [True, False])
def test_checkpoint_writes_without_a_progress_bar(tmp_path: Path, capfd: pytest.CaptureFixture[str],
                                                  enabled: bool) -> None:
    model = build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0, dtype=torch.float32)
    (hf_logging.enable_progress_bar if enabled else hf_logging.disable_progress_bar)()
    try:
        save_checkpoint(tmp_path / "step_000001", step=1, actor=model, learner_state={"version": 1})
        err = capfd.readouterr().err
        assert "Writing model shards" not in err and "it/s" not in err, err
        assert hf_logging.is_progress_bar_enabled() is enabled  # restored, not switched off for good
    finally:
        hf_logging.enable_progress_bar()
    assert (tmp_path / "step_000001" / "actor").is_dir()
