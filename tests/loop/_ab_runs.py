"""A/B runs of one recipe that differ in a single key, and the comparison of their final weights."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from safetensors.torch import load_file

from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import shape_rtol, update_rel_diff  # noqa: E402


def train_each(tmp_path: Path, base: Sequence[str], key: str, values: Sequence[bool]) -> dict[bool, Path]:
    """Train ``grpo`` with ``base`` and ``key=value`` for each value; returns each run's directory."""
    runs = {}
    for v in values:
        d = tmp_path / str(v)
        # from the micro model's own init (no SFT warm-up) and one optimizer step per update, whatever
        # the shipped grpo recipe says: update_diff_at measures from that init; base may override
        train(load_run_config("grpo", ["sft.steps=0", "optim.num_minibatches=1", *base, f"run_dir={d}",
                                   f"{key}={str(v).lower()}"]))
        runs[v] = d
    return runs


def update_diff_at(a: Path, b: Path, step: int) -> tuple[float, float]:
    """(relative difference of the two runs' whole updates at checkpoint ``step``, the bound it must
    stay within): float32 micro model, rounding over its longest reduction (64); whole updates are
    compared because Adam amplifies rounding on near-eps gradient elements (see _tolerance)."""
    from posttrain.models import build_tiny_model

    wa, wb = (load_file(str(r / "checkpoints" / f"step_{step:06d}" / "actor" / "model.safetensors")) for r in (a, b))
    start = {k: v for k, v in build_tiny_model("micro", seed=0).state_dict().items() if k in wa}
    return update_rel_diff(wa, wb, start), 100 * shape_rtol(64)
