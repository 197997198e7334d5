"""What a learner rank process runs (:func:`rank_main`), and the formats it shares with the driver.

:class:`RankSpec` is pickled once to every rank; each builds its :class:`PolicyLearner` with its
gradient hook (:mod:`posttrain.learner.distributed`), FSDP2-sharded for ``fsdp2``, then serves the
driver's commands (:class:`~posttrain.learner.ranks.LearnerRanks`) over its pipe until ``close``: the
table :data:`COMMANDS` — the learner's primitives (``prepare`` parks a batch's tensors on the device once,
then each ``forward_backward`` names it with its rows and a pickled token loss; ``optim_step``;
``minibatch_plan``; ``logprobs``), the RL ``update`` as one command, and the state / weight transfers.
After an update (``update``, or an ``optim_step`` that ends one) the weights go to the driver as
checksummed :class:`WeightBucket` s (:func:`bucket_plan`, :func:`weight_buckets`). The optimizer-state converters map the name-keyed
full state of ``torch.distributed.checkpoint`` to the embedded learner's id-keyed format and back.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.distributed import DropRankShare, ProcessGroupSync, ShardedSync, init_process_group
from posttrain.learner.grad_sync import GradientSync
from posttrain.learner.primitives import ForwardBackwardOutput, LossBatch, TokenLoss
from posttrain.learner.schedule import load_schedule_state, recipe_hyperparameters
from posttrain.rollout.weight_transfer import WeightPacket, pack_state_dict
from posttrain.trajectory.collate import TrajectoryBatch

if TYPE_CHECKING:
    from posttrain.learner.sharded_checkpoint import FileDigest


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
    with recipe_hyperparameters(learner.optimizer):  # a forced resume's changed optim.* takes effect
        if osd["state"]:
            set_optimizer_state_dict(learner.model, learner.optimizer, osd,
                                     options=StateDictOptions(full_state_dict=True))
        _restore_rest(learner, state, None if osd["state"] else osd["param_groups"])


def _restore_rest(learner: PolicyLearner, state: Mapping[str, Any],
                  param_groups: Sequence[Mapping[str, Any]] | None) -> None:
    """Scheduler, generator and counters from ``state``; with ``param_groups`` (no optimizer step
    taken yet) only the groups' hyper-parameters are restored and AdamW stays stateless:
    set_optimizer_state_dict would first initialise the state with a zero-lr step, leaving step=1,
    which changes the bias correction of the first real step. A live optimizer that has stepped is emptied
    then (as ``Optimizer.load_state_dict`` of a stateless state does on ddp ranks)."""
    if param_groups is not None:
        learner.optimizer.state.clear()
    for live, saved in zip(learner.optimizer.param_groups, param_groups or [], strict=param_groups is not None):
        live.update({k: v for k, v in saved.items() if k != "params"})
    load_schedule_state(learner.scheduler, state["scheduler"])
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

    with recipe_hyperparameters(learner.optimizer):  # a forced resume's changed optim.* takes effect
        load_sharded(learner.model, learner.optimizer, directory, with_optimizer=bool(state["optimizer_in_shards"]))
        _restore_rest(learner, state, None if state["optimizer_in_shards"] else state["param_groups"])


def _load_weights(learner: PolicyLearner, sd: Mapping[str, torch.Tensor], fsdp: bool) -> None:
    if fsdp:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(learner.model, dict(sd), options=StateDictOptions(full_state_dict=True, strict=False))
    else:
        learner.model.load_state_dict(sd)


@dataclasses.dataclass
class _Rank:
    """A serving rank: its learner and what the command handlers need besides the command's arguments.
    ``parked``: the batch tensors a ``prepare`` left on the device, by batch id (at most one batch)."""

    rank: int
    learner: PolicyLearner
    fsdp: bool
    spec: RankSpec
    conn: Connection
    parked: dict[int, dict[str, torch.Tensor | None]] = dataclasses.field(default_factory=dict)


def _ended_update(r: _Rank, payload: object) -> tuple[object, int, int, int] | None:
    """After an optimiser step that ends an update: stream the weights (:func:`_stream_weights`) and answer
    ``(payload, bucket count, version, optimizer steps)`` on rank 0 (None elsewhere)."""
    r.parked.clear()  # the update's batch is done
    n_buckets = _stream_weights(r.learner, r.fsdp, r.spec, r.conn, r.rank)
    return (payload, n_buckets, r.learner.version, r.learner.optimizer_steps) if r.rank == 0 else None


def _cmd_update(r: _Rank, batch: TrajectoryBatch, adv: torch.Tensor | None, old: torch.Tensor | None,
                kl_coef: float) -> object:
    r.learner.kl_coef = float(kl_coef)
    return _ended_update(r, r.learner.update(batch, adv, old_logprob=old).metrics)


def _cmd_prepare(r: _Rank, batch_id: int, tensors: Mapping[str, torch.Tensor | None]) -> None:
    dev = r.learner.device
    r.parked = {batch_id: {k: v.to(dev) if v is not None else None for k, v in tensors.items()}}


def _cmd_forward_backward(r: _Rank, batch_id: int, rows: list[int], num_tokens: float,
                          loss_bytes: bytes) -> ForwardBackwardOutput:
    if batch_id not in r.parked:
        raise ValueError(f"forward_backward of batch {batch_id}, but the parked batch is {sorted(r.parked)}")
    loss: TokenLoss = pickle.loads(loss_bytes)
    return r.learner.forward_backward(LossBatch(r.parked[batch_id], rows, num_tokens), loss)


def _cmd_optim_step(r: _Rank, ends_update: bool) -> object:
    outcome = r.learner.optim_step(ends_update=ends_update)
    if ends_update:
        return _ended_update(r, outcome)
    return (outcome, 0, r.learner.version, r.learner.optimizer_steps) if r.rank == 0 else None


def _cmd_logprobs(r: _Rank, batch: TrajectoryBatch) -> torch.Tensor | None:
    lp = r.learner.compute_logprobs(batch)  # every rank: the shards' SUM is a collective
    return lp if r.rank == 0 else None


def _cmd_save_sharded(r: _Rank, directory: str) -> tuple[dict[str, FileDigest], dict[str, Any] | None]:
    from posttrain.learner.sharded_checkpoint import save_sharded

    files = save_sharded(r.learner.model, r.learner.optimizer, directory, r.rank)
    return files, _sharded_core(r.learner) if r.rank == 0 else None


#: The commands a rank serves: ``name -> handler(rank, *args)``; the handler's value is the reply.
COMMANDS: dict[str, Callable[..., object]] = {
    "update": _cmd_update,
    "prepare": _cmd_prepare,
    "forward_backward": _cmd_forward_backward,
    "optim_step": _cmd_optim_step,
    "minibatch_plan": lambda r, num_rows: r.learner.minibatch_plan(num_rows),
    "logprobs": _cmd_logprobs,
    "state": lambda r: _learner_state(r.learner, r.fsdp),
    "load_state": lambda r, state: _load_learner_state(r.learner, state, r.fsdp),
    "save_sharded": _cmd_save_sharded,
    "load_sharded": lambda r, directory, state: _load_sharded_state(r.learner, directory, state),
    "load_weights": lambda r, sd: _load_weights(r.learner, sd, r.fsdp),
}


def _build_rank(rank: int, world_size: int, port: int, conn: Connection, spec: RankSpec, host: str,
                gpu_index: int | None) -> _Rank:
    """Join the process group, move (and for ``fsdp2`` shard) the model, build the learner with its hook."""
    cuda = spec.device == "cuda"
    gpu = rank if gpu_index is None else gpu_index
    if cuda:
        torch.cuda.set_device(gpu)
    init_process_group(rank, world_size, port=port, host=host, backend="nccl" if cuda else "gloo",
                       timeout_s=spec.collective_timeout_s)
    device = torch.device("cuda", gpu) if cuda else torch.device("cpu")
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
    return _Rank(rank, learner, fsdp, spec, conn)


def _serve(r: _Rank) -> None:
    """Answer the driver's commands (:data:`COMMANDS`) in order until ``close`` or the driver is gone."""
    while True:
        try:
            cmd, args = pickle.loads(r.conn.recv_bytes())
        except EOFError:  # the driver is gone
            return
        if cmd == "close":
            r.conn.send_bytes(pickle.dumps(("ok", None)))
            return
        handler = COMMANDS.get(cmd)
        if handler is None:
            raise ValueError(f"unknown learner rank command {cmd!r}")
        r.conn.send_bytes(pickle.dumps(("ok", handler(r, *args))))


