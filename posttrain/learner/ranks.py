"""Learner ranks as processes the loop drives: ``ddp`` and ``fsdp2`` over ``torch.distributed``.

The driver (the loop's process) keeps orchestrating rollout, reward and ledger. :class:`LearnerRanks`
stands where the embedded :class:`~posttrain.learner.actor.PolicyLearner` stands (``run.learner``)
and forwards every learner call to ``world_size`` rank processes (``torch.multiprocessing`` spawn,
one pipe each, a process group over 127.0.0.1: gloo on CPU, NCCL on CUDA). Every rank runs the
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
(a short rank pads with zero-weight passes; ``PolicyLearner._accumulate_rows``).

After an update the ranks stream the weights to the driver in buckets of at most
``weight_bucket_bytes`` (:func:`weight_buckets`; FSDP: each bucket's shards all-gathered with
``DTensor.full_tensor()``, one bucket at a time); rank 0 packs each with
:func:`~posttrain.rollout.weight_transfer.pack_state_dict` (versioned, blake2b checksum) and the
driver verifies it before copying it into its own CPU copy (:attr:`LearnerRanks.model`) — the copy
the engine sync, evaluation and checkpoints use.
Weights the driver changes itself (SFT warm-up, a rejected revision restoring the promoted
weights, a resume) are detected by the tensors' in-place version counters and pushed to the ranks
before their next call. Checkpoints are sharded (:meth:`LearnerRanks.save_sharded`,
:mod:`~posttrain.learner.sharded_checkpoint`); :meth:`LearnerRanks.state_dict` still gives the
embedded learner's format (an id-keyed full AdamW state, gathered on rank 0).

Faults: every call waits on the ranks' pipes in 0.5 s slices and checks the processes; a rank
that exits (SIGKILL included) fails the call within that slice, a rank that stays silent past
``rank_timeout_s`` fails it then; either way all ranks are killed and :class:`LearnerRankError`
names the rank. The run's checkpoints are untouched, so ``resume=true`` continues from the last one.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import signal
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist

from posttrain.learner.actor import KLCoefficient, PolicyLearner
from posttrain.learner.distributed import (
    DropRankShare,
    ProcessGroupSync,
    ShardedSync,
    free_port,
    init_process_group,
)
from posttrain.learner.grad_sync import GradientSync
from posttrain.rollout.weight_transfer import WeightPacket, pack_state_dict
from posttrain.trajectory.collate import TrajectoryBatch

_POLL_S = 0.5  # liveness check interval while waiting for ranks


class LearnerRankError(RuntimeError):
    """A learner rank died, failed or stayed silent; the message names the rank(s)."""


class RankLearnerFactory(Protocol):
    """Builds a rank's learner on its (moved, maybe sharded) model with the rank's gradient hook
    (``posttrain.loop.builders.RankLearnerFactory`` meets it; it must pickle)."""

    def __call__(self, model: torch.nn.Module, *, grad_sync: GradientSync,
                 autocast_dtype: str | None = None) -> PolicyLearner: ...


@dataclasses.dataclass(frozen=True)
class WeightBucket:
    """One bucket of updated weights, rank 0 -> driver: ``checksum`` is the one computed when packing
    (sent beside the packet, so the driver's verification catches bytes changed after it)."""

    index: int
    packet: WeightPacket
    checksum: str
    version: int


@dataclasses.dataclass
class RankSpec:
    """What every rank process builds (pickled once to each rank).

    ``learner_factory(model, grad_sync=..., autocast_dtype=...)`` returns the rank's
    :class:`PolicyLearner` (the loop passes ``posttrain.loop.builders.RankLearnerFactory``).
    ``grad_divide_factor``: FSDP's gradient divisor; 1 (a SUM) is the correct value here — a test
    sets ``world_size`` (FSDP's default MEAN) to show the equality tolerance catches it.
    ``drop_rank``: test hook — that rank's share of every mini-batch is dropped from the gradient
    (:class:`DropRankShare`), the "one rank's gradient lost" reduction bug; None in real runs.
    ``weight_bucket_bytes``: the size bound of one weight bucket (:func:`weight_buckets`).
    """

    model: torch.nn.Module
    learner_factory: RankLearnerFactory
    strategy: str
    device: str = "cpu"
    precision: str = "fp32"
    threads: int = 1
    collective_timeout_s: float = 600.0
    grad_divide_factor: float = 1.0
    drop_rank: int | None = None
    weight_bucket_bytes: int = 64 << 20
    corrupt_bucket: int | None = None  # test hook: rank 0 alters this bucket's bytes after checksumming


# ---------------------------------------------------------------------- rank process side
def _shard_fsdp(model: torch.nn.Module, spec: RankSpec, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if spec.precision == "bf16":
        # float32 master weights (the parameters), bf16 compute, float32 gradient reduction.
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if device.type == "cuda":
        from torch.distributed.device_mesh import init_device_mesh

        kw["mesh"] = init_device_mesh("cuda", (dist.get_world_size(),))
    for m in model.modules():
        if isinstance(m, torch.nn.ModuleList):
            for block in m:
                fully_shard(block, **kw)
    fully_shard(model, **kw)
    for m in model.modules():  # each fully_shard-ed module reduces its own parameters' gradients
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(float(spec.grad_divide_factor))
            # A plain SUM collective (+ a division only when the factor is not 1): for float32 / bf16
            # FSDP would otherwise use PREMUL_SUM, which gloo does not implement.
            m.set_force_sum_reduction_for_comms(True)


def bucket_plan(entries: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[str]]:
    """Group ``(name, full size in bytes)`` entries, in the given order, into consecutive buckets of
    at most ``bucket_bytes`` (a tensor larger than that is a bucket of its own). Every name lands in
    exactly one bucket; order is kept. Deterministic, so every rank computes the same plan."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    plan: list[list[str]] = []
    used = 0
    for name, nbytes in entries:
        if not plan or (used + nbytes > bucket_bytes and plan[-1]):
            plan.append([])
            used = 0
        plan[-1].append(name)
        used += nbytes
    return plan


def weight_buckets(model: torch.nn.Module, bucket_bytes: int, gather: bool) -> Iterator[dict[str, torch.Tensor]]:
    """The model's full weights as a stream of ``{name: full CPU tensor}`` buckets (:func:`bucket_plan`).

    Names: the parameters (a tied parameter once, under its first name) then the persistent buffers,
    in module order. ``gather``: every rank of an FSDP2 model iterates too (``DTensor.full_tensor()``
    all-gathers one bucket's shards at a time, a collective); so at most one bucket of full tensors
    exists on any rank at a time. Without it (ddp: a full replica) only the caller's copies are made.
    """
    from torch.distributed.tensor import DTensor

    sd = model.state_dict(keep_vars=True)
    names = [n for n, _ in model.named_parameters()] + [n for n, _ in model.named_buffers() if n in sd]
    entries = [(n, sd[n].numel() * sd[n].element_size()) for n in names]
    for bucket in bucket_plan(entries, bucket_bytes):
        out: dict[str, torch.Tensor] = {}
        for n in bucket:
            t = sd[n].detach()
            if gather and isinstance(t, DTensor):
                t = t.full_tensor()
            out[n] = t.to("cpu")
        yield out


def _stream_weights(learner: PolicyLearner, fsdp: bool, spec: RankSpec, conn: Connection, rank: int) -> int:
    """Send the updated weights to the driver bucket by bucket (rank 0: one pipe message each,
    versioned + checksummed; the pipe blocks while the driver loads the previous one). Returns the
    bucket count. FSDP2: every rank takes part in each bucket's gather; ddp: only rank 0 works."""
    if not fsdp and rank != 0:
        return 0
    n = 0
    for i, bucket in enumerate(weight_buckets(learner.model, spec.weight_bucket_bytes, gather=fsdp)):
        n += 1
        if rank != 0:
            continue
        packet = pack_state_dict(bucket, learner.version)
        del bucket
        if spec.corrupt_bucket == i:
            packet.buffer[packet.buffer.nbytes // 2] ^= 0xFF
        conn.send_bytes(pickle.dumps(("bucket", WeightBucket(i, packet, packet.checksum, learner.version))))
    return n


def _trainable_names(model: torch.nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters() if p.requires_grad]


def _learner_state(learner: PolicyLearner, fsdp: bool) -> dict[str, Any] | None:
    """Rank 0: the embedded learner's state format (id-keyed full AdamW state); a collective under FSDP."""
    if fsdp and learner.optimizer.state:  # (the same on every rank: they step together)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        osd = get_optimizer_state_dict(learner.model, learner.optimizer,
                                       options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if dist.get_rank() != 0:
            return None
        optim = fqn_to_id_optimizer_state(osd, _trainable_names(learner.model))
    else:
        # ddp, or no optimizer step yet: the optimizer's own (id-keyed) state. Never
        # get_optimizer_state_dict on a stateless optimizer: it initialises the state with a zero-lr
        # step (AdamW step=1), which would change the bias correction of the first real step.
        if dist.get_rank() != 0:
            return None
        optim = learner.optimizer.state_dict()
    return {"optimizer": optim, "scheduler": learner.scheduler.state_dict(),
            "generator": learner.generator.get_state(), "version": learner.version,
            "optimizer_steps": learner.optimizer_steps}


def _load_learner_state(learner: PolicyLearner, state: Mapping[str, Any], fsdp: bool) -> None:
    if not fsdp:
        learner.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    osd = id_to_fqn_optimizer_state(state["optimizer"], _trainable_names(learner.model))
    if osd["state"]:
        set_optimizer_state_dict(learner.model, learner.optimizer, osd, options=StateDictOptions(full_state_dict=True))
    _restore_rest(learner, state, None if osd["state"] else osd["param_groups"])


def _restore_rest(learner: PolicyLearner, state: Mapping[str, Any],
                  param_groups: Sequence[Mapping[str, Any]] | None) -> None:
    """Scheduler, generator and counters from ``state``; with ``param_groups`` (no optimizer step
    taken yet) only the groups' hyper-parameters are restored and AdamW stays stateless:
    set_optimizer_state_dict would first initialise the state with a zero-lr step, leaving step=1,
    which changes the bias correction of the first real step."""
    for live, saved in zip(learner.optimizer.param_groups, param_groups or [], strict=param_groups is not None):
        live.update({k: v for k, v in saved.items() if k != "params"})
    learner.scheduler.load_state_dict(state["scheduler"])
    learner.generator.set_state(state["generator"])
    learner.version = int(state["version"])
    learner.optimizer_steps = int(state["optimizer_steps"])


def _sharded_core(learner: PolicyLearner) -> dict[str, Any]:
    """Rank 0's part of a sharded checkpoint's ``learner_state.pt`` entry: everything but the
    tensors DCP writes (the optimizer's hyper-parameters are kept for a stateless optimizer)."""
    groups = [{k: v for k, v in g.items() if k != "params"} for g in learner.optimizer.param_groups]
    return {"sharded": "learner_dcp", "optimizer_in_shards": bool(learner.optimizer.state),
            "param_groups": groups, "scheduler": learner.scheduler.state_dict(),
            "generator": learner.generator.get_state(), "version": learner.version,
            "optimizer_steps": learner.optimizer_steps}


def _load_sharded_state(learner: PolicyLearner, directory: str, state: Mapping[str, Any]) -> None:
    from posttrain.learner.sharded_checkpoint import load_sharded

    load_sharded(learner.model, learner.optimizer, directory, with_optimizer=bool(state["optimizer_in_shards"]))
    _restore_rest(learner, state, None if state["optimizer_in_shards"] else state["param_groups"])


def _load_weights(learner: PolicyLearner, sd: Mapping[str, torch.Tensor], fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(learner.model, dict(sd), options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        learner.model.load_state_dict(sd)


def _rank_main(rank: int, world_size: int, port: int, conn: Connection, spec_bytes: bytes) -> None:
    """A rank process: build the learner, then serve the driver's commands until ``close``."""
    spec: RankSpec = pickle.loads(spec_bytes)
    torch.set_num_threads(max(1, spec.threads))
    cuda = spec.device == "cuda"
    try:
        if cuda:
            torch.cuda.set_device(rank)
        init_process_group(rank, world_size, port=port, backend="nccl" if cuda else "gloo",
                           timeout_s=spec.collective_timeout_s)
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        model = spec.model.to(device)
        fsdp = spec.strategy == "fsdp2"
        autocast = "bfloat16" if spec.precision == "bf16" and not fsdp else None
        if fsdp:
            _shard_fsdp(model, spec, device)
            inner: ProcessGroupSync | ShardedSync = ShardedSync(device=device)
        else:
            inner = ProcessGroupSync()
            inner.check_same_weights(model)
        sync: GradientSync = inner if spec.drop_rank is None else DropRankShare(inner, spec.drop_rank)
        learner = spec.learner_factory(model, grad_sync=sync, autocast_dtype=autocast)
        conn.send_bytes(pickle.dumps(("ok", os.getpid())))
        while True:
            try:
                cmd, args = pickle.loads(conn.recv_bytes())
            except EOFError:  # the driver is gone
                break
            if cmd == "close":
                conn.send_bytes(pickle.dumps(("ok", None)))
                break
            out: Any = None
            if cmd == "update":
                batch, adv, old, kl_coef = args
                learner.kl_coef = float(kl_coef)
                metrics = learner.update(batch, adv, old_logprob=old)
                n_buckets = _stream_weights(learner, fsdp, spec, conn, rank)
                if rank == 0:
                    out = (metrics, n_buckets, learner.version, learner.optimizer_steps)
            elif cmd == "logprobs":
                lp = learner.compute_logprobs(args[0])
                out = lp if rank == 0 else None
            elif cmd == "state":
                out = _learner_state(learner, fsdp)
            elif cmd == "load_state":
                _load_learner_state(learner, args[0], fsdp)
            elif cmd == "save_sharded":
                from posttrain.learner.sharded_checkpoint import save_sharded

                files = save_sharded(learner.model, learner.optimizer, args[0], rank)
                out = (files, _sharded_core(learner) if rank == 0 else None)
            elif cmd == "load_sharded":
                _load_sharded_state(learner, args[0], args[1])
            elif cmd == "load_weights":
                _load_weights(learner, args[0], fsdp)
            else:
                raise ValueError(f"unknown learner rank command {cmd!r}")
            conn.send_bytes(pickle.dumps(("ok", out)))
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then this rank ends
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}".splitlines()[0][:500])))
        except Exception:  # noqa: BLE001 - the driver may be gone already
            pass
        os._exit(1)
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be dead
                pass


# ---------------------------------------------------------------------- optimizer state formats
def fqn_to_id_optimizer_state(osd: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """A name-keyed full optimizer state (``torch.distributed.checkpoint.state_dict``) -> the id-keyed
    ``optimizer.state_dict()`` format, ids in ``names`` order (the learner's trainable parameters)."""
    index = {n: i for i, n in enumerate(names)}
    state = {index[k]: dict(v) for k, v in osd.get("state", {}).items()}
    groups = [{**g, "params": [index[p] for p in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


def id_to_fqn_optimizer_state(osd: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """Inverse of :func:`fqn_to_id_optimizer_state`."""
    state = {names[int(k)]: dict(v) for k, v in osd.get("state", {}).items()}
    groups = [{**g, "params": [names[int(p)] for p in g["params"]]} for g in osd["param_groups"]]
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------- driver side
class LearnerRanks:
    """The driver's handle on ``world_size`` learner rank processes; used where a PolicyLearner is.

    ``model``: the driver's full CPU copy (it becomes :attr:`model`; each rank gets a pickled copy).
    ``learner_factory``: see :class:`RankSpec`. ``kl_coef``: a float or a controller kept here (the
    loop updates it); its current value is sent with every update. ``temperature`` / ``top_k`` /
    ``top_p`` must equal the ranks' learner's. ``weight_bucket_bytes``: see :func:`weight_buckets`;
    ``corrupt_bucket``: test hook (rank 0 alters that bucket after checksumming it). Calls block until
    every rank answers; see the module docstring for faults.
    """

    def __init__(self, model: torch.nn.Module, learner_factory: RankLearnerFactory, *, strategy: str,
                 world_size: int, temperature: float, kl_coef: float | KLCoefficient = 0.0, device: str = "cpu",
                 precision: str = "fp32", rank_timeout_s: float = 600.0, startup_timeout_s: float = 120.0,
                 grad_divide_factor: float = 1.0, drop_rank: int | None = None, top_k: int = 0,
                 top_p: float = 1.0, weight_bucket_bytes: int = 64 << 20,
                 corrupt_bucket: int | None = None) -> None:
        import multiprocessing as mp

        if strategy not in ("ddp", "fsdp2"):
            raise ValueError(f"learner.strategy must be ddp or fsdp2 for rank processes, got {strategy!r}")
        self.model = model
        self.strategy, self.world_size = strategy, world_size
        self.temperature = float(temperature)
        self.top_k, self.top_p = int(top_k), float(top_p)  # the ranks' learner's (the reference model reads them)
        self.kl_coef = kl_coef
        self.rank_timeout_s = float(rank_timeout_s)
        self.version = 0
        self.optimizer_steps = 0
        self.last_old_logprob: torch.Tensor | None = None  # never fused across processes
        self.last_current_logprob: torch.Tensor | None = None
        self.last_weights_checksum: str | None = None  # blake2b over the last update's bucket checksums
        self.last_weight_buckets = 0
        self._on_bucket: Callable[[WeightBucket], None] | None = None  # set while an update streams its weights
        threads = max(1, torch.get_num_threads() // world_size)
        spec = RankSpec(model=model, learner_factory=learner_factory, strategy=strategy, device=device,
                        precision=precision, threads=threads, collective_timeout_s=rank_timeout_s,
                        grad_divide_factor=grad_divide_factor, drop_rank=drop_rank,
                        weight_bucket_bytes=int(weight_bucket_bytes), corrupt_bucket=corrupt_bucket)
        spec_bytes = pickle.dumps(spec)
        ctx = mp.get_context("spawn")
        port = free_port()
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        try:
            for r in range(world_size):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=_rank_main, args=(r, world_size, port, child, spec_bytes),
                                name=f"posttrain-learner-rank-{r}", daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self.pids = self._collect("start", startup_timeout_s)
        except BaseException:
            self.close()
            raise
        self._synced = self._fingerprint()

    # ------------------------------------------------------------------ plumbing
    def _fingerprint(self) -> tuple[int, ...]:
        # In-place writes (load_state_dict, an optimizer step) bump a tensor's version counter.
        return tuple(t._version for t in self.model.state_dict().values())

    def _send(self, cmd: str, *args: object) -> None:
        payload = pickle.dumps((cmd, args))
        for r, c in enumerate(self.conns):
            try:
                c.send_bytes(payload)
            except (BrokenPipeError, ConnectionResetError, OSError):
                self._fail(f"learner rank {r} is gone ({self._exit_reason(r)}) before {cmd}")

    def _exit_reason(self, r: int) -> str:
        code = self.procs[r].exitcode
        if code is None:
            return "still running"
        if code < 0:
            try:
                return f"killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"killed by signal {-code}"
        return f"exit code {code}"

    def _fail(self, msg: str) -> None:
        self.close(kill=True)
        raise LearnerRankError(msg)

    def _collect(self, cmd: str, timeout_s: float) -> list[Any]:
        """Every rank's reply to ``cmd``; a dead, failing or silent rank fails the call (ranks killed)."""
        from multiprocessing.connection import wait

        replies: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(self.conns):
            pending = {id(self.conns[r]): r for r in range(len(self.conns)) if r not in replies}
            for c in wait([self.conns[r] for r in pending.values()], timeout=_POLL_S):
                r = pending[id(c)]
                try:
                    status, value = pickle.loads(self.conns[r].recv_bytes())
                except (EOFError, OSError):
                    self.procs[r].join(1.0)
                    self._fail(f"learner rank {r} died during {cmd} ({self._exit_reason(r)})")
                if status == "bucket" and r == 0 and self._on_bucket is not None:
                    try:
                        self._on_bucket(value)
                    except Exception as e:  # noqa: BLE001 - a bad bucket ends the run (the driver copy is half-loaded)
                        self._fail(f"learner rank 0 sent a bad weight bucket during {cmd}: "
                                   f"{type(e).__name__}: {e}".splitlines()[0][:500])
                    continue
                if status != "ok":
                    self._fail(f"learner rank {r} failed during {cmd}: {value}")
                replies[r] = value
            for r in range(len(self.conns)):
                if r not in replies and self.procs[r].exitcode is not None:
                    self._fail(f"learner rank {r} died during {cmd} ({self._exit_reason(r)})")
            if time.monotonic() > deadline and len(replies) < len(self.conns):
                silent = sorted(set(range(len(self.conns))) - set(replies))
                self._fail(f"learner rank(s) {silent} did not answer {cmd} within {timeout_s:g}s "
                           "(learner.rank_timeout_s)")
        return [replies[r] for r in range(len(self.conns))]

    def _call(self, cmd: str, *args: object) -> list[Any]:
        if not self.conns:
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

    def update(self, batch: TrajectoryBatch, advantages: torch.Tensor | None = None, *,
               old_logprob: torch.Tensor | None = None, fuse_old: bool = False) -> dict[str, float]:
        """One update on every rank (PolicyLearner.update's contract and metrics); then the driver copy
        takes rank 0's gathered weights after checking their version and checksum."""
        if fuse_old:
            raise ValueError("fuse_old is not available with learner ranks (can_fuse_old_logprob is False)")
        import hashlib

        mine = self.model.state_dict()
        got: list[str] = []
        received = [0]
        digest = hashlib.blake2b(digest_size=16)

        def load_bucket(bucket: WeightBucket) -> None:
            index, packet, checksum, version = bucket.index, bucket.packet, bucket.checksum, bucket.version
            if index != received[0] or version != self.version + 1:
                raise LearnerRankError(f"weight bucket {index} v{version} arrived, expected bucket {received[0]} "
                                       f"v{self.version + 1}")
            packet.verify(version=version, checksum=checksum, where=f"driver (weight bucket {index} from learner rank 0)")
            sd = packet.tensors()
            unexpected = sorted(k for k in sd if k not in mine or mine[k].shape != sd[k].shape)
            if unexpected:
                raise LearnerRankError(f"weight bucket {index} does not fit the model: {unexpected[:3]}")
            with torch.no_grad():
                for k, v in sd.items():
                    mine[k].copy_(v)
            got.extend(sd)
            received[0] += 1
            digest.update(checksum.encode())

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
        self.last_weights_checksum = digest.hexdigest()
        self.last_weight_buckets = int(n_buckets)
        metrics = dict(metrics)
        metrics["learner/world_size"] = float(self.world_size)
        metrics["learner/weight_buckets"] = float(self.last_weight_buckets)
        return metrics

    def weights_for_rollout(self) -> Mapping[str, torch.Tensor]:
        """The driver copy's state dict (live tensors, as PolicyLearner.weights_for_rollout)."""
        return self.model.state_dict()

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
        self.version, self.optimizer_steps = int(state["version"]), int(state["optimizer_steps"])
        if "kl_controller" in state:
            if isinstance(self.kl_coef, (int, float)):
                raise ValueError("state holds a KL controller but this learner has a fixed kl_coef")
            self.kl_coef.load_state_dict(state["kl_controller"])

    def close(self, kill: bool = False) -> None:
        """Stop the ranks (``close`` command, then SIGKILL whatever is left after 5 s); idempotent."""
        if not kill:
            for c in self.conns:
                try:
                    c.send_bytes(pickle.dumps(("close", ())))
                except Exception:  # noqa: BLE001 - a dead rank
                    pass
            end = time.monotonic() + 5.0
            for p in self.procs:
                p.join(max(0.0, end - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(5.0)
        for c in self.conns:
            c.close()
        self.procs, self.conns = [], []


def _is_alias(sd: Mapping[str, torch.Tensor], key: str) -> bool:
    """True when ``sd[key]`` shares storage with another entry (a tied weight gathered once)."""
    t = sd[key]
    return any(k != key and v.data_ptr() == t.data_ptr() for k, v in sd.items())


__all__ = ["LearnerRankError", "LearnerRanks", "RankLearnerFactory", "RankSpec", "WeightBucket",
           "fqn_to_id_optimizer_state", "id_to_fqn_optimizer_state"]
