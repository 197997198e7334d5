"""What watches a run: held-out evaluation and promotion (``eval``), guards (``guards``) and the
metric sinks (``logging``).

The hidden verifier is built, and the tracker packages are looked up, by
:func:`posttrain.loop.validate.validate_run`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.section import Section


class EvalConfig(Section):
    """Held-out evaluation and the promote / reject rule."""

    every: int = Field(default=10, ge=1, description="evaluate every N steps (and at the start and end)")
    size: int = Field(default=200, ge=1, description="held-out prompts")
    temperature: float = Field(default=0.0, ge=0.0, description="0 = greedy; the accuracy that promotes / rejects")
    sampled_temperature: float | None = Field(
        default=None, gt=0.0, description="also report held-out accuracy sampled at this temperature (heldout_sampled/*)")
    max_new_tokens: int | None = Field(default=None, ge=1, description="default: sampling.max_new_tokens")
    heldout_seed: int | None = Field(
        default=None, description="the seed every held-out set's problems are drawn with; null = the run's seed. Set "
        "it (e.g. 0) so every seed of a recipe is evaluated on the same problems (seed spreads then compare like "
        "with like); the run's seed still orders the training data and seeds sampling. Held-out and training "
        "problems stay disjoint by problem either way (posttrain/envs/task.py)")
    reject_drop: float = Field(default=0.5, ge=0.0, le=1.0, description="reject a revision whose held-out accuracy falls "
                               "more than this below the best promoted one (restore the promoted weights)")
    k: int = Field(default=1, ge=1, description="report heldout/pass@k (unbiased estimator, Chen et al. 2021) and pass@1 "
                   "over eval.samples sampled responses per held-out prompt")
    samples: int | None = Field(default=None, ge=1, description="n sampled responses per held-out prompt for pass@k "
                                "(>= k; default k), drawn at eval.temperature if > 0 else eval.sampled_temperature")
    hidden_verifier: str | None = Field(
        default=None, description="evaluation-only verifier (registered name or module.path:factory) that re-judges every "
        "training and held-out response; verdicts go to the ledger / heldout/hidden/* beside the training "
        "verifier's and never into the reward (posttrain/rewards/hidden.py)")
    hidden_verifier_kwargs: dict[str, Any] = Field(default_factory=dict,
                                                   description="keyword arguments of eval.hidden_verifier")

    def heldout_seed_of(self, run_seed: int) -> int:
        """The seed the held-out sets are drawn with: ``heldout_seed``, else the run's ``run_seed``."""
        return run_seed if self.heldout_seed is None else self.heldout_seed

    @model_validator(mode="after")
    def _check_passk(self) -> EvalConfig:
        if self.samples is None:
            self.samples = self.k  # resolved in the saved config.yaml
        if self.samples < self.k:
            raise ValueError(f"eval.samples={self.samples} must be >= eval.k={self.k}")
        if self.samples > 1 and self.temperature == 0 and self.sampled_temperature is None:
            raise ValueError(f"eval.samples={self.samples} needs sampled responses: set eval.sampled_temperature "
                             "(or eval.temperature > 0); greedy samples are all the same")
        if self.hidden_verifier is None and self.hidden_verifier_kwargs:
            raise ValueError("eval.hidden_verifier_kwargs is set but eval.hidden_verifier is not")
        return self


class GuardsConfig(Section):
    """Monitors: thresholds that warn or stop the run with a reason."""

    action: Literal["warn", "stop"] = "warn"
    max_abs_log_kappa: float = Field(default=1e-2, gt=0, description="behavior vs recomputed old log-prob (max |log k|)")
    min_entropy: float = Field(default=1e-3, ge=0, description="entropy collapse")
    max_truncation_rate: float = Field(default=0.9, ge=0, le=1)
    max_zero_adv_fraction: float = Field(default=1.0, ge=0, le=1)
    min_response_length: float = Field(default=0.0, ge=0)
    max_infra_error_fraction: float = Field(
        default=1.0, gt=0, le=1, description="warn (stop with action: stop) when this fraction of a step's or an evaluation's "
        "verifications has no verdict (infra_error / env_failure); 1.0 = when every one failed")


class LoggingConfig(Section):
    """Where each step's metrics go: ``metrics.jsonl`` always, and the trackers switched on here
    (each receives the resolved config once and every step's numeric metrics; docs/diagnostics.md)."""

    tensorboard: bool = Field(default=False, description="TensorBoard event files in RUN_DIR/tensorboard")
    wandb: bool = Field(default=False, description="a Weights & Biases run (files under RUN_DIR/wandb); WANDB_MODE=offline "
                        "works without an account")
    wandb_project: str | None = Field(default=None, description="W&B project (default 'posttrain'); needs logging.wandb")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        default=None, description="W&B mode (default: the WANDB_MODE environment variable, else W&B's own default); "
        "needs logging.wandb")
    mlflow: bool = Field(default=False, description="an MLflow run (params = the resolved config, metrics by step)")
    mlflow_tracking_uri: str | None = Field(default=None, description="MLflow tracking URI (default: a file store in "
                                            "RUN_DIR/mlruns); needs logging.mlflow")
    mlflow_experiment: str | None = Field(default=None, description="MLflow experiment (default 'posttrain'); needs "
                                          "logging.mlflow")
    progress: bool = True

    @model_validator(mode="after")
    def _check_trackers(self) -> LoggingConfig:
        # A tracker key whose tracker is off would do nothing: refused, as every dead setting.
        for key, owner in (("wandb_project", "wandb"), ("wandb_mode", "wandb"),
                           ("mlflow_tracking_uri", "mlflow"), ("mlflow_experiment", "mlflow")):
            if getattr(self, key) is not None and not getattr(self, owner):
                raise ValueError(f"logging.{key} has no effect without logging.{owner}=true")
        return self
