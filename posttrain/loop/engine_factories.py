"""The factory functions of the registered rollout engines (:data:`posttrain.config.engines.ENGINES`).

Each is ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]``: it takes what it needs of the run
now (a snapshot of ``model``'s weights, an export under ``workdir``) and returns a picklable zero-argument
builder, which the Ray rollout workers call once per process (again after a restart) and
:func:`posttrain.loop.builders.build_engine` calls locally. An entry names its function by
``"posttrain.loop.engine_factories:NAME"``; :func:`posttrain.loop.builders.engine_factory` resolves it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from posttrain.config import RunConfig
    from posttrain.rollout.engine import RolloutEngine

__all__ = ["builtin_factory", "http_factory", "vllm_factory"]


def builtin_factory(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, workdir: Path
                    ) -> Callable[[], RolloutEngine]:
    """``rollout.engine: builtin``: a copy of ``model`` at ``rollout.precision`` (snapshotted now), or with
    ``rollout.process: server`` ``model`` exported now to ``workdir/engine_model`` and a built-in engine server
    started on it per call (:func:`posttrain.rollout.builtin_server.builtin_server_factory`)."""
    from posttrain.rollout.precision import engine_copy

    rc = cfg.rollout
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    model = engine_copy(model, rc.precision)  # both factories snapshot the weights now
    # Stop strings (env.stop_strings of multi-turn episodes) need the tokenizer on the worker side;
    # otherwise the factory stays tokenizer-free (less to pickle per worker start).
    stops = cfg.env.name is not None and bool(cfg.env.stop_strings)
    if rc.process == "server":
        from posttrain.rollout.builtin_server import builtin_server_factory

        s = rc.server
        return builtin_server_factory(model, workdir, eos_token_id=eos, pad_token_id=pad,
                                      tokenizer=tokenizer if stops else None, threads=s.threads,
                                      startup_timeout_s=s.startup_timeout_s, timeout_s=s.timeout_s)
    from posttrain.loop.backends import builtin_engine_factory

    extra = {"tokenizer": tokenizer} if stops else {}
    return builtin_engine_factory(model, eos_token_id=eos, pad_token_id=pad, **extra)


def http_factory(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, workdir: Path
                 ) -> Callable[[], RolloutEngine]:
    """``rollout.engine: http``: each call connects to ``rollout.http.url`` and loads ``model``'s weights
    (snapshotted now, on the CPU) into it as version 0."""
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return _HTTPEngineFactory(cfg.rollout.http.model_dump(), state)


def vllm_factory(cfg: RunConfig, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, workdir: Path
                 ) -> Callable[[], RolloutEngine]:
    """``rollout.engine: vllm``: ``model`` is exported now to ``workdir/engine_model`` (safetensors) and each
    call starts a vLLM engine on it (a 127.0.0.1 server in ``rollout.vllm.python``'s environment, or
    in-process when that is null), dtype ``rollout.vllm.dtype`` (``auto``: ``model.dtype``)."""
    export = Path(workdir) / "engine_model"
    export.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(export), safe_serialization=True)  # type: ignore[operator]  # a transformers model
    v = cfg.rollout.vllm
    dtype = v.dtype if v.dtype != "auto" else cfg.model.dtype
    kwargs = dict(model=str(export), dtype=dtype, max_model_len=v.max_model_len, kv_cache_gib=v.kv_cache_gib,
                  gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
                  seed=cfg.seed if v.seed is None else v.seed, eos_token_id=tokenizer.eos_token_id,
                  sleep_mode=cfg.system.engine_sleep)
    py = v.python_path()
    return _VLLMEngineFactory(None if py is None else str(py), kwargs, str(Path(workdir) / "engine_server.log"),
                             v.startup_timeout_s, v.timeout_s)


class _VLLMEngineFactory:
    """Picklable: starts ``build_vllm_engine(**kwargs)`` in ``python``'s environment (a server), or here."""

    def __init__(self, python: str | None, kwargs: dict[str, Any], log_path: str, startup_timeout_s: float,
                 timeout_s: float) -> None:
        self.python, self.kwargs, self.log_path = python, kwargs, log_path
        self.startup_timeout_s, self.timeout_s = startup_timeout_s, timeout_s
        self.creator_pid = os.getpid()

    def server_log(self) -> str:
        """The server's log file: ``engine_server.log`` in the process that built the factory (the
        local backend); ``engine_server.<pid>.log`` in any other (each Ray rollout worker, and each
        restart of one, starts its own server: one log per server, never two writers in one file)."""
        if os.getpid() == self.creator_pid:
            return self.log_path
        stem, dot, ext = self.log_path.rpartition(".")
        return f"{stem}.{os.getpid()}{dot}{ext}" if dot else f"{self.log_path}.{os.getpid()}"

    def __call__(self) -> RolloutEngine:
        if self.python is None:
            from posttrain.rollout.vllm_engine import build_vllm_engine

            return build_vllm_engine(**self.kwargs)
        from posttrain.rollout.server_process import SpawnedEngine

        return SpawnedEngine(self.python, "posttrain.rollout.vllm_engine:build_vllm_engine", self.kwargs,
                             log_path=self.server_log(), startup_timeout_s=self.startup_timeout_s,
                             timeout_s=self.timeout_s, weights_timeout_s=self.timeout_s)


class _HTTPEngineFactory:
    """Picklable: connects to a running engine server and loads the run's initial weights (version 0)."""

    def __init__(self, settings: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
        self.settings, self.state = settings, state

    def __call__(self) -> RolloutEngine:
        from posttrain.rollout.http_engine import HTTPEngine

        s = self.settings
        eng = HTTPEngine(s["url"], timeout_s=s["timeout_s"], weights_timeout_s=s["weights_timeout_s"])
        eng.wait_ready(s["connect_timeout_s"])
        # The server may hold other weights: the run starts from its own (checksummed on arrival).
        eng.update_weights(self.state, version=0)
        return eng
