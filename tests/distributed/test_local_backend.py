"""Local backend (same interface as Ray), exactly-once checks, config, pending-sample recovery."""

from __future__ import annotations

import builtins
import dataclasses

import _distributed_helpers as helpers
import pytest
import torch
from pydantic import ValidationError

from posttrain.loop.backends import (
    FailedRequest,
    RayBackendConfig,
    RolloutWorkers,
    build_local_backend,
    check_exactly_once,
    restore_pending,
    save_pending,
)
from posttrain.loop.backends.base import RewardWorkers, split_requests
from posttrain.models import build_tiny_model
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.engine import RolloutEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.rollout.weight_transfer import WeightTransferError
from posttrain.trajectory import Reward, Status, make_trajectory


def _engine(seed: int = 0) -> BuiltinEngine:
    return BuiltinEngine(build_tiny_model("micro", seed=seed, dtype=torch.float64), eos_token_id=1)


def _reqs(k: int = 5):
    return [GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(n=1 + i % 3, max_new_tokens=6, seed=i))
            for i in range(k)]


def test_local_workers_match_one_engine_and_sync_weights():
    be = build_local_backend(lambda: _engine(), num_rollout_workers=2)
    assert isinstance(be.rollout, RolloutWorkers) and isinstance(be.rollout, RolloutEngine)
    assert isinstance(be.reward, RewardWorkers)
    ref = _engine().generate(_reqs())
    got = be.rollout.generate(_reqs())
    assert [(c.request_id, c.sample_index, c.token_ids) for c in got] == \
           [(c.request_id, c.sample_index, c.token_ids) for c in ref]
    new = build_tiny_model("micro", seed=4, dtype=torch.float64).state_dict()
    m = be.rollout.broadcast_weights(new, 3)
    assert m["transfer/bytes"] > 0 and be.rollout.version == 3
    assert all(w.version == 3 for w in be.rollout.workers)
    e = _engine()
    e.update_weights(new, 3)
    assert [c.token_ids for c in be.rollout.generate(_reqs())] == [c.token_ids for c in e.generate(_reqs())]
    with pytest.raises(WeightTransferError, match="refusing weights v2"):
        be.rollout.broadcast_weights(new, 2)
    be.close()


def test_local_reward_workers_never_turn_errors_into_zero():
    be = build_local_backend(engines=[_engine()])
    v = be.reward.verify_batch([(helpers.Echo(), "a", "a", {}), (helpers.Raises(), "a", "a", {})])
    assert v[0].status is Status.CORRECT and v[1].status is Status.INFRA_ERROR and not v[1].components
    be.close()


def test_exactly_once_checker_catches_loss_and_duplicates():
    reqs = _reqs(3)
    comps = _engine().generate(reqs)
    check_exactly_once(reqs, comps, [])
    with pytest.raises(RuntimeError, match="r2: 0 completion"):
        check_exactly_once(reqs, [c for c in comps if c.request_id != "r2"], [])
    with pytest.raises(RuntimeError, match="duplicated sample index|completion"):
        check_exactly_once(reqs, comps + [comps[0]], [])
    failed = [FailedRequest(reqs[0], "worker died", 2)]
    with pytest.raises(RuntimeError, match="failed AND"):
        check_exactly_once(reqs, comps, failed)
    check_exactly_once(reqs, [c for c in comps if c.request_id != "r0"], failed)


def test_split_requests_keeps_order_and_balances():
    reqs = _reqs(7)
    chunks = split_requests(reqs, 3)
    assert [r for c in chunks for r in c] == reqs and len(chunks) == 3
    assert split_requests(reqs[:1], 4) == [reqs[:1]]


def test_ray_config_validation_and_scaling_rule():
    local = RayBackendConfig(local_num_cpus=2, num_rollout_workers=2)
    multi = local.model_copy(update={"address": "auto", "local_num_cpus": None, "num_rollout_workers": 16,
                                     "num_reward_workers": 8})
    RayBackendConfig.model_validate(multi.model_dump())
    diff = {k for k, v in local.model_dump().items() if multi.model_dump()[k] != v}
    assert diff == {"address", "local_num_cpus", "num_rollout_workers", "num_reward_workers"}
    with pytest.raises(ValidationError):
        RayBackendConfig(placement="everywhere")
    with pytest.raises(ValidationError):
        RayBackendConfig(num_rollout_workers=0)
    with pytest.raises(ValidationError):
        RayBackendConfig(bogus=1)
    with pytest.raises(ValidationError, match="local_num_cpus"):
        RayBackendConfig(address="auto", local_num_cpus=2)


def test_ray_import_guard(monkeypatch):
    real_import = builtins.__import__

    def no_ray(name, *a, **k):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("No module named 'ray'")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    from posttrain.loop.backends.ray_backend import require_ray

    with pytest.raises(ImportError, match=r"pip install 'posttrain\[ray\]'"):
        require_ray()


def _traj(i: int, version: int):
    return make_trajectory(traj_id=f"q{i}", prompt_id="p", group_id="g", prompt_ids=[5, 6], action_ids=[7, 8],
                           action_logprobs=[-1.0, -2.0], action_versions=version, finish="terminal",
                           status="correct", reward=Reward({"task": 1.0}, {"task": 1.0}, 1.0), verifier="echo@1")


def test_pending_samples_restore_or_discard_all_counted(tmp_path):
    queue = [_traj(0, 5), _traj(1, 3), _traj(2, 1)]
    save_pending(tmp_path, queue, step=4, learner_version=5)
    r = restore_pending(tmp_path, step=4, policy="restore", current_version=5, max_staleness=2)
    assert [t.traj_id for t in r.trajectories] == ["q0", "q1"]
    assert r.counts == {"pending/snapshot": 3.0, "pending/restored": 2.0, "pending/stale_dropped": 1.0,
                        "pending/discarded": 0.0}
    assert r.trajectories[0] == queue[0]  # restored exactly
    d = restore_pending(tmp_path, step=4, policy="discard", current_version=5)
    assert d.trajectories == [] and d.counts["pending/discarded"] == 3.0
    with pytest.raises(FileNotFoundError):
        restore_pending(tmp_path, step=5, policy="restore", current_version=5)
    with pytest.raises(ValueError):
        restore_pending(tmp_path, step=4, policy="keep", current_version=5)  # type: ignore[arg-type]
    # every snapshotted sample is accounted for exactly once
    c = r.counts
    assert c["pending/restored"] + c["pending/stale_dropped"] + c["pending/discarded"] == c["pending/snapshot"]


def test_dataclass_results_are_plain():
    assert dataclasses.is_dataclass(FailedRequest)
