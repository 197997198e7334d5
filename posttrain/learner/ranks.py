"""Learner ranks as processes the loop drives: ``ddp`` and ``fsdp2`` over ``torch.distributed``.

The driver (the loop's process) keeps orchestrating rollout, reward and ledger. :class:`LearnerRanks`
stands where the embedded :class:`~posttrain.learner.actor.PolicyLearner` stands (``run.learner``)
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
The ranks run ``update`` (the RL program over their primitives) as one command; a driver-side
:meth:`LearnerRanks.forward_backward` runs on the driver copy (the SFT warm-up's gradients, stepped by the
warm-up's own optimiser), and :meth:`LearnerRanks.optim_step` is refused (the ranks step inside ``update``).

After an update the ranks stream the weights to the driver in buckets of at most
``weight_bucket_bytes`` (:func:`~posttrain.learner.rank_process.weight_buckets`; FSDP: each bucket's shards all-gathered with
``DTensor.full_tensor()``, one bucket at a time); rank 0 packs each with
:func:`~posttrain.rollout.weight_transfer.pack_state_dict` (versioned, blake2b checksum) and the
driver verifies it before copying it into its own CPU copy (:attr:`LearnerRanks.model`) — the copy
evaluation and checkpoints use, and the engine sync unless the transport published the buckets
(Ray actors with ``system.ray.weight_sync=direct``: rank 0's actor puts each bucket in Ray's object
store and the driver fetches its copy from there): then :meth:`LearnerRanks.weights_for_rollout`
hands the engines the references, and each engine fetches and verifies the buckets itself.
Weights the driver changes itself (SFT warm-up, a rejected revision restoring the promoted
weights, a resume) are detected by the tensors' in-place version counters and pushed to the ranks
before their next call. Checkpoints are sharded (:meth:`LearnerRanks.save_sharded`,
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
import logging
import pickle
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from posttrain.learner.grad_sync import LocalSync
from posttrain.learner.optim_step import StepOutcome
from posttrain.learner.primitives import (
    ForwardBackwardOutput,
    ForwardContext,
    LossBatch,
    TokenLoss,
    UpdateOutput,
    forward_backward,
)
from posttrain.learner.protocol import KLCoefficient
from posttrain.learner.rank_process import RankLearnerFactory, RankSpec, WeightBucket
from posttrain.learner.rank_transport import RankTransport, SpawnedRanks, StartRanks
from posttrain.learner.trainer import MinibatchLoss
from posttrain.rollout.weight_transfer import PublishedBucket, PublishedWeights
from posttrain.trajectory.collate import TrajectoryBatch

_POLL_S = 0.5  # liveness check interval while waiting for ranks
log = logging.getLogger(__name__)


class LearnerRankError(RuntimeError):
    """A learner rank died, failed or stayed silent; the message names the rank(s)."""


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
        self._synced = self._fingerprint()

    # ------------------------------------------------------------------ plumbing
    def _fingerprint(self) -> tuple[int, ...]:
        # In-place writes (load_state_dict, an optimizer step) bump a tensor's version counter.
        return tuple(t._version for t in self.model.state_dict().values())

    def _live(self) -> RankTransport:
        if self.transport is None:
            raise LearnerRankError("learner ranks are closed")
        return self.transport

    def _send(self, cmd: str, *args: object) -> None:
        payload = pickle.dumps((cmd, args))
        t = self._live()
        for r in range(self.world_size):
            try:
                t.send(r, payload)
            except OSError:
                self._fail(f"learner rank {r} is gone ({self._exit_reason(r)}) before {cmd}")

    def _exit_reason(self, r: int) -> str:
        t = self._live()
        reason = t.exit_reason(r) or "still running"
        where = t.where().get(r, "")
        return reason if where == "this machine" or not where else f"{reason}; on {where}"

    def _fail(self, msg: str) -> None:
        self.close(kill=True)
        raise LearnerRankError(msg)

    def _collect(self, cmd: str, timeout_s: float) -> list[Any]:
        """Every rank's reply to ``cmd``; a dead, failing or silent rank fails the call (ranks killed)."""
        t = self._live()
        n = self.world_size
        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < n:
            pending = [r for r in range(n) if r not in replies]
            for r in t.ready(pending, _POLL_S):
                try:
                    status, value = t.recv(r)
                except EOFError:
                    self._fail(f"learner rank {r} died during {cmd} ({self._exit_reason(r)})")
                if status == "bucket" and r == 0 and self._on_bucket is not None:
                    try:
                        if not isinstance(value, WeightBucket):
                            raise TypeError(f"a bucket message holds a {type(value).__name__}")
                        self._on_bucket(value)
                    except Exception as e:  # noqa: BLE001 - a bad bucket ends the run (the driver copy is half-loaded)
                        self._fail(f"learner rank 0 sent a bad weight bucket during {cmd}: "
                                   f"{type(e).__name__}: {e}".splitlines()[0][:500])
                    continue
                if status != "ok":
                    self._fail(f"learner rank {r} failed during {cmd}: {value}")
                replies[r] = value
            for r in range(n):
                if r not in replies and t.exit_reason(r) is not None:
                    self._fail(f"learner rank {r} died during {cmd} ({self._exit_reason(r)})")
            if time.monotonic() > deadline and len(replies) < n:
                silent = sorted(set(range(n)) - set(replies))
                self._fail(f"learner rank(s) {silent} did not answer {cmd} within {timeout_s:g}s "
                           "(learner.rank_timeout_s)")
        return [replies[r] for r in range(n)]

    def _call(self, cmd: str, *args: object) -> list[Any]:
        if self.transport is None:
            raise LearnerRankError(f"learner ranks are closed ({cmd})")
        if cmd not in ("load_weights", "load_state", "load_sharded") and self._fingerprint() != self._synced:
            self.push_weights()
        self._send(cmd, *args)
        return self._collect(cmd, self.rank_timeout_s)

    def push_weights(self) -> None:
        """Send the driver copy's weights to every rank (after the driver changed them itself)."""
        sd = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        self._call("load_weights", sd)
        self._synced = self._fingerprint()
        self._published = []  # they hold the weights the driver replaced

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
        """:func:`~posttrain.learner.primitives.forward_backward` on the driver copy (:attr:`model`, one process,
        no mixed precision): its gradients are the driver's, for a phase that steps the driver copy with its own
        optimiser (the SFT warm-up); the changed weights reach the ranks before their next call."""
        ctx = ForwardContext(model=self.model, temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                             microbatch_tokens=self.microbatch_tokens, entropy_chunk_size=None,
                             compute_dtype=_compute_dtype(self.model), autocast=contextlib.nullcontext,
                             grad_mode=contextlib.nullcontext, grad_sync=LocalSync(),
                             params=[p for p in self.model.parameters() if p.requires_grad])
        return forward_backward(ctx, batch, loss)

    def forward_backward_custom(self, rows: list[int], loss: MinibatchLoss) -> ForwardBackwardOutput:
        """Refused: a loss with its own forward trains in one process (the trainers that use it refuse
        ``learner.strategy``)."""
        raise LearnerRankError("learner ranks run only the RL update; a custom loss needs the in-process learner")

    def minibatch_plan(self, num_rows: int) -> list[list[int]]:
        """Refused: the ranks draw their mini-batches inside :meth:`update`."""
        raise LearnerRankError("learner ranks draw their mini-batches inside update()")

    def optim_step(self, *, ends_update: bool = True) -> StepOutcome:
        """Refused: the ranks hold the optimiser and step it inside :meth:`update` (one command per update)."""
        raise LearnerRankError("learner ranks step their optimiser inside update(); optim_step is not sent over "
                               "the rank transport (learner.strategy=ddp|fsdp2)")

    def update(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
               old_logprob: torch.Tensor | None = None, fuse_old: bool = False) -> UpdateOutput:
        """One update on every rank (PolicyLearner.update's contract and metrics); then the driver copy
        takes rank 0's gathered weights after checking their version and checksum."""
        if fuse_old:
            raise ValueError("fuse_old is not available with learner ranks (can_fuse_old_logprob is False)")
        import hashlib

        mine = self.model.state_dict()
        got: list[str] = []
        got_checksums: list[str] = []  # per bucket, as verified here
        received = [0]
        stream_s = [0.0, 0.0]  # monotonic time of the first bucket's arrival, of the last bucket loaded
        digest = hashlib.blake2b(digest_size=16)

        def load_bucket(bucket: WeightBucket) -> None:
            if received[0] == 0:
                stream_s[0] = time.monotonic()
            index, packet, checksum, version = bucket.index, bucket.packet, bucket.checksum, bucket.version
            if index != received[0] or version != self.version + 1:
                raise LearnerRankError(f"weight bucket {index} v{version} arrived, expected bucket {received[0]} "
                                       f"v{self.version + 1}")
            packet.verify(version=version, checksum=checksum, where=f"driver (weight bucket {index} from learner rank 0)")
            sd = packet.tensors(read_only_views=True)  # only copied into the driver copy below
            unexpected = sorted(k for k in sd if k not in mine or mine[k].shape != sd[k].shape)
            if unexpected:
                raise LearnerRankError(f"weight bucket {index} does not fit the model: {unexpected[:3]}")
            with torch.no_grad():
                for k, v in sd.items():
                    mine[k].copy_(v)
            got.extend(sd)
            got_checksums.append(checksum)
            received[0] += 1
            stream_s[1] = time.monotonic()
            digest.update(checksum.encode())

        self._published = []  # the store may drop them once the new ones arrive
        self._on_bucket = load_bucket
        try:
            metrics, n_buckets, version, steps = self._call(
                "update", batch, advantages, old_logprob, self.current_kl_coef())[0]
        finally:
            self._on_bucket = None
        if version != self.version + 1:
            raise LearnerRankError(f"learner rank 0 reports version {version} after an update from {self.version}")
        if n_buckets != received[0]:
            raise LearnerRankError(f"learner rank 0 streamed {n_buckets} weight buckets, the driver got {received[0]}")
        missing = set(mine) - set(got)
        if len(got) != len(set(got)) or any(not _is_alias(mine, k) for k in missing):
            raise LearnerRankError(f"learner rank 0 sent weights that do not cover the model: missing "
                                   f"{sorted(missing)[:3]}")
        self._synced = self._fingerprint()
        self.version, self.optimizer_steps = version, steps
        self._published = self._check_published(self._live().published(version), got_checksums)
        self.last_weights_checksum = digest.hexdigest()
        self.last_weight_buckets = int(n_buckets)
        metrics = dict(metrics)
        metrics["learner/world_size"] = float(self.world_size)
        metrics["learner/weight_buckets"] = float(self.last_weight_buckets)
        metrics["learner/published_buckets"] = float(len(self._published))  # the engines fetch these themselves
        metrics["time/learner_weight_stream_s"] = stream_s[1] - stream_s[0]  # ranks -> driver copy
        if not self._placement_reported:  # once: the first update's metrics carry where the ranks run
            metrics.update(placement_metrics(self.placement))
            self._placement_reported = True
        return UpdateOutput(metrics)  # pi_old is never fused across processes; pi_theta is not gathered

    def _check_published(self, buckets: list[PublishedBucket], checksums: list[str]) -> list[PublishedBucket]:
        """The transport's published buckets of this update, when they are exactly the buckets the
        driver copy loaded (same count, order, version and checksums); else a failure."""
        if buckets and [(b.index, b.checksum) for b in buckets] != list(enumerate(checksums)):
            raise LearnerRankError(f"learner rank 0 published weight buckets {[b.index for b in buckets]} that are not "
                                   f"the {len(checksums)} buckets it streamed")
        return buckets

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """The driver copy's state dict (live tensors, as PolicyLearner.weights_for_rollout); when the
        ranks published the last update's buckets and the driver copy is unchanged since, a
        :class:`~posttrain.rollout.weight_transfer.PublishedWeights` carrying them too (an engine
        that reaches the store loads those: ``system.ray.weight_sync=direct``)."""
        sd = self.model.state_dict()
        if self._published and self._published[0].version == self.version and self._fingerprint() == self._synced:
            return PublishedWeights(sd, self.version, self._published)
        return sd

    def state_dict(self) -> dict[str, Any]:
        """The embedded learner's format (optimizer id-keyed and full), from rank 0, plus the KL controller."""
        s: dict[str, Any] = dict(self._call("state")[0])
        if not isinstance(self.kl_coef, (int, float)):
            s["kl_controller"] = self.kl_coef.state_dict()
        return s

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Inverse of :meth:`state_dict` (any strategy's / world size's checkpoint)."""
        missing = {"optimizer", "scheduler", "generator", "version", "optimizer_steps"} - set(state)
        if missing:
            raise ValueError(f"policy learner state is missing {sorted(missing)}")
        if self._fingerprint() != self._synced:
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
        self._synced = self._fingerprint()
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


__all__ = ["LearnerRankError", "LearnerRanks", "placement_metrics"]
