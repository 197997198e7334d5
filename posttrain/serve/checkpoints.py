"""Tinker checkpoint paths on disk, in posttrain's checkpoint format.

``tinker://<model_id>/weights/<name>`` (``save_state``: adapter + optimizer) and
``tinker://<model_id>/sampler_weights/<name>`` (``save_weights_for_sampler``: adapter only) map to
``<state_dir>/<model_id>/<kind>/<name>/``, a run directory holding one checkpoint
``checkpoints/step_<optimizer steps>`` written by :func:`posttrain.learner.checkpoint.save_checkpoint`:
``actor/`` is the merged model (``AutoModelForCausalLM.from_pretrained`` loads it, e.g. for
``posttrain eval``), ``learner_state.pt`` holds ``{"adapter", "optimizer"}`` and ``meta.json``'s
extra the LoRA config and base model (what a load checks).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from posttrain.errors import UserError
from posttrain.learner.checkpoint import checkpoint_path, latest_checkpoint, load_checkpoint, save_checkpoint
from posttrain.serve.tinker_models import LoraSpec

if TYPE_CHECKING:
    from posttrain.models.tokenizer_protocol import Tokenizer

KINDS = ("weights", "sampler_weights")
_NAME = re.compile(r"^[A-Za-z0-9_.:-]+$")


@dataclasses.dataclass(frozen=True)
class TinkerPath:
    """A parsed ``tinker://<model_id>/<kind>/<name>``."""

    model_id: str
    kind: str
    name: str

    @property
    def uri(self) -> str:
        """The ``tinker://`` form."""
        return f"tinker://{self.model_id}/{self.kind}/{self.name}"

    def directory(self, state_dir: Path) -> Path:
        """Its run directory under ``state_dir``."""
        return state_dir / self.model_id.replace(":", "_") / self.kind / self.name


def parse_path(uri: str) -> TinkerPath:
    """Parse a ``tinker://`` path; ``UserError`` for anything else (names: letters, digits, ``_.:-``)."""
    parts = uri[len("tinker://"):].split("/") if uri.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS or not all(_NAME.match(p) and p not in (".", "..") for p in parts):
        raise UserError(f"invalid checkpoint path {uri!r}: expected tinker://<model_id>/weights|sampler_weights/<name>")
    return TinkerPath(*parts)


@dataclasses.dataclass(frozen=True)
class Saved:
    """What a checkpoint holds for the server: base model, LoRA spec, adapter, optimizer state (or None),
    and the optimizer steps the adapter had taken when it was saved (``step``)."""

    base_model: str
    lora: LoraSpec
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None
    step: int = 0


def write(path: TinkerPath, state_dir: Path, *, step: int, actor: torch.nn.Module, tokenizer: Tokenizer | None,
          saved: Saved) -> Path:
    """Write ``saved`` (and the merged ``actor``) as a posttrain checkpoint; returns its directory."""
    run_dir = path.directory(state_dir)
    if run_dir.exists():
        shutil.rmtree(run_dir)
    learner_state: dict[str, Any] = {"adapter": saved.adapter}
    if saved.optimizer is not None:
        learner_state["optimizer"] = saved.optimizer
    save_checkpoint(checkpoint_path(run_dir, step), step=step, actor=actor,
                    tokenizer=tokenizer,
                    learner_state=learner_state,
                    extra={"tinker": {"path": path.uri, "base_model": saved.base_model, "lora": dataclasses.asdict(saved.lora)}})
    return run_dir


def read(path: TinkerPath, state_dir: Path) -> Saved:
    """Read the checkpoint of ``path``; ``UserError`` when there is none (or it expired)."""
    ckpt = None if _expire(path.directory(state_dir)) else latest_checkpoint(path.directory(state_dir))
    if ckpt is None:
        raise UserError(f"no checkpoint at {path.uri}")
    state = load_checkpoint(ckpt)
    info: Mapping[str, Any] = state.extra.get("tinker", {})
    if "lora" not in info:
        raise UserError(f"{ckpt}: not written by posttrain serve (no tinker info in meta.json)")
    ls = state.learner_state
    return Saved(str(info["base_model"]), LoraSpec(**info["lora"]), dict(ls["adapter"]), ls.get("optimizer"),
                 state.step)


