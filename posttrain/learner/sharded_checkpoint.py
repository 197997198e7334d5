"""Sharded learner checkpoints with ``torch.distributed.checkpoint`` (DCP), checked by a manifest.

Learner ranks (``learner.strategy`` ddp / fsdp2, :mod:`posttrain.learner.ranks`) write their
model + optimizer state into ``<checkpoint>/learner_dcp/`` with ``dcp.save``: each rank writes
only its own shards (``__<rank>_<n>.distcp``; rank 0 also the global ``.metadata``), so no process
gathers the optimizer state. ``dcp.load`` reads back whatever each loading rank's shards need,
which is how a checkpoint written by 2 ranks resumes on 1 (or on the embedded learner, with no
process group at all: DCP's ``no_dist`` mode).

DCP has no checksums, so every rank hashes the files it wrote (blake2b-128) and the driver writes
``manifest.json`` (``{file: [bytes, hex digest]}``); :func:`verify_sharded` checks it before a
load and names the first missing, truncated or altered file in one line.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

from posttrain.learner.actor import PolicyLearner
from posttrain.learner.protocol import Learner

if TYPE_CHECKING:
    pass

FileDigest = list[int | str]
"""``[size in bytes, blake2b-128 hex digest]`` of one shard file (a JSON list in the manifest)."""

SHARDED_DIR = "learner_dcp"
MANIFEST = "manifest.json"
_CHUNK = 1 << 20


def file_digest(path: Path) -> FileDigest:
    """``[size in bytes, blake2b-128 hex digest]`` of ``path``, read in 1 MiB chunks."""
    h = hashlib.blake2b(digest_size=16)
    size = 0
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return [size, h.hexdigest()]


def _distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _state_template(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    with_optimizer: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if not with_optimizer:
        return {"model": get_model_state_dict(model)}
    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def os_error_in(e: BaseException) -> OSError | None:
    """The first ``OSError`` in ``e``, its causes and contexts, and the per-rank failures of a DCP
    ``CheckpointException`` (``failures``: rank -> exception or (exception, traceback)); None if none."""
    todo: list[object] = [e]
    seen: set[int] = set()
    while todo:
        x = todo.pop(0)
        if isinstance(x, tuple) and x:
            x = x[0]
        if not isinstance(x, BaseException) or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError):
            return x
        failures = getattr(x, "failures", None)
        todo += [x.__cause__, x.__context__, *(failures.values() if isinstance(failures, Mapping) else ())]
    return None


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path,
                 rank: int) -> dict[str, FileDigest]:
    """Write this rank's shards of ``model`` + ``optimizer`` into ``directory``; a collective.

    Every rank of the process group calls it with the same ``directory`` (an FSDP2 model's
    parameters and AdamW state are DTensors: each rank writes its local shards; a replicated ddp
    model is written once, DCP de-duplicates replicas). A stateless optimizer (no step yet) is not
    written: ``get_state_dict`` would first initialise it with a zero-lr step, whose ``step=1``
    changes the bias correction of the first real step. Returns ``{file name: [bytes, digest]}``
    for the files this rank wrote (rank 0: with ``.metadata``), for :func:`write_manifest`.
    """
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
        dcp_save(_state_template(model, optimizer, bool(optimizer.state)), checkpoint_id=str(d))
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        # A full disk surfaces inside DCP's CheckpointException (per-rank failures) with no file name:
        # re-raised as that OSError naming the shard directory (the checkpoint's temp dir is removed by
        # save_checkpoint, which names the file).
        os_err = None if isinstance(e, KeyboardInterrupt | SystemExit) else os_error_in(e)
        if os_err is None:
            raise
        raise OSError(os_err.errno, f"cannot write sharded checkpoint: {os_err.strerror or os_err}", str(d)) from e
    mine = sorted(p for p in d.glob(f"__{rank}_*") if p.is_file())
    if rank == 0 and (d / ".metadata").is_file():
        mine.append(d / ".metadata")
    return {p.name: file_digest(p) for p in mine}


def write_manifest(directory: str | Path, per_rank: Sequence[Mapping[str, FileDigest]], *,
                   with_optimizer: bool) -> None:
    """Merge the ranks' file digests into ``directory/manifest.json`` (refuses a file named twice)."""
    files: dict[str, FileDigest] = {}
    for part in per_rank:
        for name, digest in part.items():
            if name in files:
                raise ValueError(f"{directory}: shard file {name} reported by two ranks")
            files[name] = list(digest)
    if ".metadata" not in files:
        raise ValueError(f"{directory}: no rank wrote the DCP .metadata file")
    text = json.dumps({"format": 1, "world_size": len(per_rank), "optimizer": with_optimizer, "files": files},
                      indent=1, sort_keys=True)
    (Path(directory) / MANIFEST).write_text(text)


