"""The ``learner:`` recipe section: validated at load, one-line errors naming the key."""

from __future__ import annotations

import pytest
import torch

from posttrain.config import ConfigError
from posttrain.loop.validate import load_run_config


def _err(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as e:
        load_run_config("grpo", overrides)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


def test_defaults_are_the_embedded_learner() -> None:
    cfg = load_run_config("grpo")
    assert (cfg.learner.strategy, cfg.learner.world_size, cfg.learner.precision) == ("single", 1, "fp32")
    assert cfg.learner.resolved_device() == "cpu"


def test_world_size_above_one_needs_a_rank_strategy() -> None:
    assert "learner.world_size=2 needs learner.strategy=ddp or fsdp2" in _err(["learner.world_size=2"])
    assert "learner.world_size" in _err(["learner.strategy=ddp", "learner.world_size=0"])
    cfg = load_run_config("grpo", ["learner.strategy=fsdp2", "learner.world_size=2"])
    assert (cfg.learner.strategy, cfg.learner.world_size) == ("fsdp2", 2)


def test_cuda_without_a_gpu_is_a_one_line_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "learner.device=cuda but no CUDA GPU is visible" in _err(["learner.strategy=ddp", "learner.device=cuda"])
    # auto never picks a GPU that is not there
    cfg = load_run_config("grpo", ["learner.strategy=ddp", "learner.world_size=2"])
    assert cfg.learner.resolved_device() == "cpu"


def test_cpu_bf16_is_refused_without_native_bf16_and_for_fsdp2(monkeypatch: pytest.MonkeyPatch) -> None:
    import posttrain.rollout.precision as precision

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))  # no native bf16
    assert "learner.precision=bf16 needs a CPU with native bf16" in _err(["learner.precision=bf16"])
    assert "learner.precision=bf16 needs a CPU with native bf16" in _err(["learner.strategy=ddp",
                                                                         "learner.precision=bf16"])
    assert "learner.strategy=fsdp2 needs learner.device=cuda" in _err(
        ["learner.strategy=fsdp2", "learner.precision=bf16", "learner.device=cpu"])
    monkeypatch.setattr(precision, "cpu_flags", lambda: frozenset({"avx512f", "avx512_bf16"}))
    cfg = load_run_config("grpo", ["learner.precision=bf16"])
    assert cfg.learner.precision == "bf16"


def test_rank_strategies_refuse_lora_and_bad_names() -> None:
    assert "does not support LoRA" in _err(["learner.strategy=ddp", "lora.rank=4"])
    assert "learner.strategy" in _err(["learner.strategy=zero3"])
    assert "learner.rank_timeout_s" in _err(["learner.rank_timeout_s=0"])


def test_placement_keys_may_change_on_resume_precision_may_not() -> None:
    from posttrain.loop.run_dir import recipe_diff

    old = load_run_config("grpo", ["learner.strategy=fsdp2", "learner.world_size=2"]).model_dump(mode="json")
    moved = load_run_config("grpo", ["learner.strategy=ddp", "learner.world_size=3", "learner.device=cpu",
                                 "learner.rank_timeout_s=5", "learner.startup_timeout_s=5",
                                 "learner.weight_bucket_mb=1"]).model_dump(mode="json")
    assert recipe_diff(old, moved) == []
    single = load_run_config("grpo").model_dump(mode="json")
    assert recipe_diff(old, single) == []
    changed = dict(moved, learner={**moved["learner"], "precision": "bf16"}, seed=old["seed"] + 1)
    assert recipe_diff(old, changed) == ["learner.precision: 'fp32' -> 'bf16'", f"seed: {old['seed']} -> {old['seed'] + 1}"]
    assert "learner.weight_bucket_mb" in _err(["learner.weight_bucket_mb=0"])
