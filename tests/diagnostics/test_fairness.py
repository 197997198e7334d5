"""Which differences block a comparison, which are only listed."""

from __future__ import annotations

import copy
from pathlib import Path

from posttrain.diagnostics.fairness import blocking_differences, config_differences, flatten, identity
from tests.diagnostics.synthetic import CONFIG, step1, traj, write_run


def test_flatten_and_differences() -> None:
    assert flatten({"a": {"b": 1, "c": {}}, "d": 2}) == {"a.b": 1, "a.c": {}, "d": 2}
    b = copy.deepcopy(CONFIG)
    b["optim"]["lr"] = 0.01
    b["seed"] = 7  # seeds and run dirs differ by construction: not listed
    assert config_differences({"A": CONFIG, "B": b}) == {"optim.lr": {"A": 0.001, "B": 0.01}}


def test_identity_blocks_on_verifier_and_heldout(tmp_path: Path) -> None:
    a = write_run(tmp_path / "a")
    b_cfg = copy.deepcopy(CONFIG)
    b_cfg["eval"]["size"] = 16
    b = write_run(tmp_path / "b", config=b_cfg,
                  trajectories={1: [*step1()[:3], traj("d", "g2", "wrong", 0.0, [-1.0], None, verifier="integer@2")]})
    ia, ib = identity(a), identity(b)
    assert ia["verifier version"] == "integer@1" and ib["verifier version"] == "integer@1,integer@2"
    assert ia["base checkpoint"] == ib["base checkpoint"] == "builtin:tiny init_seed=0"
    lines = blocking_differences({"A": [ia], "B": [ib]})
    assert [line.split(" differs")[0] for line in lines] == ["verifier version", "held-out set"]
    assert blocking_differences({"A": [ia], "A2": [identity(a)]}) == []
