"""``posttrain sample`` samples with the recipe's engine: ``rollout.engine`` names an entry of the engine registry
(posttrain/config/engines.py), built by ``build_engine`` with the output directory as its work directory, started
only when a step is left to sample and closed at the end and on Ctrl-C; ``request.json`` and ``summary.json``
record the engine, and a resume with another engine is one line naming ``rollout.engine``.

The engine here is a toy entry registered by this test only (the built-in engine under another name, which
records where it was built and that it was closed), so its pass is the builtin pass sample for sample."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import posttrain.loop.rejection_sampling as rs
from posttrain.cli import main
from posttrain.config.engines import ENGINES, EngineEntry
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.trajectory import Ledger

pytestmark = pytest.mark.timeout(300)

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "sampling.prompts_per_step=2",
        "sampling.max_new_tokens=4", "eval.size=10", "logging.progress=false"]

EVENTS: list[str] = []  # "built in DIR" / "closed", in order, per toy engine of this process


class ToyEngine(BuiltinEngine):
    """The built-in engine under another name, with a ``close`` that says it ran (a server engine's stops its
    process)."""

    def close(self) -> None:
        EVENTS.append("closed")


class ToyFactory:
    """A :class:`ToyEngine` over a copy of the weights taken when the factory was made."""

    def __init__(self, model: torch.nn.Module, eos: int, pad: int, workdir: Path) -> None:
        self.model, self.eos, self.pad, self.workdir = model, eos, pad, workdir

    def __call__(self) -> ToyEngine:
        EVENTS.append(f"built in {self.workdir}")
        return ToyEngine(self.model, eos_token_id=self.eos, pad_token_id=self.pad)


def toy_factory(cfg: Any, model: torch.nn.Module, tokenizer: Any, workdir: Path) -> Callable[[], ToyEngine]:
    """The toy entry's factory function: ``(cfg, model, tokenizer, workdir) -> Callable[[], RolloutEngine]``."""
    return ToyFactory(copy.deepcopy(model).eval(), int(tokenizer.eos_token_id), int(tokenizer.pad_token_id or 0),
                      Path(workdir))


@pytest.fixture(autouse=True)
def toy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(ENGINES, "toy", EngineEntry("toy", "a test engine", f"{__name__}:toy_factory"))
    EVENTS.clear()


def _args(out: Path, *extra: str, prompts: int = 4) -> list[str]:
    return ["sample", "grpo", *TINY, *extra, "--k", "3", "--prompts", str(prompts), "--keep-per-prompt", "2",
            "--out", str(out), "--no-progress"]


def _samples(out: Path) -> tuple[str, list[tuple[Any, ...]]]:
    trajs = Ledger(out / "ledger").read_trajectories()
    return ((out / "sft.jsonl").read_text(), [(t.traj_id, t.token_ids.tolist(), t.status, t.meta["kept"],
                                               t.meta["response"]) for t in trajs])


def test_the_recipes_engine_samples_and_is_closed(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "toy"
    assert main(_args(out, "rollout.engine=toy")) == 0
    assert EVENTS == [f"built in {out}", "closed"]  # once, in --out, closed at the end
    summary = json.loads(capsys.readouterr().out)
    assert summary["engine"] == "toy" and json.loads((out / "summary.json").read_text()) == summary
    assert json.loads((out / "request.json").read_text())["engine"] == "toy"
    assert main(_args(tmp_path / "builtin")) == 0  # the builtin engine in process: not the registry's toy
    assert EVENTS == [f"built in {out}", "closed"]
    assert json.loads((tmp_path / "builtin" / "request.json").read_text())["engine"] == "builtin"
    assert _samples(out) == _samples(tmp_path / "builtin")  # the toy is the builtin engine: the same pass


def test_ctrl_c_closes_the_engine_and_a_finished_pass_starts_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rs"
    real = rs.play_once

    def ctrl_c(*a: Any, **kw: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(rs, "play_once", ctrl_c)
    assert main(_args(out, "rollout.engine=toy")) == 130
    assert EVENTS == [f"built in {out}", "closed"]
    monkeypatch.setattr(rs, "play_once", real)
    assert main(_args(out, "rollout.engine=toy", "--resume")) == 0
    assert EVENTS == [f"built in {out}", "closed"] * 2
    capsys.readouterr()
    assert main(_args(out, "rollout.engine=toy", "--resume")) == 0  # every step read back: no engine started
    assert json.loads(capsys.readouterr().out)["resumed_after_step"] == 2 and len(EVENTS) == 4


def test_a_resume_with_another_engine_is_one_line_and_touches_nothing(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rs"
    assert main(_args(out, "rollout.engine=toy", prompts=2)) == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(_args(out, "--resume", prompts=4)) == 2
    assert capsys.readouterr().err == (
        f"posttrain sample: error: --out {out} was sampled with rollout.engine=toy, this command has "
        "rollout.engine=builtin; resume with rollout.engine=toy, or pass --force to start over\n")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before and len(EVENTS) == 2


def test_a_request_without_engine_was_the_builtin_engines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rs"
    assert main(_args(out, prompts=2)) == 0
    request = json.loads((out / "request.json").read_text())
    del request["engine"]  # as every pass before posttrain sample used rollout.engine wrote it
    (out / "request.json").write_text(json.dumps(request))
    capsys.readouterr()
    assert main(_args(out, "rollout.engine=toy", "--resume", prompts=4)) == 2
    assert capsys.readouterr().err == (
        f"posttrain sample: error: --out {out} was sampled by the builtin engine (its request.json names no engine), "
        "this command samples with rollout.engine=toy; pass --force to start over\n")
    assert main(_args(out, "--resume", prompts=4)) == 0  # the builtin engine goes on with it
    assert json.loads(capsys.readouterr().out)["resumed_after_step"] == 1 and EVENTS == []
    assert json.loads((out / "request.json").read_text())["engine"] == "builtin"
