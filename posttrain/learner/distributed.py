"""Data-parallel gradient hooks over ``torch.distributed`` (gloo on CPU; NCCL on GPUs).

The learner ranks (:mod:`posttrain.learner.ranks`, ``learner.strategy`` ddp / fsdp2) build the same
:class:`~posttrain.learner.actor.PolicyLearner` on every rank with one of the
:class:`~posttrain.learner.grad_sync.GradientSync` hooks defined here; the learner's update code is
never overridden.

Every rank holds the same model and optimizer state and receives the same rollout batch. For
every mini-batch (the same shuffle on every rank: the generator is seeded identically), rank ``r``
of ``W`` runs forward/backward on its shard only (:func:`balanced_shards`), with the reduction
weights computed from the *mini-batch-global* counts (``num_sequences = |M|``, ``num_tokens =
N(M)``) instead of its shard's. Because a reduction is a weight function of the row and the global
counts (``posttrain/algos/reductions.py``), the shard losses sum exactly to the mini-batch loss
``L(M)``, so the SUM all-reduce of the shard gradients is ``dL(M)/dtheta`` -- the single-process
gradient, up to float summation order (shards are other GEMM shapes; ``tests/_tolerance.py`` states
the bound the tests use). Gradient clipping and the AdamW step then run identically on every rank,
so the weights stay bitwise equal across ranks. This is the split invariance the single-process
learner already has across micro-batches (``docs/learner.md``), extended across processes; the
shard is a row subset, so micro-batching by ``microbatch_tokens`` still applies inside each rank.

- :class:`ProcessGroupSync` (``ddp``): a full replica per rank, gradients SUM-all-reduced as one
  flat buffer;
- :class:`ShardedSync` (``fsdp2``): FSDP's gradient reduce-scatter must be a SUM (divide factor 1)
  with the global-count reduction weights; it runs inside the backward passes, so the hook only
  reduces metrics and asks for lockstep passes;
- :class:`DropRankShare`: a test hook around either (one rank's share lost), which the equality
  tests must catch.

Data-parallel SGD with a SUM all-reduce of per-shard gradients is the scheme of Goyal et al.,
"Accurate, Large Minibatch SGD" (2017); FSDP is Zhao et al., "PyTorch FSDP" (VLDB 2023).
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist


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


def all_reduce_copy(values: torch.Tensor, op: dist.ReduceOp.RedOpType, device: torch.device | str,
                    group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``op`` over ranks of a copy of ``values`` made on the collective's ``device`` (NCCL needs device
    tensors, gloo CPU ones); the result comes back on ``values``' device, ``values`` is untouched."""
    out = values.to(device, copy=True)
    dist.all_reduce(out, op=op, group=group)
    return out.to(values.device)


def balanced_shards(rows: Sequence[int], lengths: Sequence[int], world_size: int) -> list[list[int]]:
    """Split ``rows`` over ``world_size`` ranks with balanced token counts (greedy LPT).

    ``lengths[i]`` is the token count of ``rows[i]``. Rows are taken by decreasing length (ties:
    position) and each goes to the rank holding the fewest tokens so far (ties: lowest rank), so
    no rank holds more than the mean plus one row's tokens (Graham, "Bounds on multiprocessing
    timing anomalies", 1969). Every row lands in exactly one shard; each shard is ascending.
    Deterministic: every rank computes the same split.
    """
    if len(rows) != len(lengths):
        raise ValueError(f"{len(rows)} rows but {len(lengths)} lengths")
    order = sorted(range(len(rows)), key=lambda i: (-int(lengths[i]), i))
    load = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for i in order:
        r = min(range(world_size), key=lambda k: (load[k], len(shards[k]), k))
        shards[r].append(rows[i])
        load[r] += max(int(lengths[i]), 1)
    return [sorted(s) for s in shards]


class ProcessGroupSync:
    """:class:`~posttrain.learner.grad_sync.GradientSync` over a ``torch.distributed`` process group.

    Rank ``r`` of ``W`` computes ``rows[r::W]`` of every mini-batch; gradients are SUM-all-reduced
    as one flat buffer (one collective per mini-batch), metric sums SUM-reduced, ratio extrema
    MIN-reduced. Collectives run on the tensors' own device (CPU tensors for gloo; put the model on
    ``cuda:rank`` for NCCL, whose collectives need device tensors).
    """

    lockstep = False

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ProcessGroupSync needs an initialised process group (init_process_group)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # NCCL collectives only take device tensors; gloo takes CPU tensors.
        nccl = dist.get_backend(group) == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """This rank's rows of a mini-batch: token-balanced (:func:`balanced_shards`) when ``lengths``
        are given, else ``rows[rank::world_size]``."""
        if lengths is None:
            return list(rows)[self.rank :: self.world_size]
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


class ShardedSync:
    """:class:`~posttrain.learner.grad_sync.GradientSync` for an FSDP2 (``fully_shard``) model.

    Gradients need no call here: FSDP reduce-scatters them in every backward, as a SUM (the model's
    gradient divide factor is 1), so each rank's gradient shard already holds the sum over ranks.
    Metric sums and extrema are all-reduced like :class:`ProcessGroupSync`'s. ``lockstep``: FSDP's
    all-gathers run inside every forward, so every rank must run the same number of passes.
    """

    lockstep = True

    def __init__(self, group: dist.ProcessGroup | None = None, device: torch.device | None = None) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ShardedSync needs an initialised process group")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = device or torch.device("cpu")

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """This rank's rows: :func:`balanced_shards` when ``lengths`` are given, else ``rows[rank::W]``."""
        if lengths is None:
            return list(rows)[self.rank :: self.world_size]
        return balanced_shards(rows, lengths, self.world_size)[self.rank]

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Nothing: FSDP's reduce-scatter (a SUM) already ran in the backward passes."""

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """SUM over ranks (a new tensor on ``values``' device)."""
        return all_reduce_copy(values, dist.ReduceOp.SUM, self.device, self.group)

    def reduce_min(self, values: torch.Tensor) -> torch.Tensor:
        """Element-wise MIN over ranks (a new tensor on ``values``' device)."""
        return all_reduce_copy(values, dist.ReduceOp.MIN, self.device, self.group)


class DropRankShare:
    """A :class:`GradientSync` around another that computes nothing on rank ``drop`` (test hook).

    Counts stay global, so the reduced gradient misses that rank's rows: the reduction bug the
    equality tests must catch. Everything else is delegated (composition)."""

    def __init__(self, inner: ProcessGroupSync | ShardedSync, drop: int) -> None:
        self.inner, self.drop = inner, drop
        self.world_size, self.rank = inner.world_size, inner.rank
        self.lockstep = inner.lockstep

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """The inner shard, or — for an update's mini-batch (``lengths`` given) — nothing on the dropped rank."""
        mine = self.inner.shard(rows, lengths=lengths)
        return [] if self.rank == self.drop and lengths is not None else mine

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Delegated."""
        self.inner.reduce_gradients(params)

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """Delegated."""
        return self.inner.reduce_sums(values)

    def reduce_min(self, values: torch.Tensor) -> torch.Tensor:
        """Delegated."""
        return self.inner.reduce_min(values)


__all__ = ["DropRankShare", "ProcessGroupSync", "ShardedSync", "all_reduce_copy", "balanced_shards", "free_port",
           "init_process_group"]
