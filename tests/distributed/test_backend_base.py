"""The backend interface's helpers (exactly-once check, request split), the Ray config and its import guard."""

from __future__ import annotations

import builtins

import pytest
import torch
from pydantic import ValidationError

from posttrain.loop.backends import FailedRequest, RayBackendConfig, check_exactly_once
from posttrain.loop.backends.base import split_requests
from posttrain.models import build_tiny_model
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest


def _engine(seed: int = 0) -> BuiltinEngine:
    return BuiltinEngine(build_tiny_model("micro", seed=seed, dtype=torch.float64), eos_token_id=1)


def _reqs(k: int = 5):
    return [GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(n=1 + i % 3, max_new_tokens=6, seed=i))
            for i in range(k)]


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
    from posttrain.loop.backends.ray_cluster import require_ray

    with pytest.raises(ImportError, match=r"pip install 'posttrain\[ray\]'"):
        require_ray()
