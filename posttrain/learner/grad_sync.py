"""The gradient-reduction hook of the learners: how a mini-batch is split over processes.

A learner computes a mini-batch's gradient as the sum over its rows of ``w[b, t] * loss[b, t]``
with reduction weights ``w`` taken from the *mini-batch-global* counts (``posttrain/algos/
reductions.py``). Any split of the rows therefore gives partial gradients that SUM to the whole
one. :class:`GradientSync` is the hook that exploits this; the learner calls it at three points:

- ``shard(rows, lengths)``   the rows of the mini-batch this process runs forward/backward on
  (``lengths``: the rows' token counts, for a token-balanced split);
- ``reduce_gradients(ps)``   after the shard's backward: make every ``p.grad`` the SUM over processes;
- ``reduce_sums(vec)`` / ``reduce_min(vec)``  the same for the metric accumulators (token sums,
  ratio extrema), so metrics are global too.

:class:`LocalSync` (the default) is one process: all rows, no communication. The data-parallel
implementation over ``torch.distributed`` is ``posttrain.learner.distributed.ProcessGroupSync``.
A new strategy (another collective library, FSDP's reduce-scatter) is one more class with these
four methods — never a learner subclass. A hook with ``lockstep = True`` (FSDP2:
``posttrain.learner.distributed.ShardedSync``, whose forward and backward passes are collectives) makes
every process run the same number of forward/backward passes per mini-batch; a process with fewer
micro-batches runs zero-weight passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class GradientSync(Protocol):
    """See the module docstring. ``world_size`` > 1 tells the learner to snapshot and reduce metrics."""

    world_size: int

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]: ...

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None: ...

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor: ...

    def reduce_min(self, values: torch.Tensor) -> torch.Tensor: ...


class LocalSync:
    """One process: every row is ours and every reduction is the identity."""

    world_size = 1

    def shard(self, rows: Sequence[int], lengths: Sequence[int] | None = None) -> list[int]:
        """All of ``rows``."""
        return list(rows)

    def reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> None:
        """Nothing to reduce."""

    def reduce_sums(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` unchanged."""
        return values

    def reduce_min(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` unchanged."""
        return values


__all__ = ["GradientSync", "LocalSync"]
