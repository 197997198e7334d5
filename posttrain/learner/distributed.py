"""Data-parallel policy learner over ``torch.distributed`` (gloo on CPU; NCCL/FSDP2 on GPUs).

Every rank holds the same model and optimizer state and receives the same rollout batch (the
driver's collated batch; it is small next to the model). For every mini-batch (the same shuffle on
every rank: the generator is seeded identically), rank ``r`` of ``W`` runs forward/backward on its
shard ``rows[r::W]`` only, with the reduction weights computed from the *mini-batch-global* counts
(``num_sequences = |M|``, ``num_tokens = N(M)``) instead of its shard's. Because a reduction is a
weight function of the row and the global counts (``posttrain/algos/reductions.py``), the shard
losses sum exactly to the mini-batch loss ``L(M)``, so the SUM all-reduce of the shard gradients
is ``dL(M)/dtheta`` — the single-process gradient, up to float summation order (shards are other
GEMM shapes; ``tests/_tolerance.py`` states the bound the tests use). Gradient clipping and the AdamW step then run identically on every rank, so the
weights stay bitwise equal across ranks.

This is the split invariance the single-process learner already has across micro-batches
(``docs/learner.md``), extended across processes — through the learner's documented
gradient-reduction hook (:mod:`posttrain.learner.grad_sync`), :class:`ProcessGroupSync`, not by
overriding the learner's internals. The shard is a row subset, so micro-batching
by ``microbatch_tokens`` still applies inside each rank.

GPUs: the collectives are written for the NCCL backend too (one GPU per rank, model on
``cuda:rank``, device tensors) but no test has run them on a GPU yet (docs/distributed.md). For
models that do not fit one GPU, parameters are sharded by FSDP2 (``learner.strategy=fsdp2``,
:mod:`posttrain.learner.ranks`): its gradient reduce-scatter must be a SUM (divide factor 1) with
the global-count reduction weights here; that path is tested on CPU with gloo.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from posttrain.learner.actor import PolicyLearner
from posttrain.trajectory.collate import TrajectoryBatch


def free_port(host: str = "127.0.0.1") -> int:
    """A currently free TCP port on ``host`` (for ``MASTER_PORT``)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def init_process_group(rank: int, world_size: int, *, port: int, host: str = "127.0.0.1",
                       backend: str = "gloo", timeout_s: float = 120.0) -> None:
    """``dist.init_process_group`` over TCP at ``host:port`` with a bounded timeout."""
    import datetime

    os.environ["MASTER_ADDR"] = host
    os.environ["MASTER_PORT"] = str(port)
    if backend == "gloo":
        # Keep gloo's own sockets on the same interface as the rendezvous (loopback in tests).
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo" if host in ("127.0.0.1", "localhost") else "")
        if not os.environ["GLOO_SOCKET_IFNAME"]:
            del os.environ["GLOO_SOCKET_IFNAME"]
    dist.init_process_group(backend, init_method=f"tcp://{host}:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def all_reduce_copy(values: torch.Tensor, op: Any, device: torch.device | str, group: Any = None) -> torch.Tensor:
    """``op`` over ranks of a copy of ``values`` made on the collective's ``device`` (NCCL needs device
    tensors, gloo CPU ones); the result comes back on ``values``' device, ``values`` is untouched."""
    out = values.to(device, copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.to(values.device)


class ProcessGroupSync:
    """:class:`~posttrain.learner.grad_sync.GradientSync` over a ``torch.distributed`` process group.

    Rank ``r`` of ``W`` computes ``rows[r::W]`` of every mini-batch; gradients are SUM-all-reduced
    as one flat buffer (one collective per mini-batch), metric sums SUM-reduced, ratio extrema
    MIN-reduced. Collectives run on the tensors' own device (CPU tensors for gloo; put the model on
    ``cuda:rank`` for NCCL, whose collectives need device tensors).
    """

    def __init__(self, group: Any = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPolicyLearner needs an initialised process group (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # NCCL collectives only take device tensors; gloo takes CPU tensors.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """This rank's rows of a mini-batch: token-balanced (``posttrain.learner.ranks.balanced_shards``)
        when ``lengths`` are given, else ``rows[rank::world_size]``."""
        if lengths is None:
            return list(rows)[self.rank :: self.world_size]
        from posttrain.learner.ranks import balanced_shards

        return balanced_shards(rows, lengths, self.world_size)[self.rank]

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """SUM all-reduce of every trainable gradient, flattened into one buffer (one collective).

        A parameter without a gradient on this rank (its shard never reached it) gets zeros when
        any other rank has one, so every rank steps the same parameters."""
        params = list(params)
        if not params:
            return
        dev = params[0].device
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=dev)
        dist.all_reduce(has, op=dist.ReduceOp.MAX, group=self.group)
        live = [p for p, h in zip(params, has.tolist(), strict=True) if h]
        if not live:
            return
        for p in live:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in live])  # type: ignore[union-attr]
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.group)
        off = 0
        for p in live:
            n = p.numel()
            p.grad.copy_(flat[off : off + n].view_as(p))  # type: ignore[union-attr]
            off += n

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """SUM over ranks (a new tensor on ``values``' device)."""
        return all_reduce_copy(values, dist.ReduceOp.SUM, self.device, self.group)

    def reduce_min(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise MIN over ranks (a new tensor on ``values``' device)."""
        return all_reduce_copy(values, dist.ReduceOp.MIN, self.device, self.group)

    def check_same_weights(self, model: torch.nn.Module) -> None:
        """All ranks must start from the same weights: compare a float64 sum + sum of squares."""
        with torch.no_grad():
            s = torch.zeros(2, dtype=torch.float64)
            for p in model.parameters():
                q = p.detach().to("cpu", torch.float64)
                s[0] += q.sum()
                s[1] += (q * q).sum()
        lo, hi = self.reduce_min(s), -self.reduce_min(-s)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"rank {self.rank}: ranks start from different weights (checksums {lo.tolist()} vs {hi.tolist()})"
            )


class DistributedPolicyLearner(PolicyLearner):
    """A :class:`PolicyLearner` built with a :class:`ProcessGroupSync` hook — nothing overridden.

    Construct it on every rank with identical arguments and weights (same ``seed``), after
    :func:`init_process_group`. ``update`` / ``compute_gradients`` / ``compute_logprobs`` are called
    on every rank with the same batch; results (metrics, gradients, log-probs) are identical on all
    ranks. ``group`` defaults to the world.
    """

    def __init__(self, model: torch.nn.Module, *, group: Any = None, **kwargs: Any) -> None:
        sync = ProcessGroupSync(group)
        super().__init__(model, grad_sync=sync, **kwargs)
        self.rank, self.world_size = sync.rank, sync.world_size
        sync.check_same_weights(self.model)

    def shard(self, rows: Sequence[int]) -> list[int]:
        """This rank's rows of a mini-batch: ``rows[rank::world_size]``."""
        return self.grad_sync.shard(rows)


def _take_batch_rows(batch: TrajectoryBatch, rows: Sequence[int]) -> TrajectoryBatch:
    """The sub-batch of ``rows`` (kept for callers; see :meth:`TrajectoryBatch.select_rows`)."""
    return batch.select_rows(rows)


def run_ranks(fn: Any, world_size: int, *args: Any, timeout_s: float = 300.0) -> None:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, port, *args)`` on 127.0.0.1.

    ``fn`` must be importable (module level). Bounded: a rank still running after ``timeout_s``
    is killed and ``TimeoutError`` raised; a rank that fails raises ``RuntimeError`` with its exit code.
    """
    import torch.multiprocessing as mp

    port = free_port()
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=fn, args=(r, world_size, port, *args)) for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = _now() + timeout_s
    try:
        for p in procs:
            p.join(max(0.0, deadline - _now()))
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


def _now() -> float:
    import time

    return time.monotonic()


__all__ = ["DistributedPolicyLearner", "ProcessGroupSync", "free_port", "init_process_group", "run_ranks"]
