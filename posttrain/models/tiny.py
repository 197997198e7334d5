"""Tiny Qwen2-style causal LMs built from a config (no weights downloaded).

Presets give the sizes the tests, demo and benchmarks use; any ``transformers`` causal LM works
elsewhere in the framework, these are only the embedded defaults.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

TINY_PRESETS: dict[str, dict[str, int]] = {
    # ~0.1M parameters: unit tests.
    "micro": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    # ~0.9M: the demo.
    "tiny": dict(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # ~3M: rollout benchmark.
    "3m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    # ~25M: rollout benchmark.
    "25m": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4),
}


def build_tiny_model(
    preset: str = "micro",
    vocab_size: int = 106,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int = 512,
    pad_token_id: int = 0,
    eos_token_id: int = 1,
    bos_token_id: int = 2,
    **overrides: Any,
) -> Qwen2ForCausalLM:
    """A randomly initialised ``Qwen2ForCausalLM`` of the named preset, deterministic by ``seed``.

    Uses eager attention so results are bitwise reproducible on CPU.
    """
    if preset not in TINY_PRESETS:
        raise ValueError(f"unknown tiny model preset {preset!r}; valid: {', '.join(TINY_PRESETS)}")
    kw: dict[str, Any] = dict(TINY_PRESETS[preset])
    kw.update(overrides)
    cfg = Qwen2Config(
        vocab_size=vocab_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=bos_token_id,
        # transformers' @strict(accept_kwargs=True) configs take attn_implementation as an extra
        # keyword, which their dataclass_transform signature cannot declare.
        attn_implementation="eager",  # type: ignore[call-arg]
        **kw,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(cfg)
    # Both convert in place. transformers wraps PreTrainedModel.to with functools.wraps (mypy reads it
    # unbound) and leaves PreTrainedModel.eval unannotated.
    model.to(dtype)  # type: ignore[arg-type]
    model.eval()  # type: ignore[no-untyped-call]
    return model


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameters (tied embeddings counted once)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
