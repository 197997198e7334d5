"""Is a comparison fair? The identities that must match and every other config difference.

A cross-recipe comparison must hold some things fixed and report the rest. Four of them change
what "accuracy" means, so ``posttrain compare`` refuses to compare runs that differ in them unless
forced: the base checkpoint, the tokenizer / chat template, the verifier version and the
held-out set. Everything else that differs is listed (that is the point of a comparison).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from posttrain.diagnostics.load import open_ledger

REQUIRED = ("base checkpoint", "tokenizer/template", "verifier version", "held-out set")
# Keys that differ between any two runs by construction and say nothing about the recipe.
IGNORED_KEYS = ("name", "run_dir", "seed", "resume", "resume_force", "checkpoint_every",
                "logging.progress", "logging.tensorboard", "logging.wandb", "logging.wandb_project",
                "logging.wandb_mode", "logging.mlflow", "logging.mlflow_tracking_uri", "logging.mlflow_experiment")


def read_config(run_dir: str | Path) -> dict[str, Any]:
    """``config.yaml`` of a run as a plain dict; ``FileNotFoundError`` naming it when absent."""
    import yaml

    path = Path(run_dir) / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: not found (is {run_dir} a run directory?)")
    return yaml.safe_load(path.read_text()) or {}


def _file_digest(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()[:12]


def _tokenizer_identity(run_dir: Path, cfg: Mapping[str, Any]) -> str:
    # The checkpoint saves the tokenizer and chat template actually used; hash them. Without a
    # checkpoint the tokenizer is the model's own, so the model path identifies it.
    ckpts = sorted(run_dir.glob("checkpoints/*/actor"))
    if ckpts:
        files = [p for p in (ckpts[0] / "tokenizer.json", ckpts[0] / "chat_template.jinja") if p.is_file()]
        if files:
            return f"sha256:{_file_digest(files)}"
    return f"the tokenizer of {cfg.get('model', {}).get('path')}"


def _verifiers(run_dir: Path, cfg: Mapping[str, Any]) -> str:
    led = open_ledger(run_dir)
    seen: set[str] = set()
    for s in led.steps():
        try:
            seen.update(v for v in pq.read_table(led.traj_dir / f"step_{s:06d}.parquet", columns=["verifier"])
                        .column("verifier").to_pylist() if v)
        except OSError:
            continue
    return ",".join(sorted(seen)) if seen else f"task {cfg.get('task', {}).get('name')} (no verifier in the ledger)"


def _prompt_rendering(run_dir: Path) -> str:
    # What the engine sampled from: the renderer mode and chat-template fingerprint recorded per
    # trajectory (posttrain/envs/prompt_render.py), from the first ledger step. Runs from before
    # that record all rendered raw text.
    import json

    led = open_ledger(run_dir)
    seen: set[str] = set()
    for s in led.steps()[:1]:
        try:
            metas = pq.read_table(led.traj_dir / f"step_{s:06d}.parquet", columns=["meta"]).column("meta").to_pylist()
        except (OSError, KeyError):
            continue
        for m in metas:
            d = json.loads(m) if isinstance(m, str) else (m or {})
            seen.add(f"{d.get('prompt_format', 'raw')}/{d.get('chat_template', 'none')}")
    return ",".join(sorted(seen)) if seen else "raw/none"


def identity(run_dir: str | Path) -> dict[str, str]:
    """The four :data:`REQUIRED` identities of a run, as comparable strings."""
    run = Path(run_dir)
    cfg = read_config(run)
    model, task, ev = cfg.get("model", {}), cfg.get("task", {}), cfg.get("eval", {})
    return {
        # init_seed picks the weights of a builtin model; SFT warm-up and dtype are recipe choices.
        "base checkpoint": f"{model.get('path')} init_seed={model.get('init_seed')}",
        "tokenizer/template": f"{_tokenizer_identity(run, cfg)}; prompts {_prompt_rendering(run)}",
        "verifier version": _verifiers(run, cfg),
        # The held-out prompts are task.examples("heldout", eval.size, seed): seeds are paired
        # across recipes, so the set is identified by task, its arguments and the size (and
        # eval.heldout_seed where a recipe fixes the set across seeds).
        "held-out set": f"{task.get('name')} {task.get('kwargs')} size={ev.get('size')} "
                        f"max_new_tokens={ev.get('max_new_tokens')} temperature={ev.get('temperature')}"
                        + ("" if ev.get("heldout_seed") is None else f" heldout_seed={ev.get('heldout_seed')}"),
    }


def flatten(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys of a nested dict: ``{"a": {"b": 1}} -> {"a.b": 1}``."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(configs: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """dotted key -> {label: value} for every key whose value is not the same in all configs."""
    flat = {label: flatten(c) for label, c in configs.items()}
    keys = sorted(set().union(*(f.keys() for f in flat.values())))
    out = {}
    for k in keys:
        if k in IGNORED_KEYS:
            continue
        vals = {label: f.get(k, "<absent>") for label, f in flat.items()}
        if len({repr(v) for v in vals.values()}) > 1:
            out[k] = vals
    return out


def blocking_differences(identities: Mapping[str, Sequence[Mapping[str, str]]]) -> list[str]:
    """One line per :data:`REQUIRED` identity that is not the same across every run of every recipe."""
    lines = []
    for what in REQUIRED:
        vals = {label: sorted({i[what] for i in ids}) for label, ids in identities.items()}
        if len({v for vs in vals.values() for v in vs}) > 1:
            lines.append(f"{what} differs: " + "; ".join(f"{lab}: {' | '.join(v)}" for lab, v in vals.items()))
    return lines
