"""Build the teacher the `distill` recipe ships: posttrain/recipes/data/distill_teacher_micro/.

A ``builtin:micro`` model SFT-trained on 3-term chain sums (300 warm-up steps at lr 1e-2), then one GRPO
step so the run writes a checkpoint; its ``actor/`` directory (safetensors, config, the char tokenizer)
is copied into the recipes' data folder. CPU, about a minute. Run from the repository root:

    .venv/bin/python scripts/make_distill_teacher.py
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from posttrain.learner.checkpoint import latest_checkpoint
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

DEST = Path("posttrain/recipes/data/distill_teacher_micro")
OVERRIDES = ["model.path=builtin:micro", "task.kwargs={terms: 3}", "sampling.max_new_tokens=4",
             "logging.progress=false", "guards.max_truncation_rate=1.0", "eval.size=200", "sft.steps=300",
             "sft.lr=1e-2", "steps=1", "optim.num_minibatches=1", "sampling.prompts_per_step=8",
             "sampling.group_size=4", "eval.every=1000"]


def main() -> None:
    """Train the teacher in a temporary run directory and copy its checkpoint's ``actor/`` to :data:`DEST`."""
    with tempfile.TemporaryDirectory() as tmp:
        st = train(load_run_config("grpo", [*OVERRIDES, f"run_dir={tmp}/run"]))
        ck = latest_checkpoint(f"{tmp}/run")
        assert ck is not None, "the run wrote no checkpoint"
        if DEST.exists():
            shutil.rmtree(DEST)
        shutil.copytree(ck / "actor", DEST)
    print(f"teacher in {DEST}; held-out accuracy (greedy) by step {st.heldout_curve}")


if __name__ == "__main__":
    main()
