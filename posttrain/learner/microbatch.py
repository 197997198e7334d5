"""Micro-batching by a token budget, and row slicing of padded tensors.

A micro-batch is the unit of one forward/backward pass; several of them accumulate into one
optimizer step (a mini-batch). Grouping by a *token* budget rather than a fixed row count
bounds activation memory when response lengths vary by orders of magnitude. Which rows
share a micro-batch never changes the update: the learner passes mini-batch-global counts
to the reduction, so the micro-batch losses sum exactly to the mini-batch loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

#: Per-row tensors of a batch by name (``[B, T, ...]`` or ``[B]``); ``None`` for an absent optional one.
RowTensors = Mapping[str, torch.Tensor | None]


def split_by_token_budget(
    lengths: Sequence[int], budget: int, *, max_rows: int | None = None
) -> list[list[int]]:
    """Partition row indices ``0..len(lengths)-1`` into micro-batches within a token budget.

    Contract: for every group ``g``, ``len(g) * max(lengths[i] for i in g) <= budget`` (the
    padded size after trimming to the group's longest row), except that a single row longer
    than ``budget`` forms its own group; ``len(g) <= max_rows`` when given. Every index
    appears exactly once.

    Algorithm (deterministic): rows are sorted by decreasing length, ties by index, and filled
    greedily, so each group's first row sets its padded width; indices inside a group are
    returned ascending and groups in fill order. The result depends only on ``lengths``.
    """
    if budget < 1:
        raise ValueError(f"token budget must be >= 1, got {budget}")
    if max_rows is not None and max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    lens = [int(n) for n in lengths]
    for i, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"row {i}: negative length {n}")
    order = sorted(range(len(lens)), key=lambda i: (-lens[i], i))
    groups: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for i in order:
        # Sorted by decreasing length: the group's first row is its widest.
        fits = cur and (len(cur) + 1) * width <= budget and (max_rows is None or len(cur) < max_rows)
        if fits:
            cur.append(i)
            continue
        if cur:
            groups.append(sorted(cur))
        cur, width = [i], max(lens[i], 1)
    if cur:
        groups.append(sorted(cur))
    return groups


def take_rows(
    tensors: Mapping[str, torch.Tensor | None], rows: Sequence[int], width: int | None = None
) -> dict[str, torch.Tensor | None]:
    """Select ``rows`` of every ``[B, T, ...]`` tensor and keep the first ``width`` columns.

    ``None`` entries stay ``None``; 1-D ``[B]`` tensors are row-selected only. ``width=None``
    keeps every column. Trimming columns past the longest selected row is exact for a causal
    model with right padding (those columns are padding for every selected row).
    """
    out: dict[str, torch.Tensor | None] = {}
    for name, t in tensors.items():
        if t is None:
            out[name] = None
            continue
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=t.device)
        sel = t.index_select(0, idx)
        out[name] = sel[:, :width] if (width is not None and sel.dim() >= 2) else sel
    return out


class Microbatch:
    """One forward/backward pass: the batch rows it holds (``rows``, positions in the batch) and their
    tensors trimmed to the pass's longest row. ``mb[name]`` is a present tensor (``KeyError`` when it is
    absent or ``None``); :meth:`optional` reads one that may be ``None``."""

    def __init__(self, rows: Sequence[int], tensors: dict[str, torch.Tensor | None]) -> None:
        self.rows = list(rows)
        self._tensors = tensors

    def __getitem__(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        if t is None:
            raise KeyError(f"micro-batch tensor {name!r} is None")
        return t

    def __setitem__(self, name: str, value: torch.Tensor) -> None:
        self._tensors[name] = value

    def optional(self, name: str) -> torch.Tensor | None:
        """The tensor ``name``, or ``None`` when the batch has none."""
        return self._tensors[name]

    @property
    def row_index(self) -> torch.Tensor:
        """``rows`` as a CPU ``long`` tensor (to scatter per-row results into ``[B, ...]`` buffers)."""
        return torch.as_tensor(self.rows, dtype=torch.long)


def microbatches(tensors: RowTensors, rows: Sequence[int], budget: int | None) -> list[Microbatch]:
    """The micro-batches of mini-batch ``rows``: :func:`split_by_token_budget` over the rows' lengths
    (``tensors["attention_mask"]`` row sums) with ``budget`` (``None``: one micro-batch of every row),
    each trimmed by :func:`take_rows` to its longest row. Rows keep their order inside a group; no rows,
    no micro-batch."""
    if not rows:
        return []
    am = tensors["attention_mask"]
    if am is None:
        raise ValueError("micro-batching needs an attention_mask")
    lengths = am.sum(dim=1)
    sub = [int(lengths[r]) for r in rows]
    groups = [list(range(len(rows)))] if budget is None else split_by_token_budget(sub, budget)
    out = []
    for g in groups:
        idx = [rows[i] for i in g]
        out.append(Microbatch(idx, take_rows(tensors, idx, max(1, max(sub[i] for i in g)))))
    return out


def minibatch_rows(num_rows: int, num_minibatches: int, generator: torch.Generator) -> list[list[int]]:
    """Shuffle ``range(num_rows)`` with ``generator`` and cut it into ``num_minibatches`` parts.

    Part sizes differ by at most one (``torch.tensor_split``); each part's indices are sorted
    ascending so the part, not the draw order, defines it. The generator is advanced by one
    ``randperm`` draw, so saving its state makes the shuffle resumable.
    """
    if not 1 <= num_minibatches <= num_rows:
        raise ValueError(
            f"num_minibatches must be in [1, {num_rows}] (rows in the batch), got {num_minibatches}"
        )
    perm = torch.randperm(num_rows, generator=generator)
    return [sorted(p.tolist()) for p in torch.tensor_split(perm, num_minibatches)]
