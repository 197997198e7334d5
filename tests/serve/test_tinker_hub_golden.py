"""Issue 39: the Tinker hub as a wire adapter over the learner's ``forward_backward`` / ``optim_step`` changes
no number. ``golden/tinker_hub_pre39.json`` was written by ``_tinker_hub_golden.py`` from the hub's own loop
(before the change); the same script runs here and is compared within ``tests/_tolerance.py``:

- before the first optimizer step (the adapter is exactly the golden one): log-probs and losses within
  ``shape_rtol`` of the longest datum, the first step's gradient norm likewise;
- after it: within 100x that (Adam's per-element normalisation amplifies rounding, as in
  ``tests/learner/test_actor.py``), and the adapter after both steps as a whole update (``update_rel_diff``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _tinker_hub_golden import GOLDEN, LONG, run  # noqa: E402
from _tolerance import assert_scaled_close, shape_rtol, update_rel_diff  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def _tensors(rec: dict[str, list[float]], shapes: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(v, dtype=torch.float32).view(shapes[k]) for k, v in rec.items()}


def test_hub_matches_the_pre39_golden() -> None:
    gold = json.loads(GOLDEN.read_text())
    now = run()
    assert [c["kind"] for c in now["calls"]] == [c["kind"] for c in gold["calls"]]
    stepped = 0
    for i, (c, g) in enumerate(zip(now["calls"], gold["calls"], strict=True)):
        if g["kind"] == "optim_step":
            rtol = shape_rtol(LONG) * (100 if stepped else 1)
            assert c["metrics"].keys() == g["metrics"].keys() == {"grad_norm:mean"}, f"call {i}"
            assert c["metrics"]["grad_norm:mean"] == pytest.approx(g["metrics"]["grad_norm:mean"], rel=rtol), f"call {i}"
            stepped += 1
            continue
        n = max(len(lp) for lp in g["logprobs"])
        rtol = shape_rtol(n) * (100 if stepped else 1)
        assert len(c["logprobs"]) == len(g["logprobs"]), f"call {i}"
        for j, (lp, glp) in enumerate(zip(c["logprobs"], g["logprobs"], strict=True)):
            assert_scaled_close(torch.tensor(lp), torch.tensor(glp), rtol, f"call {i} ({g['loss_fn']}) datum {j}")
        assert c["loss_sum"] == pytest.approx(g["loss_sum"], rel=rtol), f"call {i} ({g['loss_fn']}) loss:sum"
    shapes = gold["shapes"]
    assert now["shapes"] == shapes
    start = _tensors(gold["adapter_start"], shapes)
    for k, v in _tensors(now["adapter_start"], shapes).items():
        assert torch.equal(v, start[k]), f"adapter tensor {k} starts elsewhere"
    diff = update_rel_diff(_tensors(now["adapter_end"], shapes), _tensors(gold["adapter_end"], shapes), start)
    assert diff <= 100 * shape_rtol(LONG), f"adapter after two steps: ||dw - dw_gold|| / ||dw_gold|| = {diff:.3e}"
