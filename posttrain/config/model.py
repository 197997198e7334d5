"""The models a run trains: the actor (``model``), its LoRA adapters (``lora``) and the critic (``critic``).

Whether ``model.path`` exists on this machine is checked by the loop-side
:func:`posttrain.loop.validate.validate_run`, not here: these models hold what the recipe says.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from posttrain.config.section import Section


class ModelConfig(Section):
    """The actor (and, by default, reference) model."""

    path: str = Field(
        default="builtin:tiny",
        description="'builtin:<preset>' (a randomly initialised tiny Qwen2 of posttrain.models.TINY_PRESETS "
        "with the char tokenizer), 'builtin:smollm2-135m-instruct', or a local Hugging Face model directory "
        "(e.g. a posttrain checkpoint's actor/ folder)",
    )
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    init_seed: int = Field(default=0, description="seed of the random init of builtin presets")


class LoraConfig(Section):
    """LoRA adapters on the policy (peft; Hu et al. 2021, arXiv:2106.09685): only the adapters train,
    the rollout engine and checkpoints' ``actor/`` get the merged weights ``W + (alpha/r) B A``."""

    rank: int = Field(default=0, ge=0, description="adapter rank r; 0 = full fine-tuning (no LoRA)")
    alpha: float | None = Field(default=None, gt=0, description="scaling alpha (default 2 * rank)")
    target_modules: list[str] | str | None = Field(
        default=None, description="module names to adapt, 'all-linear', or None = peft's default for the architecture"
    )
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0, description="adapter dropout (must be 0 with gradient checkpointing)")


class CriticConfig(Section):
    """Optional learned critic (PPO + GAE)."""

    enabled: bool = False
    lr: float = Field(default=1e-3, ge=0.0)
    shared_backbone: bool = False
    value_clip: float | None = Field(default=0.2, gt=0)
