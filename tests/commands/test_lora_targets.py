"""``lora.target_modules`` that name no module of the model: one error line naming the key, the entry and the
model's adaptable module names, before the run directory is written. peft refused only a list of which no
entry matched, in its own wording (``Target modules {'q_projx'} not found in the base model``), and silently
adapted the rest of a list with one misspelt entry."""

from __future__ import annotations

from pathlib import Path

import pytest

from posttrain.cli import main
from posttrain.models import build_char_tokenizer, build_tiny_model
from tests._cli_errors import one_error_line
from tests._micro_run import MICRO_RUN

pytestmark = pytest.mark.timeout(120)
MICRO_LINEAR = "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


def _micro():
    return build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0)


@pytest.mark.parametrize("targets, bad", [("[q_projx]", "'q_projx'"), ("'q_proj|k_projx'", None),
                                          ("[q_proj, vproj]", "'vproj'")])
def test_an_unknown_target_module_is_one_line_naming_the_key_before_the_run_dir(tmp_path: Path, capsys,
                                                                                targets: str, bad: str | None) -> None:
    run = tmp_path / "run"
    argv = ["train", "grpo", *MICRO_RUN, "steps=1", "sft.steps=0", "sft.examples=2000", "lora.rank=2",
            f"lora.target_modules={targets}", f"run_dir={run}"]
    assert main(argv) == 2
    line = one_error_line(capsys)
    assert "lora.target_modules=" in line and f"adaptable modules: {MICRO_LINEAR}, or 'all-linear'" in line
    assert (bad or "'q_proj|k_projx'") + " matches no module of Qwen2ForCausalLM" in line, line
    assert not run.exists()


def test_matching_is_peft_s_and_the_matching_targets_still_wrap() -> None:
    from posttrain.learner.lora import check_target_modules, wrap_lora

    m = _micro()
    check_target_modules(m, ["q_proj", "self_attn.v_proj", "model.layers.0.mlp.up_proj"])  # names and dotted ends
    check_target_modules(m, r".*\.(q|k)_proj")  # a regular expression over full names
    check_target_modules(m, "all-linear")
    with pytest.raises(ValueError, match=r"'attn\.q_proj' matches no module"):  # a dotted end is whole parts
        check_target_modules(m, ["attn.q_proj"])
    with pytest.raises(ValueError, match="is not a regular expression"):
        check_target_modules(m, "q_proj(")
    wrapped = wrap_lora(m, rank=2, target_modules=["q_proj"])
    assert sum(1 for n, _ in wrapped.named_modules() if n.endswith("q_proj.lora_A")) == 2  # micro: 2 layers
