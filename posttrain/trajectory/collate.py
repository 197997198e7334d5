"""Trajectories <-> padded learner tensors.

Right padding to the longest sequence ``T`` of the batch. Every tensor is ``[B, T]`` and keeps
the record's alignment: position ``t`` concerns token ``t``. The learner's forward pass predicts
token ``t`` from logits at ``t - 1``; it shifts, the contract does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from posttrain.trajectory.enums import ROLE_CODES, Role
from posttrain.trajectory.record import Trajectory, TrajectoryError


@dataclasses.dataclass
class TrajectoryBatch:
    """Padded tensors of a list of trajectories (all ``[B, T]`` unless noted): the one typed batch
    of an update step.

    The loop collates a step's trajectories once; everything the learner freezes or derives is then
    attached to this object as tensors (:meth:`freeze`, :meth:`with_targets`) — never written back
    into the records and re-collated — and the records are rebuilt once, for the ledger, by
    :func:`with_update_record`.

    From the records (:func:`collate`):

    - ``input_ids`` long; padding positions hold ``pad_token_id``
    - ``attention_mask`` long: 1 on real tokens (prompt, action, observation, system)
    - ``action_mask`` float: 1 only on policy-generated tokens
    - ``role_codes`` long: ``ROLE_CODES`` of each token, padding -> ``ROLE_CODES[Role.PADDING]``
    - ``behavior_logprob`` / ``old_logprob`` / ``ref_logprob`` float64, 0 off the action mask;
      ``old_logprob`` / ``ref_logprob`` are ``None`` unless every trajectory has them
    - ``behavior_version`` long, -1 off the action mask
    - ``lengths`` ``[B]`` long: real length of each row
    - ``teacher_logprob`` float64, 0 off the action mask: the distillation teacher's (``loss.distill``),
      ``None`` unless every trajectory has it, or until :meth:`freeze` attaches it

    Attached during the step (``None`` until then):

    - ``old_version`` / ``ref_version``: the learner version ``old_logprob`` / ``ref_logprob`` were
      frozen under by :meth:`freeze` (``None``: the tensors, if any, came from the records)
    - ``values`` float64 ``V(s_t)``, 0 off the action mask, and ``final_values`` ``[B]`` (the
      bootstrap of a truncated row): the critic's frozen values (``CriticLearner.compute_values``)
    - ``advantages`` (``[B, T]``, or ``[B]`` one per row) and ``returns`` (``[B, T]``, ``None``
      for estimators without one): the targets the actor and critic updates train on
    """

    trajectories: list[Trajectory]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    action_mask: torch.Tensor
    role_codes: torch.Tensor
    behavior_logprob: torch.Tensor
    behavior_version: torch.Tensor
    old_logprob: torch.Tensor | None
    ref_logprob: torch.Tensor | None
    lengths: torch.Tensor
    pad_token_id: int
    old_version: int | None = None
    ref_version: int | None = None
    values: torch.Tensor | None = None
    final_values: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None
    teacher_logprob: torch.Tensor | None = None

    @property
    def size(self) -> int:
        """Number of rows ``B``."""
        return len(self.trajectories)

    def freeze(self, field: str, logprob: torch.Tensor, version: int | None = None) -> TrajectoryBatch:
        """This batch with ``{field}_logprob`` (``'old'``, ``'ref'`` or ``'teacher'``) frozen from
        ``logprob [B, T]``.

        Stored float64 on CPU, times the action mask (0 elsewhere), with ``{field}_version = version``
        for the ledger (:func:`with_update_record` writes both into each row's record). ``'old'`` and
        ``'ref'`` need their ``version``; the distillation teacher has none (it never changes).
        """
        if field not in ("old", "ref", "teacher"):
            raise ValueError(f"field must be 'old' or 'ref' (or 'teacher' with loss.distill), got {field!r}")
        if tuple(logprob.shape) != tuple(self.input_ids.shape):
            raise TrajectoryError(f"{field}_logprob has shape {tuple(logprob.shape)}, batch is "
                                  f"{tuple(self.input_ids.shape)}")
        lp = logprob.detach().to("cpu", torch.float64) * self.action_mask.to(torch.float64)
        if field == "teacher":
            if version is not None:
                raise ValueError("the teacher's log-probs have no version (the teacher is frozen)")
            return dataclasses.replace(self, teacher_logprob=lp)
        if version is None:
            raise ValueError(f"freeze({field!r}, ...) needs the version the log-probs were computed under")
        if field == "old":
            return dataclasses.replace(self, old_logprob=lp, old_version=int(version))
        return dataclasses.replace(self, ref_logprob=lp, ref_version=int(version))

    def with_targets(self, **tensors: torch.Tensor | None) -> TrajectoryBatch:
        """This batch with any of ``values`` / ``final_values`` / ``advantages`` / ``returns`` set.

        Shapes are checked: ``final_values`` ``[B]``, ``advantages`` ``[B, T]`` or ``[B]``, the others
        ``[B, T]``; a name outside these four is an error. Tensors are stored as given (no copy).
        """
        B, T = tuple(self.input_ids.shape)
        allowed: dict[str, list[tuple[int, ...]]] = {
            "values": [(B, T)], "final_values": [(B,)], "advantages": [(B, T), (B,)], "returns": [(B, T)]}
        for name, v in tensors.items():
            if name not in allowed:
                raise TypeError(f"with_targets: unknown field {name!r}; valid: {', '.join(allowed)}")
            if v is not None and tuple(v.shape) not in allowed[name]:
                raise TrajectoryError(f"{name} has shape {tuple(v.shape)}, expected one of {allowed[name]}")
        return dataclasses.replace(self, **tensors)  # type: ignore[arg-type]

    def select_rows(self, rows: Sequence[int]) -> TrajectoryBatch:
        """The sub-batch of ``rows`` in that order: same width ``T``, every tensor row-selected."""
        idx = torch.as_tensor(list(rows), dtype=torch.long)
        changes: dict[str, object] = {"trajectories": [self.trajectories[i] for i in rows]}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                changes[f.name] = v.index_select(0, idx)
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]


_NP_DTYPES: dict[torch.dtype, type[np.generic]] = {torch.long: np.int64, torch.float32: np.float32,
                                                    torch.float64: np.float64}


def _pad(rows: Sequence[np.ndarray], T: int, fill: float | int, dtype: torch.dtype) -> torch.Tensor:
    # Filled in numpy and handed to torch once: a torch slice assignment per row costs ~10x more.
    out = np.full((len(rows), T), fill, dtype=_NP_DTYPES[dtype])
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return torch.from_numpy(out)


def collate(trajectories: Sequence[Trajectory], pad_token_id: int = 0) -> TrajectoryBatch:
    """Pad ``trajectories`` into a :class:`TrajectoryBatch` (see its docstring for layout)."""
    trajs = list(trajectories)
    if not trajs:
        raise TrajectoryError("collate: empty list of trajectories")
    T = max(t.length for t in trajs)
    pad_code = ROLE_CODES[Role.PADDING]

    def opt(name: str) -> torch.Tensor | None:
        vals = [getattr(t, name) for t in trajs]
        if any(v is None for v in vals):
            return None
        return _pad(vals, T, 0.0, torch.float64)

    return TrajectoryBatch(
        trajectories=trajs,
        input_ids=_pad([t.token_ids for t in trajs], T, pad_token_id, torch.long),
        attention_mask=(torch.arange(T)[None, :] < torch.tensor([t.length for t in trajs])[:, None]).long(),
        action_mask=_pad([t.action_mask for t in trajs], T, 0, torch.float32),
        role_codes=_pad([np.array([ROLE_CODES[r] for r in t.roles]) for t in trajs], T, pad_code, torch.long),
        behavior_logprob=_pad([t.behavior_logprob for t in trajs], T, 0.0, torch.float64),
        behavior_version=_pad([t.behavior_version for t in trajs], T, -1, torch.long),
        old_logprob=opt("old_logprob"),
        ref_logprob=opt("ref_logprob"),
        lengths=torch.tensor([t.length for t in trajs], dtype=torch.long),
        pad_token_id=pad_token_id,
        teacher_logprob=opt("teacher_logprob"),
    )


def token_field_to_rows(batch: TrajectoryBatch, values: torch.Tensor) -> list[np.ndarray]:
    """Cut a ``[B, T]`` tensor back into per-trajectory float64 arrays, 0.0 off the action mask."""
    if tuple(values.shape) != tuple(batch.input_ids.shape):
        raise TrajectoryError(f"values have shape {tuple(values.shape)}, batch is {tuple(batch.input_ids.shape)}")
    masked = (values.detach().to(torch.float64) * batch.action_mask.to(torch.float64)).cpu().numpy()
    return [masked[i, : int(n)].copy() for i, n in enumerate(batch.lengths.tolist())]


def with_update_record(
    batch: TrajectoryBatch, current_logprob: torch.Tensor | None, advantages: torch.Tensor
) -> list[Trajectory]:
    """The batch's trajectories with what the update saw: ``current_logprob`` and ``advantage``,
    and the coordinates frozen on the batch (old / ref log-probs and versions, cut to each row's length)
    — one validated record per row, the step's only rebuild of its records.

    ``current_logprob`` ``[B, T]`` (pi_theta per token as the update's last optimiser step saw it,
    :attr:`PolicyLearner.last_current_logprob`) or ``None`` (not recorded); a row whose action
    tokens hold a non-finite value (never forwarded by this process) records ``None``.
    ``advantages`` ``[B, T]`` or ``[B]`` (one per row, broadcast): the values passed to the update.
    Both are stored 0.0 off the action mask, as the update masks them.
    """
    B, T = tuple(batch.input_ids.shape)
    adv = advantages.detach().to("cpu", torch.float64)
    if adv.dim() == 1:
        adv = adv[:, None].expand(B, T)
    adv_rows = token_field_to_rows(batch, adv)
    cur_rows: list[np.ndarray | None] = [None] * B
    if current_logprob is not None:
        cur = current_logprob.detach().to("cpu", torch.float64)
        on = batch.action_mask > 0
        # NaN * 0 is NaN: zero the padding first so only action tokens can mark a row unseen.
        cur = torch.where(on, cur, torch.zeros_like(cur))
        cur_rows = [r if np.isfinite(r).all() else None for r in token_field_to_rows(batch, cur)]
    return [t.replace(current_logprob=c, advantage=a, **kw)
            for t, c, a, kw in zip(batch.trajectories, cur_rows, adv_rows, _frozen_rows(batch), strict=True)]


def _frozen_rows(batch: TrajectoryBatch) -> list[dict[str, object]]:
    """Per row, the ``{old,ref}_logprob`` / ``_version`` record fields the batch froze (:meth:`freeze`),
    and ``teacher_logprob`` (no version), cut to the row's length; empty dicts when it froze none."""
    frozen: dict[str, tuple[np.ndarray, int | None]] = {}
    for field in ("old", "ref"):
        lp, version = getattr(batch, f"{field}_logprob"), getattr(batch, f"{field}_version")
        if lp is not None and version is not None:
            frozen[field] = (lp.detach().to("cpu", torch.float64).numpy(), version)
    if batch.teacher_logprob is not None:
        frozen["teacher"] = (batch.teacher_logprob.detach().to("cpu", torch.float64).numpy(), None)
    rows: list[dict[str, object]] = []
    for i, n in enumerate(batch.lengths.tolist()):
        kw: dict[str, object] = {}
        for field, (col, version) in frozen.items():
            kw[f"{field}_logprob"] = col[i, :n].copy()
            if version is not None:
                kw[f"{field}_version"] = version
        rows.append(kw)
    return rows
