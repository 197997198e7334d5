"""Issue 39: the offline pair trainers (``trainer: preference`` from ``preference.data``, ``trainer:
reward_model``) reproduce the goldens recorded before they moved onto the shared run lifecycle
(``_offline_golden.py``), uninterrupted and interrupted-then-resumed alike.

Compared exactly: the run directory's files, each checkpoint's step, format, learner-state keys, trainer
name and data cursor, the reward model's rendering files, which metrics each ``metrics.jsonl`` line holds,
the counters among them (``step``, ``pairs_seen``, the optimiser's step counts) and the log and printed
lines (paths and seconds masked). Within ``tests/_tolerance.py`` (``VALUE_RTOL`` of test_house_golden.py):
every other metric, the checkpoints' held-out curves, and the final weights as a whole update
(``update_rel_diff`` from the model as built)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _golden_cli import check_catches_a_moved_loss_and_counter, compare_checkpoints_and_metrics  # noqa: E402
from _offline_golden import CASES, GOLDEN_DIR, capture, final_weights, run_resumed, run_straight  # noqa: E402
from _tolerance import update_rel_diff  # noqa: E402
from test_house_golden import VALUE_RTOL  # noqa: E402

pytestmark = pytest.mark.timeout(300)

EXACT_METRICS = ("step", "pairs_seen", "optimizer_steps", "nonfinite_steps", "zero_grad_steps")
"""Counters: equal on any CPU."""


def _golden(case: str) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    with np.load(GOLDEN_DIR / f"{case}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads((GOLDEN_DIR / f"{case}.json").read_text()), arrays


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=VALUE_RTOL, abs_tol=VALUE_RTOL)


def compare_run(new: dict[str, Any], old: dict[str, Any]) -> None:
    """What a run left on disk (:func:`_offline_golden.capture`) against its golden (module docstring)."""
    assert new["files"] == old["files"], f"files: {sorted(set(new['files']) ^ set(old['files']))}"
    assert new["render"] == old["render"], "the reward model's rendering files"
    compare_checkpoints_and_metrics(new, old, EXACT_METRICS, _close)


def compare_weights(final: dict[str, np.ndarray], golden: dict[str, np.ndarray]) -> None:
    """The kept parameters of the last checkpoint, as an update from the golden's start, within VALUE_RTOL."""
    ref = {k[len("final/"):]: torch.from_numpy(v) for k, v in golden.items() if k.startswith("final/")}
    start = {k[len("start/"):]: torch.from_numpy(v) for k, v in golden.items() if k.startswith("start/")}
    assert ref and set(final) == set(ref) == set(start), (sorted(final), sorted(ref))
    d = update_rel_diff({k: torch.from_numpy(v) for k, v in final.items()}, ref, start)
    assert d <= VALUE_RTOL, f"||dw - dw_ref|| / ||dw_ref|| = {d:.3e}"


@pytest.mark.parametrize("case", list(CASES))
def test_offline_trainer_matches_the_pre_lifecycle_golden(case: str, tmp_path: Path) -> None:
    golden, arrays = _golden(case)
    lines = run_straight(case, tmp_path / case)
    compare_run(capture(tmp_path / case), golden)
    compare_weights(final_weights(tmp_path / case), arrays)
    assert lines == golden["lines"]["straight"]


@pytest.mark.parametrize("case", list(CASES))
def test_interrupted_then_resumed_matches_the_uninterrupted_golden(case: str, tmp_path: Path) -> None:
    golden, arrays = _golden(case)
    stopped, resumed = run_resumed(case, tmp_path / case)
    assert stopped == golden["lines"]["interrupted"]
    assert resumed == golden["lines"]["resumed"]
    assert resumed[0] == "resumed <RUN> at step 2"
    compare_run(capture(tmp_path / case), golden)
    compare_weights(final_weights(tmp_path / case), arrays)


def test_the_comparison_catches_a_moved_metric_a_lost_file_and_another_update() -> None:
    """Not vacuous: a loss moved by 0.2%, a counter off by one, a missing file, another cursor or a weight
    moved by a tenth of its update fails the comparison against the golden it was copied from."""
    golden, arrays = _golden("dpo")
    check_catches_a_moved_loss_and_counter(compare_run, golden, "pairs_seen")
    final = {k[len("final/"):]: v for k, v in arrays.items() if k.startswith("final/")}
    compare_weights(final, arrays)
    off = json.loads(json.dumps(golden))
    off["files"].remove("checkpoints/step_000002/rng.pt")
    with pytest.raises(AssertionError, match="files"):
        compare_run(off, golden)
    off = json.loads(json.dumps(golden))
    off["checkpoints"]["step_000004"]["extra"]["cursor"] += 16
    with pytest.raises(AssertionError, match="step_000004"):
        compare_run(off, golden)
    k = "model.layers.0.self_attn.q_proj.weight"
    moved = dict(final, **{k: final[k] + 0.1 * (final[k] - arrays[f"start/{k}"])})
    with pytest.raises(AssertionError, match="dw_ref"):
        compare_weights(moved, arrays)
