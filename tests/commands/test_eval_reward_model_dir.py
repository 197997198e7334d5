"""``posttrain eval DIR`` on a reward-model directory outside a run's checkpoints (``RUN/reward_model``, or a
third-party ``*ForSequenceClassification`` directory) is one error line saying it is a reward model and where
its pair accuracy is, whatever ``--task`` says.

Before: the directory was loaded with ``AutoModelForCausalLM`` (the backbone, an untrained LM head) and
its "held-out accuracy" on the task printed (0.0), as if it were a policy.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from posttrain.cli import main
from posttrain.models import build_char_tokenizer
from posttrain.rewards.reward_model import RENDER_FILE
from tests._cli_errors import one_error_line

TASK = ["--task", "chain_sum", "--task-kwargs", '{"terms": 2}', "--n", "2", "--max-new-tokens", "2"]


@pytest.fixture(scope="module")
def rm_dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("eval_rm")
    tok = build_char_tokenizer()
    torch.manual_seed(0)
    model = Qwen2ForSequenceClassification(Qwen2Config(
        vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id))
    own, third = root / "rm_run" / "reward_model", root / "hf_rm"
    for d in (own, third):
        model.save_pretrained(d)
        tok.save_pretrained(str(d))
    (own / RENDER_FILE).write_text(json.dumps({"use_chat_template": False, "max_length": 64}))
    (own.parent / "config.yaml").write_text("trainer: reward_model\n")
    return own, third


def test_a_runs_reward_model_is_refused_pointing_to_its_pair_accuracy(rm_dirs: tuple[Path, Path], capsys) -> None:
    own, _ = rm_dirs
    assert main(["eval", str(own), *TASK]) == 2
    line = one_error_line(capsys)
    assert f"{own}: a reward model ({RENDER_FILE}" in line and "does not generate" in line, line
    assert str(own.parent / "metrics.jsonl") in line and f"posttrain report {own.parent}" in line, line
    assert f"reward.model.path={own}" in line, line


def test_a_third_party_sequence_classifier_is_refused(rm_dirs: tuple[Path, Path], capsys) -> None:
    _, third = rm_dirs
    assert main(["eval", str(third), *TASK]) == 2
    line = one_error_line(capsys)
    assert "a reward model (config.json architectures ['Qwen2ForSequenceClassification'])" in line, line
    assert "does not generate" in line and f"reward.model.path={third}" in line, line
