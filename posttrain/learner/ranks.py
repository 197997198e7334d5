"""Learner ranks as processes the loop drives: ``ddp`` and ``fsdp2`` over ``torch.distributed``.

The driver (the loop's process) keeps orchestrating rollout, reward and ledger. :class:`LearnerRanks`
stands where the embedded :class:`~posttrain.learner.actor.PolicyLearner` stands (``run.parts.learner``)
and forwards every learner call to ``world_size`` ranks through a
:class:`~posttrain.learner.rank_transport.RankTransport`: by default rank processes on this machine
(``torch.multiprocessing`` spawn, one pipe each, a process group over 127.0.0.1: gloo on CPU, NCCL on
CUDA); with ``start_ranks`` e.g. Ray actors on other nodes
(``posttrain.loop.backends.ray_learner``). Every rank runs the
same :class:`PolicyLearner` update code; only its :mod:`~posttrain.learner.grad_sync` hook differs:

- ``ddp``: :class:`~posttrain.learner.distributed.ProcessGroupSync` — a full replica per rank,
  gradients SUM-all-reduced as one flat buffer;
- ``fsdp2``: :class:`~posttrain.learner.distributed.ShardedSync` — the model is ``fully_shard``-ed (every ``nn.ModuleList`` child,
  then the root), so parameters, gradients and AdamW state are sharded; FSDP's gradient
  reduce-scatter is made a SUM (``set_gradient_divide_factor(1)``) because the reduction weights
  already carry the mini-batch-global counts (``posttrain/algos/reductions.py``).

Each mini-batch is split over ranks by :func:`~posttrain.learner.distributed.balanced_shards` (token-balanced, deterministic);
inside a rank the rows are micro-batched by ``microbatch_tokens`` as always. FSDP's forward and
backward are collectives, so a ``lockstep`` hook makes every rank run the same number of passes
(a short rank pads with zero-weight passes; :func:`posttrain.learner.primitives.forward_backward`).
The ranks serve the learner's primitives (:mod:`~posttrain.learner.primitives`; the command table
:data:`~posttrain.learner.rank_process.COMMANDS`): :meth:`LearnerRanks.minibatch_plan` (every rank draws from
an identically seeded generator: the in-process learner's plan), :meth:`LearnerRanks.forward_backward` (the
batch's tensors parked on the ranks once, then each mini-batch's message is its rows, token count and
pickled loss; gradients reduced among the ranks and kept there) and :meth:`LearnerRanks.optim_step`; so a
trainer program runs on them unchanged. :meth:`LearnerRanks.update` is that RL program as ONE command
(no message per mini-batch; the same result, tests/learner/test_rank_primitives.py). A loss with its own
forward (``forward_backward_custom``) is refused. ``forward_backward`` always runs on the ranks; a phase
that trains the driver copy itself with its own optimiser (the SFT warm-up) runs the primitive on
:meth:`LearnerRanks.driver_context`, explicitly.

After an update (or an ``optim_step`` that ends one) the ranks stream the weights to the driver in buckets of at most
``weight_bucket_bytes`` (:func:`~posttrain.learner.rank_process.weight_buckets`; FSDP: each bucket's shards all-gathered with
``DTensor.full_tensor()``, one bucket at a time); rank 0 packs each with
:func:`~posttrain.rollout.weight_transfer.pack_state_dict` (versioned, blake2b checksum) and the
driver verifies it before copying it into its own CPU copy (:attr:`LearnerRanks.model`) — the copy
evaluation and checkpoints use, and the engine sync unless the transport published the buckets
(Ray actors with ``system.ray.weight_sync=direct``: rank 0's actor puts each bucket in Ray's object
store and the driver fetches its copy from there): then :meth:`LearnerRanks.weights_for_rollout`
hands the engines the references, and each engine fetches and verifies the buckets itself.
Weights the driver writes itself reach the ranks because the writer says so, through the learner:
:meth:`LearnerRanks.load_weights` (a rejected revision restoring the promoted weights: pushed at once),
:meth:`LearnerRanks.mark_driver_written` (a resume's ``restore_actor`` into the copy) and
:meth:`LearnerRanks.driver_context` (the SFT warm-up trains the copy) mark the copy written, and a marked
copy is pushed to the ranks before their next call (unless that call loads the ranks' weights itself).
Checkpoints are sharded (:meth:`LearnerRanks.save_sharded`,
:mod:`~posttrain.learner.sharded_checkpoint`); :meth:`LearnerRanks.state_dict` still gives the
embedded learner's format (an id-keyed full AdamW state, gathered on rank 0).

Faults: every call waits on the ranks' messages in 0.5 s slices and checks the ranks; a rank
that exits (SIGKILL included, or its Ray actor / node dies) fails the call within that slice, a rank that stays silent past
``rank_timeout_s`` fails it then; either way all ranks are killed and :class:`LearnerRankError`
names the rank. The run's checkpoints are untouched, so ``resume=true`` continues from the last one.

This module is the driver's side; what a rank process runs is :mod:`posttrain.learner.rank_process`.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import pickle
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from posttrain.learner.grad_sync import LocalSync
from posttrain.learner.microbatch import RowTensors
from posttrain.learner.optim_step import StepOutcome
from posttrain.learner.primitives import (
    ForwardBackwardOutput,
    ForwardContext,
    LossBatch,
    TokenLoss,
    UpdateOutput,
)
from posttrain.learner.protocol import KLCoefficient
from posttrain.learner.rank_process import RankLearnerFactory, RankSpec, WeightBucket
from posttrain.learner.rank_transport import (
    LearnerRankError,
    RankTransport,
    SpawnedRanks,
    StartRanks,
    collect_replies,
    send_all,
)
from posttrain.learner.trainer import MinibatchLoss
from posttrain.rollout.weight_transfer import PublishedBucket, PublishedWeights
from posttrain.trajectory.collate import TrajectoryBatch

log = logging.getLogger(__name__)


class LearnerRanks:
    """The driver's handle on ``world_size`` learner rank processes; used where a PolicyLearner is.

    ``model``: the driver's full CPU copy (it becomes :attr:`model`; each rank gets a pickled copy).
    ``learner_factory``: see :class:`~posttrain.learner.rank_process.RankSpec`. ``kl_coef``: a float or a controller kept here (the
    loop updates it); its current value is sent with every update. ``temperature`` / ``top_k`` /
    ``top_p`` must equal the ranks' learner's. ``weight_bucket_bytes``: see :func:`~posttrain.learner.rank_process.weight_buckets`;
    ``corrupt_bucket``: test hook (rank 0 alters that bucket after checksumming it). Calls block until
    every rank answers; see the module docstring for faults.
    """

    def __init__(self, model: torch.nn.Module, learner_factory: RankLearnerFactory, *, strategy: str,
                 world_size: int, temperature: float, kl_coef: float | KLCoefficient = 0.0, device: str = "cpu",
                 precision: str = "fp32", rank_timeout_s: float = 600.0, startup_timeout_s: float = 120.0,
                 grad_divide_factor: float = 1.0, drop_rank: int | None = None, top_k: int = 0,
                 top_p: float = 1.0, weight_bucket_bytes: int = 64 << 20,
                 corrupt_bucket: int | None = None, start_ranks: StartRanks | None = None,
                 microbatch_tokens: int | None = None) -> None:
        if strategy not in ("ddp", "fsdp2"):
            raise ValueError(f"learner.strategy must be ddp or fsdp2 for rank processes, got {strategy!r}")
        self.model = model
        self.strategy, self.world_size = strategy, world_size
        self.temperature = float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)  # the ranks' learner's (the reference model reads them)
        self.kl_coef = kl_coef
        self.microbatch_tokens = microbatch_tokens  # the driver-side forward_backward's budget
        self.rank_timeout_s = float(rank_timeout_s)
        self.version = 0
        self.optimizer_steps = 0
        self.last_weights_checksum: str | None = None  # blake2b over the last update's bucket checksums
        self.last_weight_buckets = 0
        self._published: list[PublishedBucket] = []  # the last update's buckets in a shared store, if any
        self._on_bucket: Callable[[WeightBucket], None] | None = None  # set while an update streams its weights
        self._parked: tuple[int, tuple[tuple[str, int], ...], RowTensors] | None = None  # the ranks' batch
        self._batches = 0  # batch ids sent with prepare
        threads = max(1, torch.get_num_threads() // world_size)
        spec = RankSpec(model=model, learner_factory=learner_factory, strategy=strategy, device=device,
                        precision=precision, threads=threads, collective_timeout_s=rank_timeout_s,
                        grad_divide_factor=grad_divide_factor, drop_rank=drop_rank,
                        weight_bucket_bytes=int(weight_bucket_bytes), corrupt_bucket=corrupt_bucket)
        self.transport: RankTransport | None = (start_ranks or SpawnedRanks)(world_size, pickle.dumps(spec))
        self._placement_reported = False
        try:
            self.pids: list[int] = self._collect("start", startup_timeout_s)
            self.placement: dict[int, str] = dict(self.transport.where())
            log.info("learner ranks (%s x %d): %s", strategy, world_size,
                     ", ".join(f"rank {r} on {w}" for r, w in sorted(self.placement.items())))
        except BaseException:
            self.close(kill=True)
            raise
        self._driver_written = False  # the driver copy holds weights the ranks do not (mark_driver_written)

    # ------------------------------------------------------------------ plumbing
    def _live(self) -> RankTransport:
        if self.transport is None:
            raise LearnerRankError("learner ranks are closed")
        return self.transport

    def _fail(self, msg: str) -> NoReturn:
        self.close(kill=True)
        raise LearnerRankError(msg)

    def _collect(self, cmd: str, timeout_s: float) -> list[Any]:
        """Every rank's reply to ``cmd`` (:func:`~posttrain.learner.rank_transport.collect_replies`); a dead,
        failing or silent rank fails the call and every rank is killed."""
        try:
            return collect_replies(self._live(), cmd, timeout_s, self._on_bucket)
        except LearnerRankError:
            self.close(kill=True)
            raise

    def _call(self, cmd: str, *args: object) -> list[Any]:
        if self.transport is None:
            raise LearnerRankError(f"learner ranks are closed ({cmd})")
        if self._driver_written and cmd not in ("load_weights", "load_state", "load_sharded"):
            self.push_weights()
        try:
            send_all(self._live(), cmd, args)
        except LearnerRankError:
            self.close(kill=True)
            raise
        return self._collect(cmd, self.rank_timeout_s)

    def push_weights(self) -> None:
        """Send the driver copy's weights to every rank (after the driver changed them itself)."""
        sd = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        self._call("load_weights", sd)
        self._driver_written = False
        self._published = []  # they hold the weights the driver replaced

    def load_weights(self, state: Mapping[str, torch.Tensor]) -> None:
        """Write ``state`` (a state dict of :attr:`model`) into the driver copy and push it to every rank now
        (a rejected revision restoring the promoted weights, :class:`~posttrain.loop.promotion.Promotion`);
        afterwards the driver copy and every rank's weights equal ``state``."""
        with torch.no_grad():
            self.model.load_state_dict(state)
        self.push_weights()

    def mark_driver_written(self) -> None:
        """The driver copy :attr:`model` was written in place outside the ranks (a resume's ``restore_actor``):
        its weights are pushed to the ranks before their next call (none when that call loads the ranks'
        weights from shards, :meth:`load_sharded`), and the last update's published buckets no longer stand
        for it (:meth:`weights_for_rollout`)."""
        self._driver_written = True
        self._published = []

    # ------------------------------------------------------------------ the learner interface
    def can_fuse_old_logprob(self) -> bool:
        """False: pi_old is computed by the ranks' no-grad forward (fusing needs one process)."""
        return False

    def current_kl_coef(self) -> float:
        """beta: the float ``kl_coef`` or the controller's current ``.value``."""
        return float(self.kl_coef) if isinstance(self.kl_coef, (int, float)) else float(self.kl_coef.value)

    def compute_logprobs(self, batch: TrajectoryBatch) -> torch.Tensor:
        """Frozen log-probs ``[B, T]`` (float64, CPU) from the ranks (see PolicyLearner.compute_logprobs)."""
        out: torch.Tensor = self._call("logprobs", batch)[0]
        return out

    def forward_backward(self, batch: LossBatch, loss: TokenLoss) -> ForwardBackwardOutput:
        """:meth:`PolicyLearner.forward_backward <posttrain.learner.actor.PolicyLearner.forward_backward>` on
        the ranks: each runs its token-balanced shard of ``batch.rows``, the gradients are reduced by the
        ranks' gradient hook and stay there until :meth:`optim_step`. Returns rank 0's loss and metrics (global
        over ranks) and the log-probs of every rank's rows. The batch's tensors go to the ranks once (a
        ``prepare`` when ``batch.tensors`` holds other tensor objects than the last batch's; they must not be
        changed in place in between), then each call sends only the rows, ``num_tokens`` and the pickled loss
        (:class:`LearnerRankError` naming the loss type when it does not pickle). Always on the ranks, whatever
        mode the driver copy is in (a phase that trains the driver copy uses :meth:`driver_context`)."""
        blob = _pickled_loss(loss)
        batch_id = self._park(batch.tensors)
        outs: list[ForwardBackwardOutput] = self._call("forward_backward", batch_id, list(batch.rows),
                                                       float(batch.num_tokens), blob)
        return _merged_output(outs)

    def driver_context(self) -> ForwardContext:
        """The driver copy's side of :func:`~posttrain.learner.primitives.forward_backward`, for a phase that
        trains :attr:`model` itself with its own optimiser (the SFT warm-up,
        :func:`~posttrain.learner.sft.run_sft`): one process, no mixed precision, the gradients landing in
        :attr:`model`. Handing it out marks the copy written (:meth:`mark_driver_written`): the changed weights
        reach the ranks before their next call, so the phase finishes its steps before it calls the learner
        again (a write after that call is marked again)."""
        self.mark_driver_written()
        return ForwardContext(model=self.model, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              microbatch_tokens=self.microbatch_tokens, entropy_chunk_size=None,
                              compute_dtype=_compute_dtype(self.model), autocast=contextlib.nullcontext,
                              grad_mode=contextlib.nullcontext, grad_sync=LocalSync(),
                              params=[p for p in self.model.parameters() if p.requires_grad])

    def _park(self, tensors: RowTensors) -> int:
        """The ranks' id of ``tensors``: sent once (``prepare``, replacing the batch parked before)."""
        key = tuple((k, id(v)) for k, v in tensors.items())
        if self._parked is None or self._parked[1] != key:
            batch_id, self._parked = self._batches, None
            self._batches += 1
            self._call("prepare", batch_id, {k: v.detach().to("cpu") if v is not None else None
                                             for k, v in tensors.items()})
            self._parked = (batch_id, key, dict(tensors))  # the references keep the ids unique
        return self._parked[0]

    def forward_backward_custom(self, rows: list[int], loss: MinibatchLoss) -> ForwardBackwardOutput:
        """Refused: a :class:`~posttrain.learner.trainer.MinibatchLoss` runs its own forward on the model it
        holds — the driver copy (e.g. the online pair loss) — with its data inside; pickled to a rank it would
        train that copy, not the rank's (sharded) replica. The trainers that use it refuse ``learner.strategy``."""
        raise LearnerRankError("learner ranks run token losses only (forward_backward); a custom loss "
                               f"{type(loss).__name__} runs its own forward and needs the in-process learner")

    def minibatch_plan(self, num_rows: int) -> list[list[int]]:
        """The mini-batches of one update (PolicyLearner.minibatch_plan): every rank draws from its shuffle
        generator (all in the same state, seeded by ``batching.seed``), so the plan is the in-process
        learner's for the same seed; rank 0's is returned after checking that every rank drew the same."""
        plans: list[list[list[int]]] = self._call("minibatch_plan", int(num_rows))
        if any(p != plans[0] for p in plans[1:]):
            self._fail("learner ranks drew different mini-batch plans (their shuffle generators diverged)")
        return plans[0]

    def optim_step(self, *, ends_update: bool = True) -> StepOutcome:
        """PolicyLearner.optim_step on every rank (clip / skip / AdamW + schedule over the gradients the
        :meth:`forward_backward` calls reduced; zeroed after). ``ends_update``: :attr:`version` + 1 and the
        ranks stream the new weights into the driver copy, checked as after :meth:`update`."""
        if ends_update:
            outcome, _ = self._streamed("optim_step", True)
        else:
            outcome, _, version, self.optimizer_steps = self._call("optim_step", False)[0]
            if version != self.version:
                self._fail(f"learner rank 0 reports version {version} after a step within update {self.version}")
        assert isinstance(outcome, StepOutcome)
        return outcome

    def update(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
               old_logprob: torch.Tensor | None = None, fuse_old: bool = False) -> UpdateOutput:
        """One update on every rank (PolicyLearner.update's contract and metrics) as ONE command — the same
        program as :meth:`minibatch_plan` / :meth:`forward_backward` / :meth:`optim_step` run from here, without
        a message per mini-batch; then the driver copy takes rank 0's weights after checking their version and
        checksum."""
        if fuse_old:
            raise ValueError("fuse_old is not available with learner ranks (can_fuse_old_logprob is False)")
        metrics, stream = self._streamed("update", batch, advantages, old_logprob, self.current_kl_coef())
        metrics = dict(metrics)
        metrics["learner/world_size"] = float(self.world_size)
        metrics["learner/weight_buckets"] = float(self.last_weight_buckets)
        metrics["learner/published_buckets"] = float(len(self._published))  # the engines fetch these themselves
        metrics["time/learner_weight_stream_s"] = stream.seconds  # ranks -> driver copy
        if not self._placement_reported:  # once: the first update's metrics carry where the ranks run
            metrics.update(placement_metrics(self.placement))
            self._placement_reported = True
        return UpdateOutput(metrics)  # pi_old is never fused across processes; pi_theta is not gathered

    def _streamed(self, cmd: str, *args: object) -> tuple[Any, WeightStream]:
        """``cmd`` ends an update: rank 0 streams the new weights, the driver copy loads them
        (:class:`WeightStream`); :attr:`version` / :attr:`optimizer_steps` follow rank 0. Returns the
        command's own reply and the stream."""
        stream = WeightStream(self.model.state_dict(), self.version + 1)
        self._published = []  # the store may drop them once the new ones arrive
        self._on_bucket = stream.load
        try:
            payload, n_buckets, version, steps = self._call(cmd, *args)[0]
        finally:
            self._on_bucket = None
        self._parked = None  # the ranks dropped the update's batch
        stream.finish(n_buckets, version)
        self.version, self.optimizer_steps = version, steps
        self._published = _check_published(self._live().published(version), stream.checksums)
        self.last_weights_checksum = stream.digest.hexdigest()
        self.last_weight_buckets = int(n_buckets)
        return payload, stream

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """The driver copy's state dict (live tensors, as PolicyLearner.weights_for_rollout); when the
        ranks published the last update's buckets and the driver copy is unchanged since, a
        :class:`~posttrain.rollout.weight_transfer.PublishedWeights` carrying them too (an engine
        that reaches the store loads those: ``system.ray.weight_sync=direct``). A driver-side write
        (:meth:`load_weights`, :meth:`mark_driver_written`) drops the published buckets."""
        sd = self.model.state_dict()
        if self._published and self._published[0].version == self.version and not self._driver_written:
            return PublishedWeights(sd, self.version, self._published)
        return sd

    def state_dict(self) -> dict[str, Any]:
        """The embedded learner's format (optimizer id-keyed and full), from rank 0, plus the KL controller."""
        s: dict[str, Any] = dict(self._call("state")[0])
        if not isinstance(self.kl_coef, (int, float)):
            s["kl_controller"] = self.kl_coef.state_dict()
        return s

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (any strategy's / world size's checkpoint). A driver copy marked written
        (a resume: ``restore_actor`` then :meth:`mark_driver_written`) is pushed to the ranks first."""
        missing = {"optimizer", "scheduler", "generator", "version", "optimizer_steps"} - set(state)
        if missing:
            raise ValueError(f"policy learner state is missing {sorted(missing)}")
        if self._driver_written:
            self.push_weights()  # weights first: FSDP's optimizer-state load follows the parameters
        core = {k: state[k] for k in ("optimizer", "scheduler", "generator", "version", "optimizer_steps")}
        self._call("load_state", core)
        self.version, self.optimizer_steps = int(state["version"]), int(state["optimizer_steps"])
        if "kl_controller" in state:
            if isinstance(self.kl_coef, (int, float)):
                raise ValueError("state holds a KL controller but this learner has a fixed kl_coef")
            self.kl_coef.load_state_dict(state["kl_controller"])

    def save_sharded(self, directory: Path) -> dict[str, Any]:
        """Every rank writes its shards of model + optimizer state into ``directory`` (DCP), the driver
        writes the files' ``manifest.json``; returns the small rest of the state for
        ``learner_state.pt`` (no tensor of the optimizer: see :mod:`posttrain.learner.sharded_checkpoint`)."""
        from posttrain.learner.sharded_checkpoint import write_manifest

        replies = self._call("save_sharded", str(directory))
        core: dict[str, Any] = dict(replies[0][1])
        write_manifest(directory, [files for files, _ in replies], with_optimizer=bool(core["optimizer_in_shards"]))
        if not isinstance(self.kl_coef, (int, float)):
            core["kl_controller"] = self.kl_coef.state_dict()
        return core

    def load_sharded(self, directory: Path, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`save_sharded` on any world size / strategy (DCP reshards on load); the
        files were verified against the manifest by the caller. The ranks take the weights from the
        shards, so the driver copy (loaded from the same checkpoint's ``actor/``) counts as in sync."""
        self._call("load_sharded", str(directory), dict(state))
        self._driver_written = False
        self._published = []
        self.version, self.optimizer_steps = int(state["version"]), int(state["optimizer_steps"])
        if "kl_controller" in state:
            if isinstance(self.kl_coef, (int, float)):
                raise ValueError("state holds a KL controller but this learner has a fixed kl_coef")
            self.kl_coef.load_state_dict(state["kl_controller"])

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``close`` command, then kill whatever is left after 5 s); idempotent."""
        t, self.transport = self.transport, None
        if t is None:
            return
        if not kill:
            for r in range(self.world_size):
                try:
                    t.send(r, pickle.dumps(("close", ())))
                except Exception:  # noqa: BLE001 - a dead rank
                    pass
        t.close(0.0 if kill else 5.0)


class WeightStream:
    """The driver copy's side of one weight stream: :meth:`load` checks each :class:`WeightBucket` of rank 0
    (its index in order, ``version``, the packet's checksum, names and shapes that fit ``mine``) and copies
    it into ``mine`` (the driver copy's state dict); :meth:`finish` checks the count and that every weight
    arrived. ``digest``: blake2b over the bucket checksums; ``seconds``: first arrival to last load."""

    def __init__(self, mine: Mapping[str, torch.Tensor], version: int) -> None:
        self.mine, self.version = mine, version
        self.got: list[str] = []
        self.checksums: list[str] = []  # per bucket, as verified here
        self.digest = hashlib.blake2b(digest_size=16)
        self._t = [0.0, 0.0]

    @property
    def seconds(self) -> float:
        """Monotonic seconds from the first bucket's arrival to the last bucket loaded."""
        return self._t[1] - self._t[0]

    def load(self, bucket: WeightBucket) -> None:
        """Check one bucket and copy it into the driver copy (a ``LearnerRankError`` / ``ValueError`` otherwise)."""
        received = len(self.checksums)
        if received == 0:
            self._t[0] = time.monotonic()
        index, packet, checksum, version = bucket.index, bucket.packet, bucket.checksum, bucket.version
        if index != received or version != self.version:
            raise LearnerRankError(f"weight bucket {index} v{version} arrived, expected bucket {received} "
                                   f"v{self.version}")
        packet.verify(version=version, checksum=checksum, where=f"driver (weight bucket {index} from learner rank 0)")
        sd = packet.tensors(read_only_views=True)  # only copied into the driver copy below
        unexpected = sorted(k for k in sd if k not in self.mine or self.mine[k].shape != sd[k].shape)
        if unexpected:
            raise LearnerRankError(f"weight bucket {index} does not fit the model: {unexpected[:3]}")
        with torch.no_grad():
            for k, v in sd.items():
                self.mine[k].copy_(v)
        self.got.extend(sd)
        self.checksums.append(checksum)
        self._t[1] = time.monotonic()
        self.digest.update(checksum.encode())

    def finish(self, n_buckets: int, version: int) -> None:
        """Rank 0's reply after streaming: its version is the expected one, it sent ``n_buckets`` buckets,
        all of them arrived, and they cover every weight (a tied weight once)."""
        if version != self.version:
            raise LearnerRankError(f"learner rank 0 reports version {version} after an update to {self.version}")
        if n_buckets != len(self.checksums):
            raise LearnerRankError(f"learner rank 0 streamed {n_buckets} weight buckets, the driver got "
                                   f"{len(self.checksums)}")
        missing = set(self.mine) - set(self.got)
        if len(self.got) != len(set(self.got)) or any(not _is_alias(self.mine, k) for k in missing):
            raise LearnerRankError(f"learner rank 0 sent weights that do not cover the model: missing "
                                   f"{sorted(missing)[:3]}")


def _pickled_loss(loss: TokenLoss) -> bytes:
    """``loss`` pickled for the ranks; one-line :class:`LearnerRankError` naming its type when it does not pickle."""
    try:
        return pickle.dumps(loss)
    except Exception as e:  # noqa: BLE001 - PicklingError, TypeError, AttributeError: all say the same here
        raise LearnerRankError(f"the token loss {type(loss).__name__} cannot be sent to the learner ranks: "
                               f"it does not pickle ({type(e).__name__}: {e})".splitlines()[0][:500]) from None


def _merged_output(outs: list[ForwardBackwardOutput]) -> ForwardBackwardOutput:
    """Rank 0's output (loss and metrics are reduced over the ranks) with every rank's log-probs: each rank's
    ``logprob`` is NaN off the rows it forwarded, and a row is forwarded by one rank."""
    lp = outs[0].logprob
    for o in outs[1:]:
        if lp is not None and o.logprob is not None:
            lp = torch.where(torch.isnan(lp), o.logprob, lp)
    return ForwardBackwardOutput(logprob=lp, loss=outs[0].loss, metrics=outs[0].metrics)


def _check_published(buckets: list[PublishedBucket], checksums: list[str]) -> list[PublishedBucket]:
    """The transport's published buckets of this update, when they are exactly the buckets the
    driver copy loaded (same count, order, version and checksums); else a failure."""
    if buckets and [(b.index, b.checksum) for b in buckets] != list(enumerate(checksums)):
        raise LearnerRankError(f"learner rank 0 published weight buckets {[b.index for b in buckets]} that are not "
                               f"the {len(checksums)} buckets it streamed")
    return buckets


def placement_metrics(placement: Mapping[int, str]) -> dict[str, float]:
    """``learner/nodes`` (distinct places) and ``learner/rank<r>_node``: each rank's place as an index
    into the sorted distinct places (two ranks share a node iff their indices are equal)."""
    nodes = sorted(set(placement.values()))
    out = {"learner/nodes": float(len(nodes))}
    out.update({f"learner/rank{r}_node": float(nodes.index(w)) for r, w in sorted(placement.items())})
    return out


def _compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """float64 for a float64 model, else float32 (as the policy learner's)."""
    return torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32


def _is_alias(sd: Mapping[str, torch.Tensor], key: str) -> bool:
    """True when ``sd[key]`` shares storage with another entry (a tied weight gathered once)."""
    t = sd[key]
    return any(k != key and v.data_ptr() == t.data_ptr() for k, v in sd.items())


__all__ = ["LearnerRankError", "LearnerRanks", "WeightStream", "placement_metrics"]