_TTL_FILE = "ttl.json"


def _expires_at(run_dir: Path) -> float | None:
    f = run_dir / _TTL_FILE
    return float(json.loads(f.read_text())["expires_at"]) if f.is_file() else None


def _expire(run_dir: Path) -> bool:
    """Delete ``run_dir`` if its TTL has passed; whether it did."""
    at = _expires_at(run_dir)
    if at is not None and at <= time.time():
        shutil.rmtree(run_dir, ignore_errors=True)
        return True
    return False


def iso_time(epoch: float) -> str:
    """``epoch`` (seconds) as an ISO 8601 UTC time, the SDK's ``datetime`` fields."""
    return dt.datetime.fromtimestamp(epoch, dt.UTC).isoformat()


@dataclasses.dataclass(frozen=True)
class Listed:
    """One checkpoint on disk as the REST API describes it: its path, base model, LoRA spec, and the
    SDK's ``Checkpoint`` fields (:meth:`record`)."""

    path: TinkerPath
    base_model: str
    lora: LoraSpec
    time: float
    size_bytes: int
    expires_at: float | None

    def record(self) -> dict[str, Any]:
        """The SDK's ``Checkpoint`` JSON (``checkpoint_id`` is ``<kind>/<name>``, as the SDK parses paths)."""
        return {"checkpoint_id": f"{self.path.kind}/{self.path.name}",
                "checkpoint_type": "training" if self.path.kind == "weights" else "sampler",
                "time": iso_time(self.time), "tinker_path": self.path.uri, "size_bytes": self.size_bytes,
                "public": False, "expires_at": None if self.expires_at is None else iso_time(self.expires_at)}


def listing(state_dir: Path) -> list[Listed]:
    """Every complete, unexpired checkpoint written by this server under ``state_dir``, oldest first
    (expired ones are deleted on the way)."""
    out: list[Listed] = []
    if not state_dir.is_dir():
        return out
    for run_dir in sorted(p for p in state_dir.glob("*/*/*") if p.is_dir() and p.parent.name in KINDS):
        ckpt = None if _expire(run_dir) else latest_checkpoint(run_dir)
        if ckpt is None:
            continue
        meta = json.loads((ckpt / "meta.json").read_text())
        info = meta.get("extra", {}).get("tinker", {})
        if "path" not in info or "lora" not in info:
            continue
        size = sum(f.stat().st_size for f in run_dir.rglob("*") if f.is_file())
        out.append(Listed(parse_path(str(info["path"])), str(info["base_model"]), LoraSpec(**info["lora"]),
                          (ckpt / "meta.json").stat().st_mtime, size, _expires_at(run_dir)))
    return sorted(out, key=lambda c: c.time)


def delete(path: TinkerPath, state_dir: Path) -> None:
    """Remove the checkpoint of ``path``; ``UserError`` when there is none."""
    run_dir = path.directory(state_dir)
    if _expire(run_dir) or latest_checkpoint(run_dir) is None:
        raise UserError(f"no checkpoint at {path.uri}")
    shutil.rmtree(run_dir)


def set_ttl(path: TinkerPath, state_dir: Path, ttl_seconds: int | None) -> None:
    """Make the checkpoint of ``path`` expire ``ttl_seconds`` from now (``None``: never); ``UserError``
    when there is none or the TTL is not a positive number of seconds."""
    run_dir = path.directory(state_dir)
    if _expire(run_dir) or latest_checkpoint(run_dir) is None:
        raise UserError(f"no checkpoint at {path.uri}")
    if ttl_seconds is None:
        (run_dir / _TTL_FILE).unlink(missing_ok=True)
        return
    if isinstance(ttl_seconds, bool) or not isinstance(ttl_seconds, int) or ttl_seconds <= 0:
        raise UserError(f"{path.uri}: ttl_seconds must be a positive integer or null, got {ttl_seconds!r}")
    (run_dir / _TTL_FILE).write_text(json.dumps({"expires_at": time.time() + ttl_seconds}))
