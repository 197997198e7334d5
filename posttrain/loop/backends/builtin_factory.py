"""The built-in engine's factory: a picklable zero-argument callable building a
:class:`~posttrain.rollout.builtin.BuiltinEngine` on a copy of a model (each Ray rollout worker
calls it once, and again after a restart; the local modes call it once). No Ray needed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from posttrain.rollout.engine import RolloutEngine


class BuiltinEngineFactory:
    """Picklable engine factory: a CPU copy of the model's config + weights, engine kwargs."""

    def __init__(self, model: torch.nn.Module, engine_kwargs: Mapping[str, Any]) -> None:
        self.config = model.config
        self.cls = type(model)
        self.state = {k: v.detach().to("cpu").clone() for k, v in model.state_dict().items()}
        self.dtype = next(model.parameters()).dtype
        self.engine_kwargs = dict(engine_kwargs)

    def __call__(self) -> RolloutEngine:
        from posttrain.rollout.builtin import BuiltinEngine

        model = self.cls(self.config).to(self.dtype)
        model.load_state_dict(self.state)
        return BuiltinEngine(model.eval(), **self.engine_kwargs)


def builtin_engine_factory(model: torch.nn.Module, **engine_kwargs: Any) -> BuiltinEngineFactory:
    """A picklable factory building a :class:`BuiltinEngine` on a copy of ``model`` (weights at call time).

    ``engine_kwargs`` go to ``BuiltinEngine`` (``eos_token_id``, ``max_batch_size``, ...; no tokenizer
    object needed unless stop strings are used — then pass a picklable tokenizer).
    """
    return BuiltinEngineFactory(model, engine_kwargs)


__all__ = ["BuiltinEngineFactory", "builtin_engine_factory"]