def rank_main(rank: int, world_size: int, port: int, conn: Connection, spec_bytes: bytes, *,
              host: str = "127.0.0.1", gpu_index: int | None = None, in_thread: bool = False) -> None:
    """A rank: build the learner, then serve the driver's commands (:data:`COMMANDS`) over ``conn`` until ``close``.

    The process group forms at ``host:port`` (rank 0's address). ``gpu_index``: the CUDA device of
    this rank (default ``rank``: every rank on one machine; a Ray actor sees only its own GPU, 0).
    ``in_thread``: the loop runs on a thread of a longer-lived process (a Ray actor): an error is
    reported and the function returns instead of ending the process."""
    spec: RankSpec = pickle.loads(spec_bytes)
    torch.set_num_threads(max(1, spec.threads))
    try:
        r = _build_rank(rank, world_size, port, conn, spec, host, gpu_index)
        conn.send_bytes(pickle.dumps(("ok", os.getpid())))
        _serve(r)
    except BaseException as e:  # noqa: BLE001 - reported to the driver, then this rank ends
        try:
            conn.send_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}".splitlines()[0][:500])))
        except Exception:  # noqa: BLE001 - the driver may be gone already
            pass
        if not in_thread:
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


__all__ = ["COMMANDS", "RankLearnerFactory", "RankSpec", "WeightBucket", "bucket_plan", "fqn_to_id_optimizer_state",
           "id_to_fqn_optimizer_state", "rank_main", "weight_buckets"]
