"""Atomic training checkpoints: weights, optimizer/scheduler/shuffle state, RNG, cursors.

Layout of one checkpoint directory (``<run_dir>/checkpoints/step_000012``)::

    actor/              save_pretrained of the actor (safetensors + config) and the tokenizer:
                        AutoModelForCausalLM.from_pretrained(actor/) loads it (LoRA: merged)
    actor_adapter/      LoRA only: the peft adapter (for resuming the adapter itself)
    critic/             value head (+ backbone/ via save_pretrained unless shared), if any
    learner_state.pt    torch.save of the learners' state dicts (optimizer, scheduler, generator)
    learner_dcp/        learner ranks only: their model + optimizer shards (torch.distributed.checkpoint)
                        and manifest.json (sizes + digests); learner_state.pt then holds no optimizer
                        tensor (posttrain/learner/sharded_checkpoint.py)
    rng.pt              python ``random``, numpy and torch (CPU, CUDA) RNG states
    meta.json           {"format", "step", "extra"}: the JSON extra (data cursor, versions,
                        adaptive-KL state, ...) — written last

Atomicity: everything is written into a hidden sibling ``.step_000012.tmp-<pid>``, flushed
to disk, then renamed onto the final name (``os.replace`` of a directory is atomic on POSIX).
A crash at any point leaves either the complete new checkpoint or none, and never touches
earlier checkpoints; hidden temp dirs are ignored by :func:`latest_checkpoint` and removed by the
next save once their writer process is gone. An error while writing (disk full, Ctrl-C) removes
the temp dir before it propagates, as a :class:`CheckpointWriteError` (an ``OSError``) naming the file
that was being written under the checkpoint's final path. A checkpoint damaged after it was written (a truncated file)
is caught at load time: :func:`load_checkpoint` reads the state files and checks the weight files'
headers, so a resume can fall back to the previous complete checkpoint.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import random
import re
import shutil
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Protocol

import numpy as np
import safetensors.torch
import torch

from posttrain.learner.lora import is_peft_model

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

FORMAT_VERSION = 1
CHECKPOINTS_SUBDIR = "checkpoints"
_NAME = re.compile(r"^step_(\d+)$")
_TMP = re.compile(r"^\.(step_\d+)\.(tmp|old)-(\d+)$")


class _Saveable(Protocol):
    def save(self, directory: str | Path) -> None: ...


@dataclasses.dataclass(frozen=True)
class CheckpointState:
    """What :func:`load_checkpoint` read back.

    ``actor_dir`` is a ``from_pretrained`` folder (model + tokenizer); ``adapter_dir`` holds the
    LoRA adapter when the actor had one; ``critic_dir`` the critic (``ValueModel.load``).
    ``learner_state`` is the dict given to :func:`save_checkpoint`; ``rng`` goes to
    :func:`restore_rng`; ``extra`` is the JSON dict given to :func:`save_checkpoint`.
    """

    path: Path
    step: int
    actor_dir: Path
    adapter_dir: Path | None
    critic_dir: Path | None
    learner_state: dict[str, Any]
    rng: dict[str, Any]
    extra: dict[str, Any]

    def actor_state_dict(self) -> dict[str, torch.Tensor]:
        """The full plain-model state dict of ``actor/`` (tied entries included), for
        ``model.load_state_dict``. Builds the model with ``from_pretrained`` to resolve ties;
        :func:`restore_actor` loads in place without that copy (and handles LoRA)."""
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(self.actor_dir)
        return dict(model.state_dict())


def checkpoint_path(run_dir: str | Path, step: int) -> Path:
    """``<run_dir>/checkpoints/step_<step:06d>``: the one name of a step's checkpoint (the RL loop, the
    preference trainers and the Tinker server all write it; :func:`latest_checkpoint` orders by the number)."""
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    return Path(run_dir) / CHECKPOINTS_SUBDIR / f"step_{step:06d}"


def capture_rng() -> dict[str, Any]:
    """Python ``random``, numpy global and torch CPU (+ every CUDA device) RNG states.

    Stored as tensors / ints / lists so ``torch.load(weights_only=True)`` reads them back.
    """
    kind, keys, pos, has_gauss, gauss = np.random.get_state(legacy=True)
    py_version, py_state, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": {
            "kind": str(kind),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(gauss),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(rng: Mapping[str, Any] | CheckpointState) -> None:
    """Set the global RNGs from :func:`capture_rng` output (or a :class:`CheckpointState`)."""
    if isinstance(rng, CheckpointState):
        rng = rng.rng
    v, s, g = rng["python"]
    random.setstate((int(v), tuple(int(x) for x in s), g))
    n = rng["numpy"]
    np.random.set_state(
        (n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def _fsync_tree(root: Path) -> None:
    """Flush every file and directory under ``root`` to disk (so the rename publishes data)."""
    for dirpath, _, files in os.walk(root):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(dirpath))


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _remove_stale_temps(parent: Path) -> None:
    """Delete hidden temp/old dirs left by a writer that died (never those of a live process)."""
    for p in parent.iterdir():
        m = _TMP.match(p.name)
        if m and p.is_dir() and int(m.group(3)) != os.getpid() and not _pid_alive(int(m.group(3))):
            shutil.rmtree(p, ignore_errors=True)


@contextlib.contextmanager
def quiet_hf_progress() -> Iterator[None]:
    """transformers' own progress bars off for the block (restored after): a checkpoint is written every
    ``checkpoint_every`` steps inside the run's progress display, and a "Writing model shards" bar per
    save buries it."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def _save_actor(actor: torch.nn.Module, tmp: Path) -> None:
    with quiet_hf_progress():
        if is_peft_model(actor):
            actor.save_pretrained(tmp / "actor_adapter")  # type: ignore[operator]
            merged = copy.deepcopy(actor).merge_and_unload()  # type: ignore[operator]
            merged.save_pretrained(tmp / "actor")
        else:
            actor.save_pretrained(tmp / "actor")  # type: ignore[operator]