def verify_sharded(directory: str | Path) -> dict[str, Any]:
    """Check every file of ``directory/manifest.json`` (present, size, digest); return the manifest.

    Raises ``ValueError`` with one line naming the first bad file: a missing manifest or shard,
    a shard of another size (truncated) or with another digest (altered bytes).
    """
    d = Path(directory)
    mf = d / MANIFEST
    if not mf.is_file():
        raise ValueError(f"{mf}: missing (a sharded learner checkpoint needs its manifest)")
    try:
        manifest = json.loads(mf.read_text())
        files = dict(manifest["files"])
    except (ValueError, KeyError, TypeError):
        raise ValueError(f"{mf}: unreadable manifest") from None
    for name in sorted(files):
        size, digest = files[name]
        p = d / name
        if not p.is_file():
            raise ValueError(f"{p}: sharded checkpoint file missing (listed in {MANIFEST})")
        got_size, got = file_digest(p)
        if got_size != size:
            raise ValueError(f"{p}: sharded checkpoint file is {got_size} bytes, {MANIFEST} says {size} (truncated?)")
        if got != digest:
            raise ValueError(f"{p}: sharded checkpoint file checksum mismatch (corrupted)")
    return dict(manifest)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: str | Path, *,
                 with_optimizer: bool) -> None:
    """Load a :func:`save_sharded` checkpoint into ``model`` (+ ``optimizer``) in place; a collective.

    Works on any world size (DCP reshards: each rank reads the byte ranges its own shards need) and
    without a process group (the embedded learner). ``with_optimizer`` False (the checkpoint had a
    stateless optimizer) leaves the optimizer untouched. The caller verifies the files first
    (:func:`verify_sharded`).
    """
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    # With an optimizer: the template initialises a stateless AdamW (zero-lr step); the load then
    # overwrites all of it, ``step`` included.
    sd = _state_template(model, optimizer, with_optimizer)
    with warnings.catch_warnings():
        # Without a process group (the embedded learner) DCP warns that it loads in one process: intended.
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp_load(sd, checkpoint_id=str(directory), no_dist=not _distributed())
    if with_optimizer:
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        set_model_state_dict(model, sd["model"])


@runtime_checkable
class LoadsShards(Protocol):
    """A learner that reads its own shards (:class:`~posttrain.learner.ranks.LearnerRanks`)."""

    def load_sharded(self, directory: Path, state: Mapping[str, Any]) -> None: ...


def load_sharded_into_learner(learner: Learner, directory: str | Path, state: Mapping[str, Any]) -> None:
    """Resume ``learner`` from a sharded checkpoint: ``state`` is its ``learner_state.pt`` entry
    (scheduler, generator, counters, ``optimizer_in_shards``). Learner ranks load their shards
    themselves (``learner.load_sharded``); the embedded :class:`PolicyLearner` reads them in this
    process with no process group, then takes the rest of ``state`` through ``load_state_dict``.
    The files were verified by :func:`~posttrain.learner.checkpoint.load_checkpoint`
    (:func:`verify_sharded`)."""
    if not isinstance(learner, PolicyLearner):
        if not isinstance(learner, LoadsShards):
            raise TypeError(f"a sharded checkpoint loads into PolicyLearner or LearnerRanks, not {type(learner).__name__}")
        learner.load_sharded(Path(directory), state)
        return
    load_sharded(learner.model, learner.optimizer, directory, with_optimizer=bool(state["optimizer_in_shards"]))
    rest = {k: v for k, v in state.items() if k not in ("sharded", "optimizer_in_shards", "param_groups")}
    optim = learner.optimizer.state_dict()
    if not state["optimizer_in_shards"]:
        optim["param_groups"] = [{**g, "params": live["params"]}
                                 for g, live in zip(state["param_groups"], optim["param_groups"], strict=True)]
    learner.load_state_dict({**rest, "optimizer": optim})


__all__ = ["MANIFEST", "SHARDED_DIR", "file_digest", "load_sharded", "load_sharded_into_learner", "save_sharded",
           "verify_sharded", "write_manifest"]
