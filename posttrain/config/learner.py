"""``learner``: where and how the policy update runs (docs/distributed.md).

What needs this machine (a visible GPU for ``device=cuda``; native bf16 or CUDA for ``precision=bf16``) is
checked by :func:`posttrain.loop.validate.validate_run`; :meth:`LearnerConfig.resolved_device`
queries CUDA only when called (by the loop), never at load.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.section import Section


class LearnerConfig(Section):
    """Where and how the policy update runs (docs/distributed.md).

    ``single``: the learner lives in the driver process (today's embedded learner). ``ddp`` /
    ``fsdp2``: ``world_size`` learner rank processes (127.0.0.1, gloo on CPU / NCCL on CUDA) driven
    by the loop; each rank computes a token-balanced share of every mini-batch. ``ddp`` replicates
    the model and all-reduces gradients; ``fsdp2`` shards parameters, gradients and AdamW state with
    ``torch.distributed.fsdp.fully_shard``. Rank 0 returns each update's metrics and streams the
    gathered weights to the driver in checksummed buckets (``weight_bucket_mb``).
    """

    strategy: Literal["single", "ddp", "fsdp2"] = Field(
        default="single", description="single: embedded learner; ddp: replicated ranks, gradient all-reduce; fsdp2: "
        "sharded parameters / gradients / optimizer state (fully_shard)")
    world_size: int = Field(default=1, ge=1, description="learner rank processes (> 1 needs strategy ddp or fsdp2)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="auto: cuda when a GPU is visible and the strategy runs ranks, else cpu; cuda: one GPU "
        "per rank (NCCL), an error when no GPU is visible")
    precision: Literal["fp32", "bf16"] = Field(
        default="fp32", description="bf16: mixed precision with float32 master weights (fsdp2: MixedPrecisionPolicy with "
        "float32 gradient reduction; single / ddp: autocast); on CPU single / ddp only, and only where the CPU has native "
        "bf16 products (AVX512_BF16 or AMX-BF16), refused elsewhere")
    rank_timeout_s: float = Field(
        default=600.0, gt=0, description="a rank call (update, log-probs, state) that gets no reply for this long fails "
        "the run naming the silent ranks; a rank process that exits is detected within 0.5 s")
    startup_timeout_s: float = Field(default=120.0, gt=0, description="bound on starting the ranks (process group + model)")
    weight_bucket_mb: float = Field(
        default=64.0, gt=0, description="after each update the ranks gather the weights and stream them to the driver in "
        "buckets of at most this many MiB (each versioned and checksummed); bounds the full-tensor copies any "
        "rank holds at once")

    @model_validator(mode="after")
    def _check_learner(self) -> LearnerConfig:
        if self.world_size > 1 and self.strategy == "single":
            raise ValueError(f"learner.world_size={self.world_size} needs learner.strategy=ddp or fsdp2")
        return self

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` is cuda only when a GPU is visible and the strategy runs ranks."""
        if self.device != "auto":
            return self.device
        if self.strategy == "single":
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.world_size else "cpu"
