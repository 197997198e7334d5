"""Helpers for the distributed tests: verifiers, batches, the rank function and its spawner.

Imported by name (this folder is put on ``sys.path`` by conftest.py) so spawned ranks can import
it; Ray workers receive it by value (``cloudpickle.register_pickle_by_value``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch

from posttrain.rewards.verdict import Verdict
from posttrain.trajectory import Status, TrajectoryBatch, collate, make_trajectory


@dataclasses.dataclass(frozen=True)
class Echo:
    """correct iff response == reference."""

    name: str = "echo"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        ok = response == reference
        return Verdict(Status.CORRECT if ok else Status.WRONG, {"task": float(ok)}, f"pid {os.getpid()}")


@dataclasses.dataclass(frozen=True)
class Raises:
    """Always raises (a broken verifier: infra_error, never a zero reward)."""

    name: str = "raises"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        raise RuntimeError("verifier bug")


@dataclasses.dataclass(frozen=True)
class KillsWorker:
    """Ends the worker process (a verifier that takes its worker down)."""

    name: str = "kills"
    version: str = "1"

    def verify(self, response: str, reference: Any, **context: Any) -> Verdict:
        os._exit(3)


def micro_engine_model() -> torch.nn.Module:
    """The rollout model of the Ray tests: micro preset, float64."""
    from posttrain.models import build_tiny_model

    return build_tiny_model("micro", seed=0, dtype=torch.float64)


def micro_learner_model(dtype: torch.dtype = torch.float64, seed: int = 0) -> torch.nn.Module:
    from posttrain.models import build_tiny_model

    return build_tiny_model("micro", seed=seed).to(dtype)


def ragged_batch(n: int = 12, seed: int = 1) -> TrajectoryBatch:
    """``n`` single-turn rows of random lengths (behaviour log-probs arbitrary)."""
    g = torch.Generator().manual_seed(seed)
    trajs = []
    for i in range(n):
        P = int(torch.randint(2, 6, (1,), generator=g))
        A = int(torch.randint(1, 9, (1,), generator=g))
        ids = torch.randint(3, 106, (P + A,), generator=g).tolist()
        beh = (-torch.rand(A, generator=g, dtype=torch.float64) * 3 - 0.1).tolist()
        trajs.append(make_trajectory(traj_id=f"t{i}", prompt_id=f"p{i // 4}", group_id=f"g{i // 4}",
                                     prompt_ids=ids[:P], action_ids=ids[P:], action_logprobs=beh,
                                     action_versions=0, finish="terminal"))
    return collate(trajs, pad_token_id=0)


def advantages(batch: TrajectoryBatch, seed: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch.size, generator=g, dtype=torch.float64)[:, None] * batch.action_mask.to(torch.float64)


LEARNER_KW: dict[str, Any] = dict(
    lr=1e-2, max_grad_norm=1.0, num_minibatches=2, policy_loss="ppo_clip",
    kl_estimator="k3", kl_coef=0.05, entropy_coef=0.01, correction="tis", correction_kwargs={"cap": 1.5},
    microbatch_tokens=20,
)


def single_process_reference(reduction: str, n: int) -> dict[str, Any]:
    """Gradients (one mini-batch) and weights after one update, in one process."""
    from posttrain.learner.actor import PolicyLearner

    batch, adv = ragged_batch(n), advantages(ragged_batch(n))
    batch = _with_ref(batch)
    kw = _kw(reduction)
    lrn = PolicyLearner(micro_learner_model(), **kw)
    old = lrn.compute_logprobs(batch)
    loss, grads = lrn.compute_gradients(batch, adv, old_logprob=old)
    metrics = lrn.update(batch, adv, old_logprob=old)
    return {"loss": loss, "grads": grads, "old": old, "metrics": metrics,
            "weights": {k: v.detach().clone() for k, v in lrn.model.state_dict().items()}}


def _kw(reduction: str) -> dict[str, Any]:
    kw = dict(LEARNER_KW, reduction=reduction)
    if reduction == "seq_mean_token_sum_norm":
        kw["reduction_kwargs"] = {"max_len": 12}
    return kw


def _with_ref(batch: TrajectoryBatch) -> TrajectoryBatch:
    from posttrain.learner.actor import PolicyLearner

    ref = PolicyLearner(micro_learner_model(seed=7), lr=0.0).compute_logprobs(batch)
    return batch.freeze("ref", ref, 0)


def rank_main(rank: int, world_size: int, port: int, reductions: list[str], n: int, out_dir: str) -> None:
    """One rank: data-parallel log-probs, gradients and one update (a PolicyLearner with the
    ProcessGroupSync hook, as ``learner.strategy=ddp`` builds it) on the same batch per reduction;
    saved to ``out_dir/<reduction>-rank<r>.pt``."""
    torch.set_num_threads(1)
    from posttrain.learner.actor import PolicyLearner
    from posttrain.learner.distributed import ProcessGroupSync, init_process_group

    init_process_group(rank, world_size, port=port, timeout_s=60)
    try:
        batch = _with_ref(ragged_batch(n))
        adv = advantages(ragged_batch(n))
        for reduction in reductions:
            sync = ProcessGroupSync()
            model = micro_learner_model()
            sync.check_same_weights(model)
            lrn = PolicyLearner(model, grad_sync=sync, **_kw(reduction))
            old = lrn.compute_logprobs(batch)
            loss, grads = lrn.compute_gradients(batch, adv, old_logprob=old)
            metrics = lrn.update(batch, adv, old_logprob=old)
            torch.save({"loss": loss, "grads": grads, "old": old, "metrics": metrics,
                        "weights": lrn.model.state_dict()}, os.path.join(out_dir, f"{reduction}-rank{rank}.pt"))
    finally:
        import torch.distributed as dist

        dist.destroy_process_group()


def run_ranks(fn: Callable[..., None], world_size: int, *args: object, timeout_s: float = 300.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, port, *args)`` on 127.0.0.1.

    ``fn`` must be importable (module level). Bounded: a rank still running after ``timeout_s``
    is killed and ``TimeoutError`` raised; a rank that fails raises ``RuntimeError`` with its exit code.
    """
    import time

    import torch.multiprocessing as mp

    from posttrain.learner.distributed import free_port

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, world_size, port, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        alive = [i for i, p in enumerate(procs) if p.is_alive()]
        if alive:
            raise TimeoutError(f"ranks {alive} still running after {timeout_s:g}s")
        bad = {i: p.exitcode for i, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise RuntimeError(f"rank(s) failed with exit codes {bad}")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
