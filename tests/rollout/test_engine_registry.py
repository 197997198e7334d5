"""A new rollout engine is one module and one registry entry (posttrain/config/engines.py): a toy engine
registered here only (its factory is :func:`toy_factory` of this module) is accepted by the config as
``rollout.engine=toy``, built by ``engine_factory`` (picklable, for the Ray workers) and ``build_engine``, and
trains a step; no production file names it."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.config.engines import ENGINES, EngineEntry
from posttrain.loop.builders import build_engine, build_model, engine_factory
from posttrain.loop.training_loop import train
from posttrain.loop.validate import load_run_config
from posttrain.rollout.builtin import BuiltinEngine

pytestmark = pytest.mark.timeout(180)

SMALL = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
         "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=4", "eval.every=100",
         "logging.progress=false", "guards.max_truncation_rate=1.0", "checkpoint_every=0", "sft.steps=0"]

BUILT: list[str] = []  # one line per toy engine built (in this process)


class ToyEngine(BuiltinEngine):
    """The built-in engine under another name: what a plug-in engine module would define."""


class ToyFactory:
    """Picklable: a :class:`ToyEngine` over a copy of the weights taken when the factory was made."""

    def __init__(self, model: torch.nn.Module, eos: int, pad: int) -> None:
        self.model, self.eos, self.pad = model, eos, pad

    def __call__(self) -> ToyEngine:
        BUILT.append("toy")
        return ToyEngine(self.model, eos_token_id=self.eos, pad_token_id=self.pad)


def toy_factory(cfg: Any, model: torch.nn.Module, tokenizer: Any, workdir: Path) -> Callable[[], ToyEngine]:
    """The toy entry's factory function: ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]``."""
    import copy

    return ToyFactory(copy.deepcopy(model).eval(), int(tokenizer.eos_token_id), int(tokenizer.pad_token_id or 0))


@pytest.fixture
def toy(monkeypatch: pytest.MonkeyPatch) -> EngineEntry:
    entry = EngineEntry("toy", "a test engine", f"{__name__}:toy_factory")
    monkeypatch.setitem(ENGINES, "toy", entry)
    BUILT.clear()
    return entry


def test_a_registered_engine_is_accepted_and_built(toy: EngineEntry, tmp_path: Path) -> None:
    cfg = load_run_config("grpo", [*SMALL, "rollout.engine=toy"])
    assert cfg.rollout.engine == "toy" and cfg.rollout.builtin_precision() == "auto"
    tok, model = build_model(cfg)
    factory = pickle.loads(pickle.dumps(engine_factory(cfg, model, tok, tmp_path)))  # as a Ray worker gets it
    assert isinstance(factory(), ToyEngine)
    engine = build_engine(model, tok, cfg, tmp_path)  # the local backend: built, then probed with one request
    assert isinstance(engine, ToyEngine) and BUILT == ["toy", "toy"]


def test_a_run_samples_with_the_registered_engine(toy: EngineEntry, tmp_path: Path) -> None:
    st = train(load_run_config("grpo", [*SMALL, "steps=1", f"run_dir={tmp_path / 'run'}", "rollout.engine=toy"]))
    assert st.step == 1 and BUILT == ["toy"]


def test_the_builtin_only_keys_are_refused_for_it(toy: EngineEntry) -> None:
    with pytest.raises(ConfigError, match=r"rollout.process=server applies to rollout.engine=builtin only"):
        load_run_config("grpo", [*SMALL, "rollout.engine=toy", "rollout.process=server"])
    with pytest.raises(ConfigError, match=r"rollout.precision=bf16 applies to rollout.engine=builtin only "
                       r"\(rollout.engine=toy computes in its own dtype\)"):
        load_run_config("grpo", [*SMALL, "rollout.engine=toy", "rollout.precision=bf16"])


def test_an_entry_whose_factory_does_not_resolve_is_one_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(ENGINES, "lost", EngineEntry("lost", "nowhere", f"{__name__}:no_such_factory"))
    cfg = load_run_config("grpo", [*SMALL, "rollout.engine=lost"])
    tok, model = build_model(cfg)
    with pytest.raises(ValueError, match=r"^rollout engine 'lost' factory: module '.*' has no attribute "
                       r"'no_such_factory'"):
        engine_factory(cfg, model, tok, tmp_path)
