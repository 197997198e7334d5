"""Data-parallel policy learner over ``torch.distributed`` (gloo on CPU; NCCL/FSDP2 on GPUs).

Every rank holds the same model and optimizer state and receives the same rollout batch (the
driver's collated batch; it is small next to the model). For every mini-batch (the same shuffle on
every rank: the generator is seeded identically), rank ``r`` of ``W`` runs forward/backward on its
shard ``rows[r::W]`` only, with the reduction weights computed from the *mini-batch-global* counts
(``num_sequences = |M|``, ``num_tokens = N(M)``) instead of its shard's. Because a reduction is a
weight function of the row and the global counts (``posttrain/algos/reductions.py``), the shard
losses sum exactly to the mini-batch loss ``L(M)``, so the SUM all-reduce of the shard gradients
is ``dL(M)/dtheta`` — the single-process gradient, up to float summation order (float64: ~1e-15
relative). Gradient clipping and the AdamW step then run identically on every rank, so the
weights stay bitwise equal across ranks.

This is the split invariance the single-process learner already has across micro-batches
(``docs/learner.md``), extended across processes. The shard is a row subset, so micro-batching
by ``microbatch_tokens`` still applies inside each rank.

GPUs: the same class works with the NCCL backend (one GPU per rank, model on ``cuda:rank``). For
models that do not fit one GPU, the sharding of parameters is FSDP2's job
(``torch.distributed.fsdp.fully_shard``): its gradient reduce-scatter is a SUM/MEAN over ranks, and
with the global-count reduction weights here it must be a SUM (set the FSDP gradient divide factor
to 1). That path is documented in ``docs/distributed.md`` and not exercised by the CPU tests.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from posttrain.learner.actor import PolicyLearner, _Acc


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


class DistributedPolicyLearner(PolicyLearner):
    """:class:`PolicyLearner` whose mini-batch gradient is split over the ranks of a process group.

    Construct it on every rank with identical arguments and weights (same ``seed``), after
    :func:`init_process_group`. ``update`` / ``compute_gradients`` / ``compute_logprobs`` are called
    on every rank with the same batch; results (metrics, gradients, log-probs) are identical on all
    ranks. ``group`` defaults to the world.
    """

    def __init__(self, model: torch.nn.Module, *, group: Any = None, **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedPolicyLearner needs an initialised process group (init_process_group)")
        super().__init__(model, **kwargs)
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self._global_counts: tuple[int, float] | None = None
        self._check_same_weights()

    # ------------------------------------------------------------------ sanity
    def _check_same_weights(self) -> None:
        """All ranks must start from the same weights: compare a float64 sum + sum of squares."""
        with torch.no_grad():
            s = torch.zeros(2, dtype=torch.float64)
            for p in self.model.parameters():
                q = p.detach().to("cpu", torch.float64)
                s[0] += q.sum()
                s[1] += (q * q).sum()
        lo, hi = s.clone(), s.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=self.group)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=self.group)
        if not torch.equal(lo, hi):
            raise RuntimeError(f"rank {self.rank}: ranks start from different weights (checksums {lo.tolist()} vs {hi.tolist()})")

    # ------------------------------------------------------------------ the split
    def shard(self, rows: Sequence[int]) -> list[int]:
        """This rank's rows of a mini-batch: ``rows[rank::world_size]``."""
        return list(rows)[self.rank :: self.world_size]

    def _reduction_weights(self, mask: torch.Tensor, num_sequences: int, num_tokens: float) -> torch.Tensor:
        # The shard's own counts are replaced by the mini-batch-global ones (see the module docstring).
        if self._global_counts is not None:
            num_sequences, num_tokens = self._global_counts
        return super()._reduction_weights(mask, num_sequences, num_tokens)

    def _accumulate(self, t: Mapping[str, torch.Tensor | None], rows: Sequence[int], acc: _Acc) -> float:
        """Shard forward/backward with global counts, then SUM all-reduce of gradients and diagnostics."""
        mask_all = t["loss_mask"]
        assert mask_all is not None
        rows = list(rows)
        num_tokens = float(mask_all[rows].sum())  # the batch is replicated: global counts are local
        if num_tokens == 0:
            return 0.0
        mine = self.shard(rows)
        before = _snapshot(acc)
        self._global_counts = (len(rows), num_tokens)
        try:
            if mine:
                super()._accumulate(t, mine, acc)
        finally:
            self._global_counts = None
        self._allreduce_grads()
        self._allreduce_acc(acc, before)
        return num_tokens

    def _allreduce_grads(self) -> None:
        """SUM all-reduce of every trainable gradient, flattened into one buffer (one collective)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        has = torch.tensor([p.grad is not None for p in params], dtype=torch.int32)
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

    def _allreduce_acc(self, acc: _Acc, before: dict[str, Any]) -> None:
        """Make the metric accumulators global: sums added over ranks, ratio extrema min/max-reduced."""
        keys = ["loss", "pg_loss", "kl_loss", "entropy_loss", "tokens", "kl_sum", "entropy_sum", "ratio_sum"]
        diag_before: dict[str, float] = before["diag_sums"]
        diag_now = {k: acc.diag_sums.get(k, 0.0) - diag_before.get(k, 0.0) for k in acc.diag_sums}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(diag_now), group=self.group)
        diag_keys = sorted({k for ks in gathered for k in ks})
        vec = torch.tensor([getattr(acc, k) - before[k] for k in keys] + [diag_now.get(k, 0.0) for k in diag_keys],
                           dtype=torch.float64)
        dist.all_reduce(vec, op=dist.ReduceOp.SUM, group=self.group)
        for i, k in enumerate(keys):
            setattr(acc, k, before[k] + float(vec[i]))
        for j, k in enumerate(diag_keys):
            acc.diag_sums[k] = diag_before.get(k, 0.0) + float(vec[len(keys) + j])
        ext = torch.tensor([acc.ratio_min, -acc.ratio_max], dtype=torch.float64)
        dist.all_reduce(ext, op=dist.ReduceOp.MIN, group=self.group)
        acc.ratio_min, acc.ratio_max = float(ext[0]), -float(ext[1])

    # ------------------------------------------------------------------ log-probs
    def compute_logprobs(self, batch: Any) -> torch.Tensor:
        """Each rank computes its rows ``[rank::world_size]``, then a SUM all-reduce assembles ``[B, T]``.

        Rows are computed independently (no cross-row reduction in a forward pass), so the result
        equals the single-process one exactly. Falls back to the parent when ``B < world_size``.
        """
        B = batch.size
        if B < self.world_size:
            return super().compute_logprobs(batch)
        mine = self.shard(range(B))
        sub = _take_batch_rows(batch, mine)
        lp_mine = super().compute_logprobs(sub)
        full = torch.zeros(tuple(batch.input_ids.shape), dtype=torch.float64)
        full[mine, : lp_mine.shape[1]] = lp_mine
        dist.all_reduce(full, op=dist.ReduceOp.SUM, group=self.group)
        return full


def _snapshot(acc: _Acc) -> dict[str, Any]:
    d = {f.name: getattr(acc, f.name) for f in dataclasses.fields(acc) if f.name not in ("diag_sums", "grad_norms")}
    d["diag_sums"] = dict(acc.diag_sums)
    return d


def _take_batch_rows(batch: Any, rows: Sequence[int]) -> Any:
    """The sub-batch of ``rows`` (same width ``T``; tensors row-selected)."""
    idx = torch.as_tensor(list(rows), dtype=torch.long)
    changes: dict[str, Any] = {"trajectories": [batch.trajectories[i] for i in rows]}
    for f in dataclasses.fields(batch):
        v = getattr(batch, f.name)
        if isinstance(v, torch.Tensor):
            changes[f.name] = v.index_select(0, idx)
    return dataclasses.replace(batch, **changes)


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


__all__ = ["DistributedPolicyLearner", "free_port", "init_process_group", "run_ranks"]
