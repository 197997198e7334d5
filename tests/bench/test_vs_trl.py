"""``posttrain bench vs-trl --quick``: both sides train from one SFT checkpoint and the JSON has the figures.

A smoke test of the wiring (no timing assertion: benchmarks are never timed tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from pathlib import Path

from posttrain.bench import vs_trl


def test_vs_trl_quick_writes_json_and_both_sides_train(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", dest="json_path", default=None)
    vs_trl.add_arguments(parser)
    out = tmp_path / "out.json"
    args = parser.parse_args(["--quick", "--threads", "1", "--work-dir", str(tmp_path / "work"), "--json", str(out)])
    level_before = logging.getLogger("posttrain").level
    assert vs_trl.run(args) == 0
    assert logging.getLogger("posttrain").level == level_before  # the bench quiets the loop only while it runs
    res = json.loads(out.read_text())
    for key in ("speedup_vs_trl", "posttrain_heldout_accuracy", "trl_heldout_accuracy", "sft_heldout_accuracy"):
        assert isinstance(res[key], float) and math.isfinite(res[key]), key
    assert res["speedup_vs_trl"] > 0
    for side in ("posttrain", "trl"):
        d = res[side]
        assert d["steps"] == res["steps"] == vs_trl.QUICK_STEPS
        assert d["weight_delta_l2"] > 0, f"{side}: weights did not change"
        assert d["generated_tokens"] > 0
        assert 0.0 <= d["heldout_accuracy"] <= 1.0
        assert d["heldout"]["n"] == res["heldout_size"]
