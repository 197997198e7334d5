"""Issue 12 part 1: one typed batch through the update changes no number.

The golden arrays (``golden/update_step_pre12.npz``) were produced by ``_update_golden.py`` from the
code *before* the refactor (commit a7311e7: three ``collate`` calls, ``with_logprobs`` round trips);
this test runs the same cases with the current code and compares the ledger's old / ref log-probs,
versions and rewards, the advantages (and returns) the update trained on, the actor (and critic)
weights after the last step, and the ledger columns / metric keys."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from posttrain.models import build_tiny_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _tolerance import assert_scaled_close, shape_rtol, update_rel_diff  # noqa: E402
from _update_golden import CASES, GOLDEN, capture  # noqa: E402

# float32 micro model: rounding over its longest reduction (64 = hidden size), |log-prob| <= 10
LOGPROB_ATOL = shape_rtol(64) * 10


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    with np.load(GOLDEN) as z:
        return {k: z[k] for k in z.files}


@pytest.mark.parametrize("case", list(CASES))
def test_update_step_matches_the_pre_refactor_code(case, golden, tmp_path):
    new = capture(case, tmp_path / case)
    old = {k[len(case) + 1:]: v for k, v in golden.items() if k.startswith(f"{case}/")}
    for k in ("traj_ids", "lengths", "token_ids", "old_version", "adv_traj_ids", "reward_total"):
        np.testing.assert_array_equal(new[f"{case}/{k}"], old[k], err_msg=k)
    for k in ("old_logprob", "ref_logprob"):
        assert (f"{case}/{k}" in new) == (k in old), k
        if k in old:
            np.testing.assert_array_equal(new[f"{case}/ref_version"], old["ref_version"])
            np.testing.assert_allclose(new[f"{case}/{k}"], old[k], rtol=0, atol=LOGPROB_ATOL, err_msg=k)
    for k in ("advantages", "returns"):
        assert (f"{case}/{k}" in new) == (k in old), k
        if k in old:
            assert np.abs(old[k]).max() > 0, f"{k}: the case carries no signal"
            assert_scaled_close(torch.from_numpy(new[f"{case}/{k}"]), torch.from_numpy(old[k]),
                                100 * shape_rtol(64), k)
    # Others may add ledger fields / metrics; none the update recorded before may go missing.
    for k in ("metric_keys", "ledger_columns"):
        missing = set(old[k].tolist()) - set(new[f"{case}/{k}"].tolist())
        assert not missing, f"{k} lost {sorted(missing)[:5]}"
    start = {f"actor.{k}": v for k, v in build_tiny_model("micro", seed=0).state_dict().items()}
    wa = {k: torch.from_numpy(v) for k, v in old.items() if k.startswith("actor.")}
    wb = {k[len(case) + 1:]: torch.from_numpy(v) for k, v in new.items() if k.startswith(f"{case}/actor.")}
    assert set(wa) == set(wb)
    # Whole updates compared (Adam amplifies rounding on near-eps gradient elements; see _tolerance)
    assert update_rel_diff(wb, wa, {k: v for k, v in start.items() if k in wa}) <= 100 * shape_rtol(64)
    ca = {k: torch.from_numpy(v) for k, v in old.items() if k.startswith("critic.")}
    cb = {k[len(case) + 1:]: torch.from_numpy(v) for k, v in new.items() if k.startswith(f"{case}/critic.")}
    assert set(ca) == set(cb)
    for k, v in ca.items():
        assert_scaled_close(cb[k], v, 100 * shape_rtol(64), k)
