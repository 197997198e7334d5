"""``rollout.vllm.max_model_len`` is the context every budget check and episode cap reads.

vLLM stops a sample at ``max_model_len`` without an error (its scheduler's length stop), but the run
checked its prompts and token budgets, and capped episode turns, against the model's
``max_position_embeddings``: a ``max_model_len`` smaller than prompt + ``sampling.max_new_tokens`` was
accepted and cut every response short, silently, and an episode could send vLLM a context it refuses.
The checks are those of the built-in engine (no vLLM needed here: the configs are parsed, not run).
"""

from __future__ import annotations

import pytest

from posttrain.config import parse_config
from posttrain.loop.builders import build_model, build_renderer, build_task


def _cfg(**vllm: object) -> object:
    data = {"model": {"path": "builtin:micro"}, "task": {"name": "chain_sum", "kwargs": {"terms": 2}},
            "sampling": {"max_new_tokens": 8}, "eval": {"size": 4}}
    if vllm:
        data["rollout"] = {"engine": "vllm", "vllm": vllm}
    return parse_config(data, "test")


def test_the_engine_context_is_the_smaller_of_the_model_and_max_model_len() -> None:
    from posttrain.loop.episode_rollout import engine_context

    plain = _cfg()
    _, model = build_model(plain)
    n = model.config.max_position_embeddings
    assert engine_context(plain, model) == n
    assert engine_context(_cfg(max_model_len=16), model) == 16
    assert engine_context(_cfg(max_model_len=n + 100), model) == n  # never beyond the model's positions
    assert engine_context(_cfg(dtype="float32"), model) == n  # vLLM's default: the model's own


def test_a_max_model_len_without_room_for_the_budget_is_refused_naming_it() -> None:
    from posttrain.loop.parts import check_run_prompts

    cfg = _cfg(max_model_len=11)  # held-out prompts of 4 tokens ('2+9='): 4 + 8 new tokens do not fit 11
    tok, model = build_model(cfg)
    task = build_task(cfg)
    heldout = list(task.examples("heldout", 4, seed=0))
    with pytest.raises(ValueError, match=r"^rollout\.vllm\.max_model_len=11: .*prompt of 4 tokens \+ max_new_tokens=8"):
        check_run_prompts(cfg, task, heldout, tok, model, build_renderer(cfg, tok))
    ok = _cfg(max_model_len=12)  # 4 + 8 fit exactly
    check_run_prompts(ok, task, heldout, tok, model, build_renderer(ok, tok))
