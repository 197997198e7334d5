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
import re
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
    """What a checkpoint holds for the server: base model, LoRA spec, adapter, optimizer state (or None)."""

    base_model: str
    lora: LoraSpec
    adapter: dict[str, torch.Tensor]
    optimizer: dict[str, Any] | None


def write(path: TinkerPath, state_dir: Path, *, step: int, actor: torch.nn.Module, tokenizer: Tokenizer | None,
          saved: Saved) -> Path:
    """Write ``saved`` (and the merged ``actor``) as a posttrain checkpoint; returns its directory."""
    run_dir = path.directory(state_dir)
    if run_dir.exists():
        import shutil

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
    """Read the checkpoint of ``path``; ``UserError`` when there is none."""
    ckpt = latest_checkpoint(path.directory(state_dir))
    if ckpt is None:
        raise UserError(f"no checkpoint at {path.uri}")
    state = load_checkpoint(ckpt)
    info: Mapping[str, Any] = state.extra.get("tinker", {})
    if "lora" not in info:
        raise UserError(f"{ckpt}: not written by posttrain serve (no tinker info in meta.json)")
    ls = state.learner_state
    return Saved(str(info["base_model"]), LoraSpec(**info["lora"]), dict(ls["adapter"]), ls.get("optimizer"))
