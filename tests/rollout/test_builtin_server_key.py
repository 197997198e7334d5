"""``rollout.process: server`` end to end: the trainer starts the built-in engine's server process itself
(posttrain/loop/builders.py) and the run's ledger is the in-process run's (tests/rollout/test_builtin_server.py
checks the server and the ledger comparison in every mode)."""

from __future__ import annotations

import numpy as np
import pytest

from posttrain.config import ConfigError
from posttrain.loop.builders import build_engine, build_model
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rollout.server_process import SpawnedEngine
from posttrain.trajectory import Ledger
from tests._tolerance import shape_rtol
from tests.rollout.test_builtin_server import SMALL

pytestmark = pytest.mark.timeout(600)


def test_build_engine_starts_a_server_process(tmp_path):
    cfg = load_run_config("grpo", [*SMALL, "rollout.process=server", "rollout.server.threads=1"])
    tok, model = build_model(cfg)
    engine = build_engine(model, tok, cfg, tmp_path)
    try:
        assert isinstance(engine, SpawnedEngine) and engine.version == 0
        assert "LISTENING" in (tmp_path / "engine_server.log").read_text()
    finally:
        engine.close()
    assert engine.proc.poll() is not None


def test_one_step_off_with_the_engine_process_records_the_in_process_ledger(tmp_path):
    mode = ["system.mode=one_step_off", "correction.name=tis"]
    runs = {}
    for name, extra in (("in_process", []), ("server", ["rollout.process=server"])):
        st = train(load_run_config("grpo", [*SMALL, f"run_dir={tmp_path / name}", *mode, *extra]))
        runs[name] = (st, Ledger(tmp_path / name / "ledger").read_trajectories())
    assert (tmp_path / "server" / "engine_server.log").exists()
    assert not (tmp_path / "in_process" / "engine_server.log").exists()
    (st_a, a), (st_b, b) = runs["in_process"], runs["server"]
    assert st_a.step == st_b.step == 3 and len(a) == len(b) > 0
    for ta, tb in zip(a, b, strict=True):
        m = ta.action_mask.astype(bool)
        assert ta.token_ids.tolist() == tb.token_ids.tolist() and ta.policy_lag == tb.policy_lag
        assert ta.behavior_version[m].tolist() == tb.behavior_version[m].tolist()
        assert np.abs(ta.behavior_logprob[m] - tb.behavior_logprob[m]).max(initial=0.0) <= shape_rtol(
            int(ta.token_ids.size)) * max(1.0, float(np.abs(ta.behavior_logprob[m]).max(initial=0.0)))


def test_server_settings_without_the_server_process_cannot_take_effect():
    with pytest.raises(ConfigError, match=r"rollout\.server\.threads=2 cannot take effect"):
        load_run_config("grpo", ["rollout.server.threads=2"])
    assert load_run_config("grpo", ["rollout.process=server", "rollout.server.threads=2"]).rollout.server.threads == 2
