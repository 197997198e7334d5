"""Colocation hooks: the engine releases its weights during an update and re-acquires them after
(``system.engine_sleep``, ``RolloutEngine`` sleep / wake; docs/distributed.md)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from posttrain.rollout.engine import engine_sleep, engine_wake
from posttrain.rollout.http_engine import EngineHTTPServer, HTTPEngine, tiny_builtin_engine
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest
from posttrain.rollout.vllm_engine import VLLMEngine

LOOP_TESTS = Path(__file__).resolve().parents[1] / "loop"  # flaky_task lives there


def _requests() -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", [5, 6, 7 + i], SamplingParams(n=2, max_new_tokens=6, seed=10 + i, temperature=0.9))
            for i in range(2)]


def _tokens(completions: list[Any]) -> list[tuple[list[int], list[float]]]:
    return [(list(c.token_ids), list(c.logprobs)) for c in completions]


def test_builtin_sleep_frees_every_parameter_and_wake_plus_full_update_restores_the_samples() -> None:
    eng = tiny_builtin_engine("micro", seed=0, dtype="float64")
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    before = _tokens(eng.generate(_requests()))
    n_bytes = sum(p.untyped_storage().nbytes() for p in eng.model.parameters())
    assert n_bytes > 0
    assert engine_sleep(eng) is None and eng.asleep
    assert all(p.numel() == 0 and p.untyped_storage().nbytes() == 0 for p in eng.model.parameters())
    with pytest.raises(RuntimeError, match="sleep"):
        eng.generate(_requests())
    with pytest.raises(RuntimeError, match="asleep"):
        eng.update_weights(state, version=1)
    engine_wake(eng)
    assert not eng.asleep and sum(p.untyped_storage().nbytes() for p in eng.model.parameters()) == n_bytes
    with pytest.raises(RuntimeError, match="wake"):
        eng.generate(_requests())  # re-acquired but not refilled: garbage is never sampled from
    some = dict(list(state.items())[:2])
    with pytest.raises(ValueError, match="every parameter"):
        eng.update_weights(some, version=1)
    eng.update_weights(state, version=1)
    assert eng.version == 1
    assert _tokens(eng.generate(_requests())) == before  # the same weights, the same samples, exactly


def test_engine_sleep_reports_why_an_engine_keeps_its_memory() -> None:
    class Unable:
        woke = False

        def sleep(self) -> str:
            return "not on this platform"

        def wake(self) -> None:
            self.woke = True

    assert engine_sleep(object()) == "object has no sleep() hook"
    u = Unable()
    assert engine_sleep(u) == "Unable: not on this platform" and not u.woke


class _SleepyLLM:
    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def sleep(self, level: int = 1) -> None:
        self.calls.append(("sleep", level))

    def wake_up(self, tags: Any = None) -> None:
        self.calls.append(("wake_up",))


def test_vllm_sleep_level_2_only_on_cuda_with_sleep_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = _SleepyLLM()
    eng = VLLMEngine(llm=llm, eos_token_id=1, vocab_size=106, context=64, has_tokenizer=False, sleep_mode=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    why = engine_sleep(eng)
    assert why is not None and "needs CUDA" in why and llm.calls == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert engine_sleep(eng) is None
    engine_wake(eng)
    assert llm.calls == [("sleep", 2), ("wake_up",)]
    plain = VLLMEngine(llm=_SleepyLLM(), eos_token_id=1, vocab_size=106, context=64, has_tokenizer=False)
    why = engine_sleep(plain)
    assert why is not None and "enable_sleep_mode" in why


def test_sleep_and_wake_over_http() -> None:
    eng = tiny_builtin_engine("micro", seed=0, dtype="float64")
    state = {k: v.clone() for k, v in eng.model.state_dict().items()}
    server = EngineHTTPServer(eng)
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    try:
        client = HTTPEngine(f"http://127.0.0.1:{server.port}", timeout_s=30, weights_timeout_s=30)
        assert engine_sleep(client) is None and eng.asleep
        engine_wake(client)
        client.update_weights(state, version=1)
        assert not eng.asleep and client.version == 1
        assert all(torch.equal(v, eng.model.state_dict()[k]) for k, v in state.items())
    finally:
        server.shutdown()
        server.server_close()


def test_engine_sleep_is_refused_outside_sync_mode() -> None:
    from posttrain.config import ConfigError
    from posttrain.loop.validate import load_run_config

    with pytest.raises(ConfigError) as e:
        load_run_config("grpo", ["system.engine_sleep=true", "system.mode=async"])
    assert "\n" not in str(e.value) and "system.engine_sleep" in str(e.value)


# ---------------------------------------------------------------------- through the loop
BASE = ["model.path=builtin:micro", "model.dtype=float64", "task.name=flaky_task:digit_first",
        "task.kwargs={terms: 2}", "sampling.prompts_per_step=2", "sampling.group_size=4",
        "sampling.max_new_tokens=2", "eval.size=1", "eval.every=100", "logging.progress=false",
        "guards.max_truncation_rate=1.0", "steps=4", "system.mode=sync", "sft.steps=0"]


def _train(run_dir: Path, extra: list[str]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    from posttrain.loop.training_loop import train
    from posttrain.loop.validate import load_run_config

    assert train(load_run_config("grpo", [*BASE, *extra, f"run_dir={run_dir}"])).step == 4
    return load_file(str(run_dir / "checkpoints" / "step_000004" / "actor" / "model.safetensors"))


def _ledger_tokens(run_dir: Path) -> list[tuple[int, ...]]:
    from posttrain.trajectory import Ledger

    return [tuple(t.token_ids) for t in Ledger(run_dir / "ledger").read_trajectories()]


def test_loop_releases_the_engine_during_each_update_with_identical_results(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.learner.actor import PolicyLearner
    from posttrain.rollout.builtin import BuiltinEngine

    monkeypatch.syspath_prepend(str(LOOP_TESTS))
    ref = _train(tmp_path / "plain", [])
    events: list[str] = []
    engines: list[BuiltinEngine] = []
    orig = {n: getattr(BuiltinEngine, n) for n in ("sleep", "wake", "update_weights")}
    orig_update = PolicyLearner.update

    def rec(name: str) -> Any:
        def f(self: BuiltinEngine, *a: Any, **k: Any) -> Any:
            events.append(name)
            if name == "sleep":
                engines.append(self)
            return orig[name](self, *a, **k)
        return f

    def update(self: PolicyLearner, *a: Any, **k: Any) -> Any:
        # the engine's weights are freed while the learner updates
        freed = bool(engines) and all(p.untyped_storage().nbytes() == 0 for p in engines[-1].model.parameters())
        events.append("update(engine freed)" if freed else "update(engine holds weights)")
        return orig_update(self, *a, **k)

    for n in orig:
        monkeypatch.setattr(BuiltinEngine, n, rec(n))
    monkeypatch.setattr(PolicyLearner, "update", update)
    slept = _train(tmp_path / "sleep", ["system.engine_sleep=true"])
    per_step = ["sleep", "update(engine freed)", "wake", "update_weights"]
    first = events.index("sleep")
    assert events[first:] == per_step * 4, events
    assert set(ref) == set(slept) and all(torch.equal(ref[k], slept[k]) for k in ref)
    assert _ledger_tokens(tmp_path / "plain") == _ledger_tokens(tmp_path / "sleep")
    metrics = [json.loads(line) for line in (tmp_path / "sleep" / "metrics.jsonl").read_text().splitlines()]
    assert sum("grad_norm" in m for m in metrics) == 4


def test_an_engine_that_cannot_sleep_is_logged_once_not_silently_skipped(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import types

    from posttrain.loop.update import release_engine
    from posttrain.loop.validate import load_run_config

    run = types.SimpleNamespace(cfg=load_run_config("grpo", ["system.engine_sleep=true"]), engine=object(),
                                logged_once=set())
    with caplog.at_level(logging.WARNING, logger="posttrain"):  # the loop's logger, whatever its level before
        assert release_engine(run.engine, run.cfg, run.logged_once) is False
        assert release_engine(run.engine, run.cfg, run.logged_once) is False
    lines = [r.getMessage() for r in caplog.records if "system.engine_sleep" in r.getMessage()]
    assert lines == ["system.engine_sleep: the engine keeps its memory during updates (object has no sleep() hook)"]
    run.cfg = load_run_config("grpo")
    assert release_engine(run.engine, run.cfg, run.logged_once) is False