def _write_learner_state(learner_state: Mapping[str, Any], tmp: Path) -> None:
    torch.save(dict(learner_state), tmp / "learner_state.pt")


def _fresh_temp(final: Path) -> Path:
    """The hidden temp sibling ``.<name>.tmp-<pid>`` of ``final`` (not yet created; one left by this pid is
    removed), after creating the parent and removing stale temps of dead writers."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(final.parent)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def _write_parts(tmp: Path, writing: list[Path], *, actor: torch.nn.Module, tokenizer: Tokenizer | None,
                 critic: _Saveable | None, learner_state: Mapping[str, Any] | Callable[[Path], Mapping[str, Any]],
                 extra_json: str) -> None:
    """Every file of the checkpoint into ``tmp`` in order (actor, tokenizer, critic, learner state, RNG,
    ``meta.json`` last); ``writing[0]`` names the part being written at each point."""
    writing[0] = tmp / "actor"
    _save_actor(actor, tmp)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(tmp / "actor"))
    if critic is not None:
        writing[0] = tmp / "critic"
        with quiet_hf_progress():
            critic.save(tmp / "critic")
    writing[0] = tmp / "learner_state.pt"
    state = learner_state(tmp) if callable(learner_state) else learner_state  # learner_dcp/ shards
    _write_learner_state(state, tmp)
    writing[0] = tmp / "rng.pt"
    torch.save(capture_rng(), tmp / "rng.pt")
    writing[0] = tmp / "meta.json"
    (tmp / "meta.json").write_text(extra_json)


def _publish(tmp: Path, final: Path) -> None:
    """``tmp`` flushed to disk, then renamed onto ``final`` (an existing ``final`` moved aside first and removed
    after), then the parent directory flushed."""
    _fsync_tree(tmp)
    if final.exists():
        old = final.parent / f".{final.name}.old-{os.getpid()}"
        os.replace(final, old)
        os.replace(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, final)
    _fsync_dir(final.parent)


def _raise_write_error(e: BaseException, final: Path, tmp: Path, writing: Path) -> NoReturn:
    """Remove ``tmp`` and re-raise ``e``; a write failure as :class:`CheckpointWriteError` naming the file being
    written (the newest one under ``writing``, e.g. ``actor/model.safetensors``) under ``final``."""
    try:
        failed = final / _newest_file(writing).relative_to(tmp)
    except (OSError, ValueError):  # naming the file must not hide the error
        failed = final
    shutil.rmtree(tmp, ignore_errors=True)
    err = write_error(e, failed) if isinstance(e, Exception) else None
    if err is not None:
        raise err from e
    raise e


def save_checkpoint(
    path: str | Path,
    *,
    step: int,
    actor: torch.nn.Module,
    tokenizer: Tokenizer | None = None,
    critic: _Saveable | None = None,
    learner_state: Mapping[str, Any] | Callable[[Path], Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
) -> Path:
    """Write a complete checkpoint at ``path`` atomically and return ``path``.

    ``actor``: a ``transformers`` model (or its peft wrapper); ``tokenizer`` saved next to it;
    ``critic``: anything with ``.save(dir)`` (a ``ValueModel``); ``learner_state``: a dict of
    state dicts (e.g. ``{"policy": learner.state_dict(), "critic": critic_learner.state_dict()}``),
    or a callable given the (temporary) checkpoint directory that writes its sharded files there
    and returns that dict;
    ``extra``: JSON-serialisable run state (data cursor, versions, KL controller, ...). The current
    global RNG states are captured. An existing checkpoint at ``path`` is replaced only after the
    new one is complete. On any error the temp dir is removed and the error re-raised; a write failure
    (``OSError``, ``SafetensorError``, torch's write error) as :class:`CheckpointWriteError` naming the file.
    """
    final = Path(path)
    if _NAME.match(final.name) is None:
        raise ValueError(f"checkpoint directory name must look like 'step_000012', got {final.name!r}")
    extra_json = json.dumps(
        {"format": FORMAT_VERSION, "step": int(step), "extra": dict(extra or {})}, indent=1
    )
    tmp = _fresh_temp(final)
    writing = [tmp]  # what is being written, for the error (its name under the final path)
    try:
        tmp.mkdir()
        _write_parts(tmp, writing, actor=actor, tokenizer=tokenizer, critic=critic, learner_state=learner_state,
                     extra_json=extra_json)
        writing[0] = tmp
        _publish(tmp, final)
    except BaseException as e:
        _raise_write_error(e, final, tmp, writing[0])
    return final


class CheckpointWriteError(OSError):
    """A checkpoint file could not be written (disk full, I/O error): ``filename`` names it (under the
    checkpoint's final path), ``errno`` is the OS error when known (``ENOSPC``: disk full)."""

    def __str__(self) -> str:
        return f"cannot write checkpoint file {self.filename}: {self.strerror}"


def _newest_file(d: Path) -> Path:
    """The most recently modified file under ``d`` (``d`` itself when it holds none or is a file)."""
    if not d.is_dir():
        return d
    files = [p for p in d.rglob("*") if p.is_file()]
    return max(files, key=lambda p: p.stat().st_mtime_ns) if files else d


def write_error(e: Exception, path: Path) -> CheckpointWriteError | None:
    """``e`` as a :class:`CheckpointWriteError` naming ``path`` when it is a write failure: an ``OSError``,
    a ``SafetensorError`` (its Rust I/O error's ``code: N`` becomes the errno) or torch's "file write
    failed" ``RuntimeError``; None for any other error (a bug keeps its own type)."""
    code: int | None
    if isinstance(e, OSError):
        code, why = e.errno, e.strerror or str(e)
    elif isinstance(e, safetensors.SafetensorError):
        m = re.search(r"code: (\d+)", str(e))
        code = int(m.group(1)) if m else None
        why = os.strerror(code) if code else str(e).splitlines()[0]
    elif isinstance(e, RuntimeError) and "write" in str(e).lower():
        code, why = None, str(e).strip().splitlines()[-1][:200]
    else:
        return None
    return CheckpointWriteError(code, why, str(path))


def _check_safetensors(path: Path) -> None:
    """Raise ``ValueError`` when a safetensors file is shorter than its header says (truncated).

    Reads only the header (no tensor data), so checking costs nothing next to loading.
    """
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: truncated safetensors file ({size} bytes)")
        n = int.from_bytes(head, "little")
        try:
            header = json.loads(fh.read(n))
        except (ValueError, UnicodeDecodeError):
            raise ValueError(f"{path}: unreadable safetensors header") from None
    end = max((int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"), default=0)
    if size < 8 + n + end:
        raise ValueError(f"{path}: truncated safetensors file ({size} of {8 + n + end} bytes)")


def load_checkpoint(path: str | Path) -> CheckpointState:
    """Read a checkpoint written by :func:`save_checkpoint` (weights stay on disk: load them
    with :func:`restore_actor` / ``from_pretrained`` and ``ValueModel.load``)."""
    p = Path(path)
    meta_file = p / "meta.json"
    if not meta_file.is_file():
        raise ValueError(f"{p}: not a complete checkpoint (no meta.json)")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise ValueError(f"{p}: checkpoint format {meta.get('format')!r}, this code reads {FORMAT_VERSION}")
    for weights in sorted((p / "actor").glob("*.safetensors")) + sorted((p / "actor_adapter").glob("*.safetensors")):
        _check_safetensors(weights)
    if (p / "learner_dcp").is_dir():
        from posttrain.learner.sharded_checkpoint import verify_sharded

        verify_sharded(p / "learner_dcp")
    return CheckpointState(
        path=p,
        step=int(meta["step"]),
        actor_dir=p / "actor",
        adapter_dir=p / "actor_adapter" if (p / "actor_adapter").is_dir() else None,
        critic_dir=p / "critic" if (p / "critic").is_dir() else None,
        learner_state=torch.load(p / "learner_state.pt", weights_only=True),
        rng=torch.load(p / "rng.pt", weights_only=True),
        extra=dict(meta["extra"]),
    )


def _checkpoints_dir(run_dir: str | Path) -> Path:
    """``<run_dir>/checkpoints``, or ``run_dir`` itself when it is that folder already."""
    d = Path(run_dir)
    return d if d.name == CHECKPOINTS_SUBDIR else d / CHECKPOINTS_SUBDIR


def complete_checkpoints(run_dir: str | Path) -> list[Path]:
    """Every complete checkpoint under ``<run_dir>/checkpoints``, oldest step first.

    ``run_dir`` may also be the ``checkpoints`` folder itself. Only ``step_<digits>`` folders
    holding ``meta.json`` count (a crashed save leaves neither). "Complete" is about the write;
    a file damaged afterwards shows only when loading, which is why a resume walks this list
    newest first and falls back (older checkpoints are kept: nothing here prunes them).
    """
    d = _checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    found = sorted(
        (int(m.group(1)), p)
        for p in d.iterdir()
        if (m := _NAME.match(p.name)) and (p / "meta.json").is_file()
    )
    return [p for _, p in found]


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The complete checkpoint with the highest step under ``<run_dir>/checkpoints``, or None
    (see :func:`complete_checkpoints`)."""
    found = complete_checkpoints(run_dir)
    return found[-1] if found else None


def prune_checkpoints(run_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the ``keep_last`` newest complete checkpoints; returns the deleted paths."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    d = _checkpoints_dir(run_dir)
    if not d.is_dir():
        return []
    found = sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)))
    doomed = [p for _, p in found[:-keep_last]]
    for p in doomed:
        shutil.rmtree(p)
    return doomed


def load_pretrained_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Load every ``*.safetensors`` of a ``save_pretrained`` folder into ``model`` in place.

    Keys missing from the files are allowed only for tied parameters (they share storage with a
    loaded one, e.g. ``lm_head.weight`` tied to the embeddings); anything else is a ``ValueError``.
    """
    d = Path(directory)
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{d}: no *.safetensors weight files")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(safetensors.torch.load_file(f))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise ValueError(f"{d}: unexpected weights {list(unexpected)[:5]}")
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded_ptrs = {params[k].data_ptr() for k in state if k in params}
    untied = [k for k in missing if k not in params or params[k].data_ptr() not in loaded_ptrs]
    if untied:
        raise ValueError(f"{d}: weights missing for {untied[:5]}")


def restore_actor(model: torch.nn.Module, state: CheckpointState) -> None:
    """Load the checkpoint's actor weights into ``model`` in place (a peft model: its adapter)."""
    if is_peft_model(model):
        if state.adapter_dir is None:
            raise ValueError(
                f"{state.path}: the model has LoRA adapters but the checkpoint has no actor_adapter/"
            )
        import peft  # present: is_peft_model(model) is True

        weights = safetensors.torch.load_file(state.adapter_dir / "adapter_model.safetensors")
        peft.set_peft_model_state_dict(model, weights)
    else:
        load_pretrained_weights(model, state.actor_dir)
