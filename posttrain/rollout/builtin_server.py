"""The built-in engine in its own process: ``rollout.engine: builtin`` with ``rollout.process: server``.

Why: in ``one_step_off`` / ``async`` mode the rollout runs beside the learner. In a thread of the
trainer both sides share one interpreter lock, and at small model sizes both are Python-heavy
(per-token sampling, per-record bookkeeping), so they take turns instead of overlapping. In its own
process the engine has its own interpreter: the trainer's rollout thread only waits on a socket.

How: :func:`builtin_server_factory` writes the run's model (class, config, weights, dtype) to one
file in the run directory; each call of the returned factory starts ``python -m
posttrain.rollout.http_engine --factory posttrain.rollout.builtin_server:serve_builtin_engine`` on
127.0.0.1 with this interpreter (:class:`~posttrain.rollout.server_process.SpawnedEngine`), which
rebuilds the model from the file and serves a :class:`~posttrain.rollout.builtin.BuiltinEngine` on it.
The loop drives it over HTTP like any engine: weight updates travel as checksummed packets
(:mod:`~posttrain.rollout.weight_transfer`), completions as JSON whose floats round-trip exactly.
Same engine code, same request seeds, same model copy: the behaviour log-probs, versions and
staleness accounting are the in-process engine's (``tests/rollout/test_builtin_server.py`` compares
a run's ledger both ways); the server's torch thread count is ``rollout.server.threads`` (default:
the trainer's at start).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from posttrain.dotted import import_dotted
from posttrain.rollout.engine import RolloutEngine

if TYPE_CHECKING:  # transformers is imported by whoever builds the model
    from transformers import PreTrainedTokenizerBase

    from posttrain.rollout.server_process import SpawnedEngine

SERVER_FACTORY = "posttrain.rollout.builtin_server:serve_builtin_engine"


def export_model(model: torch.nn.Module, path: str | Path) -> Path:
    """Write ``model``'s class (``module:qualname``), config, dtype and weights to ``path`` (``torch.save``).

    The file is what :func:`load_model` rebuilds: ``cls(config)`` with the state dict loaded, the
    way the in-process engine's :func:`copy.deepcopy` would hold it (same config object, so the same
    attention implementation and tied weights)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    cls = type(model)
    torch.save({
        "cls": f"{cls.__module__}:{cls.__qualname__}",
        "config": model.config,
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "state": {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()},
    }, p)
    return p


def load_model(path: str | Path) -> torch.nn.Module:
    """Inverse of :func:`export_model` (a model in eval mode). Loads a pickle: only files this run wrote."""
    d = torch.load(Path(path), map_location="cpu", weights_only=False)
    cls = import_dotted(str(d["cls"]), what=f"model class of {str(path)!r}", shape="package.module:Class")
    model: torch.nn.Module = cls(d["config"]).to(getattr(torch, d["dtype"]))
    model.load_state_dict(d["state"])
    return model.eval()


def serve_builtin_engine(model_file: str, eos_token_id: int | list[int] | None, pad_token_id: int,
                         tokenizer_dir: str | None = None, max_batch_size: int | None = None) -> RolloutEngine:
    """The server side's factory: a :class:`~posttrain.rollout.builtin.BuiltinEngine` on the model of
    ``model_file`` (:func:`export_model`), with the tokenizer saved in ``tokenizer_dir`` when stop
    strings need one (``None``: no tokenizer, as the Ray workers' factory)."""
    from posttrain.rollout.builtin import BuiltinEngine

    tokenizer = None
    if tokenizer_dir is not None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    return BuiltinEngine(load_model(model_file), tokenizer, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
                         max_batch_size=max_batch_size)


class BuiltinServerFactory:
    """Picklable zero-argument factory: each call starts a built-in engine server and returns its client
    (:meth:`start`).

    ``kwargs``: :func:`serve_builtin_engine`'s; ``threads``: the server's torch threads (0: this
    process's ``torch.get_num_threads()`` at the call); ``log_path``: the server's log (a process other
    than the creator, e.g. a Ray worker, writes ``<stem>.<pid>.log``)."""

    def __init__(self, kwargs: dict[str, Any], log_path: str, *, threads: int = 0, startup_timeout_s: float = 300.0,
                 timeout_s: float = 600.0) -> None:
        self.kwargs, self.log_path, self.threads = dict(kwargs), log_path, int(threads)
        self.startup_timeout_s, self.timeout_s = startup_timeout_s, timeout_s
        self.creator_pid = os.getpid()

    def server_log(self) -> str:
        """``log_path`` in the creating process, ``<stem>.<pid>.<ext>`` in any other (one writer per file)."""
        if os.getpid() == self.creator_pid:
            return self.log_path
        stem, dot, ext = self.log_path.rpartition(".")
        return f"{stem}.{os.getpid()}{dot}{ext}" if dot else f"{self.log_path}.{os.getpid()}"

    def __call__(self) -> RolloutEngine:
        """:meth:`start`, typed as the engine the loop drives (the client's ``version`` is a read-only
        property where the protocol declares an attribute; the loop only reads it)."""
        return cast("RolloutEngine", self.start())

    def start(self) -> SpawnedEngine:
        """Start a server and return its client (which owns the process: ``close()`` stops it)."""
        from posttrain.rollout.server_process import SpawnedEngine

        return SpawnedEngine(sys.executable, SERVER_FACTORY, self.kwargs, log_path=self.server_log(),
                             threads=self.threads or torch.get_num_threads(),
                             startup_timeout_s=self.startup_timeout_s, timeout_s=self.timeout_s,
                             weights_timeout_s=self.timeout_s)


def builtin_server_factory(model: torch.nn.Module, workdir: str | Path, *, eos_token_id: int | Sequence[int] | None,
                           pad_token_id: int, tokenizer: PreTrainedTokenizerBase | None = None, threads: int = 0,
                           startup_timeout_s: float = 300.0, timeout_s: float = 600.0) -> BuiltinServerFactory:
    """Export ``model`` (and ``tokenizer``, when given: stop strings) under ``workdir`` now and return the
    factory that serves it (module docstring). The server log is ``workdir/engine_server.log``."""
    work = Path(workdir)
    model_file = export_model(model, work / "engine_model" / "builtin_model.pt")
    tok_dir: str | None = None
    if tokenizer is not None:
        tok_dir = str(work / "engine_model" / "tokenizer")
        tokenizer.save_pretrained(tok_dir)
    eos = list(eos_token_id) if isinstance(eos_token_id, Sequence) else eos_token_id
    kwargs = {"model_file": str(model_file.absolute()), "eos_token_id": eos, "pad_token_id": int(pad_token_id),
              "tokenizer_dir": None if tok_dir is None else str(Path(tok_dir).absolute())}
    return BuiltinServerFactory(kwargs, str((work / "engine_server.log").absolute()), threads=threads,
                                startup_timeout_s=startup_timeout_s, timeout_s=timeout_s)


__all__ = ["BuiltinServerFactory", "builtin_server_factory", "export_model", "load_model", "serve_builtin_engine"]
