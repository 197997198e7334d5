"""Ray backend on a local 2-CPU cluster (loopback): rollout over 2 worker actors equals one engine,
verified weight broadcast (checksum, version, timeout naming the worker), reward actors, and the
fault tests (a worker killed mid-generation; retries exhausted)."""

from __future__ import annotations

import time

import _distributed_helpers as helpers
import pytest
import torch
from _distributed_helpers import micro_engine_model

from posttrain.loop.backends import RolloutInfraError
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.rollout.weight_transfer import WeightPacket, WeightTransferError, pack_state_dict
from posttrain.trajectory import Status

pytestmark = pytest.mark.timeout(240)


def _reqs(k: int = 6, tag: str = "r"):
    return [GenerationRequest(f"{tag}{i}", [5, 6, 7 + i], SamplingParams(n=2, max_new_tokens=6, seed=100 + i))
            for i in range(k)]


def _local(state=None, version=0) -> BuiltinEngine:
    e = BuiltinEngine(micro_engine_model(), eos_token_id=1)
    if state is not None:
        e.update_weights(state, version)
    return e


def _key(cs):
    return [(c.request_id, c.sample_index, c.token_ids, c.versions, c.finish_reason) for c in cs]


def _new_weights(seed: int):
    from posttrain.models import build_tiny_model

    return build_tiny_model("micro", seed=seed, dtype=torch.float64).state_dict()


def test_rollout_over_workers_equals_one_engine_and_broadcast_is_verified(ray_env):
    rollout = ray_env["backend"].rollout
    v0 = rollout.version
    w = _new_weights(11)
    m = rollout.broadcast_weights(w, v0 + 1)
    assert m["transfer/workers"] == 2 and m["transfer/bytes"] > 0
    assert [i["version"] for i in rollout.info()] == [v0 + 1, v0 + 1]
    res = rollout.generate_detailed(_reqs())
    assert not res.failed and res.worker_failures == 0
    assert _key(res.completions) == _key(_local(w, v0 + 1).generate(_reqs()))
    # a stale version is refused by every worker, loudly and by name
    with pytest.raises(WeightTransferError, match=r"rollout worker rollout-\d rejected weights"):
        rollout.broadcast_weights(w, v0)
    # a payload that does not hash to the announced checksum is refused (and nothing is applied)
    import ray

    p = pack_state_dict(_new_weights(12), v0 + 2)
    bad = p.buffer.copy()
    bad[3] ^= 0x10
    ref = ray.put(WeightPacket(p.version, p.checksum, p.manifest, bad))
    with pytest.raises(WeightTransferError, match="checksum mismatch"):
        rollout.broadcast_ref([ref], v0 + 2, p.checksum)
    assert [i["version"] for i in rollout.info()] == [v0 + 1, v0 + 1]
    assert rollout.version == v0 + 1


def test_broadcast_timeout_fails_loudly_naming_workers(ray_env):
    import ray

    rollout = ray_env["backend"].rollout

    @ray.remote(num_cpus=0)
    def slow_packet(seconds: float):
        time.sleep(seconds)
        return pack_state_dict(_new_weights(13), 999)

    cfg = rollout.cfg
    rollout.cfg = cfg.model_copy(update={"transfer_timeout_s": 1.5})
    try:
        t0 = time.monotonic()
        with pytest.raises(WeightTransferError, match=r"rollout-0.*(within 1.5s|rejected)|did not confirm"):
            rollout.broadcast_ref([slow_packet.remote(6.0)], rollout.version + 1, "0" * 32)
        assert time.monotonic() - t0 < 10  # bounded, never hangs
    finally:
        rollout.cfg = cfg
    assert rollout.generate(_reqs(1, "after-timeout"))  # workers still serve


def test_worker_killed_mid_generation_restarts_and_requeues_exactly_once(ray_env):
    """Fault test: rollout-0 dies inside generate (os._exit after real work). Ray restarts it, the
    driver re-queues its requests, the restarted worker loads the latest weights before sampling,
    and every request ends exactly once with the tokens an uninterrupted engine gives."""
    rollout = ray_env["backend"].rollout
    w = _new_weights(21)
    v = rollout.version + 1
    rollout.broadcast_weights(w, v)
    pid_before = rollout.info()[0]["pid"]
    (ray_env["markers"] / "rollout-0").write_text("1")
    before = rollout.metrics().get("rollout/worker_failures", 0.0)
    res = rollout.generate_detailed(_reqs(8, "f"))
    assert not (ray_env["markers"] / "rollout-0").exists()  # the hook fired
    assert res.worker_failures == 1 and res.requeued > 0 and not res.failed
    assert rollout.metrics()["rollout/worker_failures"] == before + 1
    assert _key(res.completions) == _key(_local(w, v).generate(_reqs(8, "f")))  # none lost, none doubled
    assert {x for c in res.completions for x in c.versions} == {v}
    info = rollout.info()
    assert info[0]["pid"] != pid_before and info[0]["version"] == v  # restarted and caught up


def test_retries_exhausted_become_failed_requests_never_zero_reward(ray_env):
    rollout = ray_env["backend"].rollout
    cfg = rollout.cfg
    rollout.cfg = cfg.model_copy(update={"request_retries": 0})
    (ray_env["markers"] / "rollout-0").write_text("1")
    try:
        reqs = _reqs(4, "x")
        res = rollout.generate_detailed(reqs)
    finally:
        rollout.cfg = cfg
    assert res.failed and all("rollout-0 died mid-generation" in f.reason for f in res.failed)
    failed_ids = {f.request.request_id for f in res.failed}
    done_ids = {c.request_id for c in res.completions}
    assert failed_ids.isdisjoint(done_ids) and failed_ids | done_ids == {r.request_id for r in reqs}
    # what the loop records for them: infra_error trajectories with no reward at all
    from posttrain.trajectory import Reward, make_trajectory

    for f in res.failed:
        t = make_trajectory(traj_id=f.request.request_id, prompt_id="p", group_id="g",
                            prompt_ids=f.request.prompt_ids, action_ids=[], action_logprobs=[],
                            action_versions=[], finish="terminal", status=Status.INFRA_ERROR,
                            reward=Reward({}, {}, None), verifier="echo@1")
        assert t.reward.total is None
    # the engine-protocol generate raises with the whole result (the same path, no second crash)
    err = RolloutInfraError(res)
    assert err.result is res and f"{len(res.failed)} request(s) failed" in str(err)


def test_reward_actors_verdicts_and_infra_errors(ray_env):
    reward = ray_env["backend"].reward
    items = [(helpers.Echo(), "a", "a", {}), (helpers.Echo(), "a", "b", {}), (helpers.Raises(), "a", "a", {})]
    v = reward.verify_batch(items)
    assert [x.status for x in v] == [Status.CORRECT, Status.WRONG, Status.INFRA_ERROR]
    assert v[2].components == {}  # never a zero reward
    # a verifier that takes its worker down: retried once on the restarted actor, then infra_error
    v = reward.verify_batch([(helpers.KillsWorker(), "a", "a", {})])
    assert v[0].status is Status.INFRA_ERROR and "reward-0" in v[0].explanation
    m = reward.metrics()
    assert m["verify/worker_failures"] == 2 and m["verify/requeued"] == 1
    assert reward.verify_batch([(helpers.Echo(), "z", "z", {})])[0].status is Status.CORRECT  # restarted
