"""LoRA from a recipe key (``lora.rank``): only adapted modules move, the engine samples the merged
weights, checkpoints hold the adapter, and a resume continues exactly where the uninterrupted run
would be. (That LoRA updates push rewarded sequences up is tests/learner/test_actor.py's
``test_lora_update_raises_rewarded_rows``.)"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.models import build_tiny_model
from posttrain.trajectory import Ledger

HERE = Path(__file__).parent
LORA = [
    "model.path=builtin:micro",
    "task.name=flaky_task:digit_first",
    "task.kwargs={terms: 2}",
    "sampling.prompts_per_step=8",
    "sampling.group_size=8",
    "sampling.max_new_tokens=2",
    "eval.size=8",
    "eval.every=1000",
    "logging.progress=false",
    "lora.rank=8",
    "lora.target_modules=[q_proj, v_proj, o_proj, gate_proj, up_proj, down_proj]",
    "optim.lr=3e-3",
    "checkpoint_every=1",
    "sft.steps=0",  # from the random micro model, one optimizer step per update (not the shipped grpo's)
    "optim.num_minibatches=1",
]


@pytest.fixture(autouse=True)
def _flaky_task_on_path():
    sys.path.insert(0, str(HERE))
    yield
    sys.path.remove(str(HERE))


def _actor(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(run_dir / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors"))


def test_lora_recipe_trains_only_adapted_modules_and_the_engine_follows(tmp_path):
    train(load_run_config("grpo", [*LORA, f"run_dir={tmp_path}", "steps=4"]))
    metrics = Ledger(tmp_path / "ledger").read_metrics()
    assert all(m["optimizer_steps"] == 1.0 for m in metrics)
    # The engine samples the merged weights W + (alpha/r) B A that the learner recomputes pi_old with:
    # behaviour and old log-probs agree to float32 rounding (a stale or unmerged engine: >= 1e-2).
    assert max(m["logkappa_abs_max"] for m in metrics) < 1e-4
    ck = tmp_path / "checkpoints" / "step_000004"
    assert (ck / "actor_adapter").is_dir()  # the adapter itself, for resume
    merged, init = _actor(tmp_path, 4), build_tiny_model("micro", seed=0).state_dict()
    moved = {k for k in merged if not torch.equal(merged[k], init[k])}  # lm_head is tied: not saved
    # actor/ is the plain merged model: adapted projections moved, nothing else did
    assert moved and all(any(m in k for m in ("q_proj", "v_proj", "o_proj", "mlp")) for k in moved), moved
    assert torch.equal(merged["model.embed_tokens.weight"], init["model.embed_tokens.weight"])
    # the engine sampled the merged weights: behaviour versions follow the learner's
    for step, t in Ledger(tmp_path / "ledger").iter_trajectories():
        assert set(t.behavior_version[t.action_mask.astype(bool)].tolist()) == {step - 1}


def test_lora_resume_equals_the_uninterrupted_run(tmp_path):
    ref, cut = tmp_path / "ref", tmp_path / "cut"
    train(load_run_config("grpo", [*LORA, f"run_dir={ref}", "steps=3"]))
    train(load_run_config("grpo", [*LORA, f"run_dir={cut}", "steps=2"]))
    train(load_run_config("grpo", [*LORA, f"run_dir={cut}", "steps=3", "resume=true"]))
    a, b = _actor(ref, 3), _actor(cut, 3)
    for k in a:  # same process kind, same shapes: only the adapter + optimizer state carry the run
        torch.testing.assert_close(b[k], a[k], rtol=0, atol=1e-6, msg=k)
    ta = Ledger(ref / "ledger").read_trajectories()
    tb = Ledger(cut / "ledger").read_trajectories()
    assert [t.token_ids.tolist() for t in ta] == [t.token_ids.tolist() for t in tb]
