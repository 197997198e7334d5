"""Weights from learner rank actors to rollout workers without the driver in the middle
(``system.ray.weight_sync=direct``), on the session's local cluster.

After one fsdp2 x 2 update, rank 0's actor has put every weight bucket in the object store; the
rollout workers load those buckets (the driver passes references) and end up with exactly the
tensors the via-driver path (the driver packs its copy into one packet) gives them. Equality is
bit-for-bit on purpose: both paths move the same bytes of the same tensors (rank 0's gathered
weights), with no arithmetic in between, so any difference is a transfer bug. A bucket whose bytes
do not hash to the checksum announced beside it is refused by every worker, naming the worker, the
bucket and the version, before any parameter changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import _distributed_helpers as helpers
import pytest
import torch

from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.rollout.weight_transfer import (
    PublishedBucket,
    PublishedWeights,
    WeightPacket,
    WeightTransferError,
    buckets_identity,
    pack_state_dict,
)

CFG = ["model.path=builtin:micro", "model.dtype=float64", "task.name=chain_sum", "task.kwargs={terms: 2}",
       "loss.kl_estimator=null", "loss.kl_coef=0.0", "loss.kl_target=null", "sft.steps=0",
       "optim.num_minibatches=1", "optim.microbatch_tokens=20", "learner.strategy=fsdp2", "learner.world_size=2"]


@pytest.fixture(scope="module")
def workers(ray_env: Any) -> Iterator[Any]:
    """Two rollout workers of their own (direct weight sync) on the session cluster (0.75 CPU free)."""
    from posttrain.config.ray import RayBackendConfig
    from posttrain.loop.backends import builtin_engine_factory
    from posttrain.loop.backends.ray_rollout import RayRolloutWorkers

    cfg = RayBackendConfig(num_rollout_workers=2, cpus_per_rollout_worker=0.1, transfer_timeout_s=30,
                           startup_timeout_s=90, max_restarts=0, max_task_retries=0)
    w = RayRolloutWorkers(builtin_engine_factory(helpers.micro_engine_model(), eos_token_id=1), cfg)
    try:
        yield w
    finally:
        w.close()


def _engine_weights(workers: Any) -> list[dict[str, torch.Tensor]]:
    """Every worker's engine weights (copies), via Ray's ``__ray_call__``."""
    import ray

    def read(actor: Any) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in actor.worker.engine.model.state_dict().items()}

    return ray.get([a.__ray_call__.remote(read) for a in workers.actors], timeout=60)


def _bit_equal(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.timeout(300)
def test_direct_sync_loads_the_same_tensors_as_the_via_driver_sync(workers: Any) -> None:
    from posttrain.config.ray import RayBackendConfig
    from posttrain.learner.ranks import LearnerRanks
    from posttrain.loop.backends.ray_learner import ray_rank_starter
    from posttrain.loop.builders import RankLearnerFactory
    from posttrain.loop.validate import load_run_config

    cfg = load_run_config("grpo", CFG)
    batch = helpers.ragged_batch(11)
    adv = helpers.advantages(batch)
    ray_cfg = RayBackendConfig(cpus_per_learner=0.2, startup_timeout_s=90)  # weight_sync: direct (the default)
    ranks = LearnerRanks(helpers.micro_learner_model(), RankLearnerFactory(cfg), strategy="fsdp2", world_size=2,
                         temperature=1.0, rank_timeout_s=120, startup_timeout_s=120, weight_bucket_bytes=4096,
                         start_ranks=ray_rank_starter(ray_cfg))
    try:
        start = {k: v.detach().clone() for k, v in ranks.model.state_dict().items()}
        upd = ranks.update(batch, adv, old_logprob=ranks.compute_logprobs(batch))
        assert upd["learner/published_buckets"] == upd["learner/weight_buckets"] > 1
        driver = {k: v.detach().clone() for k, v in ranks.model.state_dict().items()}
        assert not _bit_equal(driver, start)  # the update moved the weights
        sent = ranks.weights_for_rollout()
        assert isinstance(sent, PublishedWeights) and sent.version == ranks.version == 1
        assert len(sent.buckets) == ranks.last_weight_buckets > 1  # several buckets, each from rank 0's store

        # direct: the workers fetch rank 0's buckets themselves
        m = workers.broadcast_buckets(sent.buckets, sent.version)
        assert m["transfer/buckets"] == len(sent.buckets) and m["transfer/workers"] == 2
        direct = _engine_weights(workers)

        # other weights in between, so that the via-driver sync below has to load everything again
        other = helpers.micro_learner_model(seed=5).state_dict()
        workers.broadcast_weights(other, 1)
        assert not any(_bit_equal(e, direct[0]) for e in _engine_weights(workers))

        # via the driver: its copy packed into one packet
        workers.broadcast_weights(dict(ranks.model.state_dict()), 1)
        via = _engine_weights(workers)
        # bit-for-bit: the same bytes moved, no arithmetic (module docstring)
        for d, v in zip(direct, via, strict=True):
            assert _bit_equal(d, v) and _bit_equal(d, driver)

        # the loop's entry point takes the direct path for PublishedWeights of the version it syncs
        workers.update_weights(sent, version=1)
        assert [i["loads"] for i in workers.info()] == [4, 4] and workers.version == 1
        # a worker found at another version (as a restarted one, rebuilt at 0) catches up from the
        # buckets before it samples: loads once more, holds the direct weights again
        import ray

        def rewind(actor: Any) -> None:
            actor.worker.engine.version = 0

        ray.get(workers.actors[0].__ray_call__.remote(rewind), timeout=60)
        req = GenerationRequest("catch-up", [5, 6, 7], SamplingParams(n=1, max_new_tokens=2, seed=1))
        assert {v for c in workers.generate([req]) for v in c.versions} == {1}
        assert [i["loads"] for i in workers.info()] == [5, 4] and _bit_equal(_engine_weights(workers)[0], driver)
        # a driver-side change (a rejected revision restoring weights: load_weights) makes it fall back to packing
        ranks.load_weights(helpers.micro_learner_model(seed=5).state_dict())
        assert not isinstance(ranks.weights_for_rollout(), PublishedWeights)
    finally:
        ranks.close()


def _corrupt_buckets(version: int) -> list[PublishedBucket]:
    """Two published buckets of the micro model's weights; bucket 1's bytes altered after packing."""
    import ray

    sd = helpers.micro_learner_model(seed=7).state_dict()
    names = sorted(sd)
    out = []
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2:])):
        p = pack_state_dict({k: sd[k] for k in part}, version)
        buf = p.buffer.copy()
        if i == 1:
            buf[buf.nbytes // 2] ^= 0x01
        ref = ray.put(WeightPacket(p.version, p.checksum, p.manifest, buf))
        out.append(PublishedBucket(i, version, p.checksum, p.nbytes, [ref]))
    return out


@pytest.mark.timeout(120)
def test_a_corrupted_bucket_is_refused_naming_worker_bucket_and_version(workers: Any) -> None:
    before = _engine_weights(workers)
    v = workers.version + 1
    with pytest.raises(WeightTransferError, match=rf"rollout worker rollout-\d rejected weights v{v}: "
                                                  rf"rollout-\d \(weight bucket 1\): checksum mismatch"):
        workers.broadcast_buckets(_corrupt_buckets(v), v)
    after = _engine_weights(workers)
    assert all(_bit_equal(a, b) for a, b in zip(before, after, strict=True))  # bucket 0 was not applied either
    assert workers.version == v - 1


def test_buckets_identity_and_published_weights_hand_computed() -> None:
    import hashlib

    assert buckets_identity(["ab12"]) == "ab12"  # one packet: its own checksum (the via-driver identity)
    assert buckets_identity(["ab12", "cd34"]) == hashlib.blake2b(b"ab12cd34", digest_size=16).hexdigest()
    sd = {"w": torch.zeros(2)}
    b = PublishedBucket(0, 3, "ab12", 8, [])
    assert dict(PublishedWeights(sd, 3, [b])) == sd
    with pytest.raises(ValueError, match="v4 need buckets of that version"):
        PublishedWeights(sd, 4, [b])


def test_read_only_views_share_the_fetched_bytes_the_default_copies_them() -> None:
    sd = {"a": torch.arange(6.0).view(2, 3), "b": torch.ones(2, dtype=torch.float64)}
    p = pack_state_dict(sd, 1)
    frozen = p.buffer.copy()
    frozen.flags.writeable = False  # as an array fetched from Ray's object store
    q = WeightPacket(1, p.checksum, p.manifest, frozen)
    views, copies = q.tensors(read_only_views=True), q.tensors()
    base = frozen.ctypes.data
    assert views["a"].data_ptr() == base and views["b"].data_ptr() == base + 24  # "a": 6 float32 = 24 bytes
    assert copies["a"].data_ptr() != base
    for k, v in sd.items():
        assert torch.equal(views[k], v) and torch.equal(copies[k], v)


@pytest.mark.parametrize(("overrides", "why"), [
    (["system.ray.weight_sync=via_driver"], "system.backend is not ray"),
    (["system.backend=ray", "system.ray.weight_sync=via_driver"], "learner.strategy=single runs the learner in the driver"),
])
def test_weight_sync_is_refused_where_it_cannot_act(overrides: list[str], why: str) -> None:
    from posttrain.errors import ConfigError
    from posttrain.loop.validate import load_run_config

    with pytest.raises(ConfigError, match=rf"system.ray.weight_sync='via_driver' cannot take effect: {why}"):
        load_run_config("grpo", overrides)
    ranks = ["system.backend=ray", "learner.strategy=ddp", "learner.world_size=2"]
    assert load_run_config("grpo", [*ranks, "system.ray.weight_sync=via_driver"]).system.ray.weight_sync == "via_driver"
    assert load_run_config("grpo", ranks).system.ray.weight_sync == "direct"  # the default
