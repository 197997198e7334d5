"""Issue 39: the trainers that used to reach around the learner (online preference, and the SFT warm-up
inside it) reproduce the goldens recorded before the learner became primitives (``_trainer_golden.py``;
the warm-up alone is also ``demo5`` of test_house_golden.py). Compared as test_house_golden.py compares:
ids, tokens, statuses and rewards exactly; log-probs, metrics and the final weights within
``tests/_tolerance.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
from _house_golden import capture, final_actor  # noqa: E402
from _kernels import gemm_fingerprint  # noqa: E402
from _trainer_golden import CASES, GOLDEN_DIR, GOLDEN_KERNELS, run_case  # noqa: E402
from test_house_golden import VALUE_RTOL, compare_arrays, compare_ids_and_metric_names, compare_metrics  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _golden(case: str) -> tuple[dict[str, np.ndarray], list[dict[str, float]]]:
    with np.load(GOLDEN_DIR / f"{case}.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return arrays, json.loads((GOLDEN_DIR / f"{case}.metrics.json").read_text())


@pytest.mark.parametrize("case", list(CASES))
def test_trainer_matches_the_pre_primitives_golden(case: str, tmp_path: Path) -> None:
    run_case(case, tmp_path / case)
    arrays, metrics = capture(tmp_path / case)
    old_arrays, old_metrics = _golden(case)
    if gemm_fingerprint() != GOLDEN_KERNELS:  # the warm-up's GEMM rounding decides the sampled tokens
        compare_ids_and_metric_names(arrays, old_arrays, metrics, old_metrics)
        pytest.skip(f"GEMM fingerprint {gemm_fingerprint()} is not the golden's: ids and metric names compared")
    compare_arrays(arrays, old_arrays)
    compare_metrics(metrics, old_metrics)
    trained = [m for m in metrics if m.get("preference/pairs", 0.0) > 0]
    assert trained and all(m["optimizer_steps"] == 1.0 for m in trained)  # the comparison saw a trained step
    w = {k: torch.from_numpy(v) for k, v in final_actor(tmp_path / case).items()}
    ref = {k[len("actor/"):]: torch.from_numpy(v) for k, v in old_arrays.items() if k.startswith("actor/")}
    assert set(w) == set(ref)
    for k, v in ref.items():  # the warmed start is not on disk: the weights within the value tolerance
        d = float((w[k].double() - v.double()).abs().max()) / max(float(v.double().abs().max()), 1e-30)
        assert d <= VALUE_RTOL, f"{k}: max|w-w_ref|/max|w_ref| = {d:.3e}"
