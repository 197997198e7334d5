"""Typed run configuration: the single source of truth for keys, defaults and validation.

A recipe is a YAML file validated into :class:`RunConfig`; ``key=value`` overrides on the
command line address nested keys with dots (``optim.lr=3e-4``) and are parsed as YAML
scalars. Unknown keys and wrong types are errors that name the key. The six axes of a recipe
(feedback, sampling, credit, correction, reduction, system) each have their own section.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from posttrain.loop.backends.config import RayBackendConfig
from posttrain.rollout.config import RolloutConfig

RECIPES_DIR = Path(__file__).parent / "recipes"
_log = logging.getLogger(__name__)


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(_Section):
    """The actor (and, by default, reference) model."""

    path: str = Field(
        "builtin:tiny",
        description="'builtin:<preset>' (a randomly initialised tiny Qwen2 of posttrain.models.TINY_PRESETS "
        "with the char tokenizer), 'builtin:smollm2-135m-instruct', or a local Hugging Face model directory "
        "(e.g. a posttrain checkpoint's actor/ folder)",
    )
    dtype: Literal["float32", "float64", "bfloat16"] = "float32"
    init_seed: int = Field(0, description="seed of the random init of builtin presets")

    @field_validator("path")
    @classmethod
    def _check_local_path(cls, path: str) -> str:
        # Nothing is fetched from the hub, so a local directory must exist now: otherwise the run
        # directory is created first and transformers fails later with a hub-lookup traceback.
        if path.startswith("builtin:"):
            return path
        d = Path(path).expanduser()
        if not d.is_dir():
            raise ValueError(f"{path!r} is not a local model directory (no such directory; builtin models are "
                             "'builtin:<preset>')")
        if not (d / "config.json").is_file():
            raise ValueError(f"{path!r} has no config.json (not a Hugging Face model directory)")
        return path


class TaskConfig(_Section):
    """Feedback axis: the task (prompt source + verifier)."""

    name: str = Field("arithmetic", description="a name in posttrain.envs TASKS, or 'module.path:factory'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task factory")
    chat_template: bool | Literal["auto"] = Field(
        "auto", description="render single-turn prompts with the tokenizer's chat template: true | false | auto "
        "(auto = when the tokenizer has one and the model is not a posttrain char-tokenizer model; "
        "posttrain/envs/prompt_render.py)")
    system_prompt: str | None = Field(None, description="system message put before every prompt (a first line in "
                                      "raw-text mode)")


class EnvConfig(_Section):
    """Multi-turn episodes (docs/tasks_and_verifiers.md, "Write your own tool environment"): with ``name``
    set the run trains on episodes of that environment instead of single-turn ``task`` prompts."""

    name: str | None = Field(None, description="a name in posttrain.envs.episodes ENVS (calculator_tool, "
                             "python_tool, calculator_tags, python_tags) or 'package.module:factory'; None = "
                             "single-turn task")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment factory")
    max_turns: int = Field(4, ge=1, description="policy turns per episode; more ends it as truncated")
    max_tokens: int = Field(256, ge=2, description="tokens of the whole episode (prompt + actions + observations); "
                            "reaching it ends the episode as truncated. Each turn also has sampling.max_new_tokens")
    max_wall_s: float | None = Field(60.0, gt=0, description="wall seconds per episode; past it the episode ends "
                                     "as truncated at its next turn (None = no limit)")
    tool_prompt: Literal["auto", "template", "preamble", "none"] = Field(
        "auto", description="how the tool schemas reach the model: the chat template's tools= (template), a "
        "plain-text preamble (preamble), auto = template if the chat template mentions tools else preamble, none")
    system: str | None = Field(None, description="system message of every episode")
    use_chat_template: bool = Field(True, description="render turns with the tokenizer's chat template")
    stop_strings: list[str] = Field(default_factory=list, description="end a policy turn at these strings (e.g. "
                                    "'</tool_call>', '</answer>')")
    heldout_fraction: float = Field(0.2, gt=0, lt=1, description="problems (by first observation) held out")
    eval_without_tools: bool = Field(False, description="also evaluate the same held-out episodes with tools "
                                     "disabled (heldout_notool/*): success without the tool beside it")


class RewardFunctionConfig(_Section):
    """A user reward function by dotted path (signature and contract: posttrain/rewards/plugins.py)."""

    path: str = Field(description="'package.module:function', called as fn(response, reference, *, prompt, meta) "
                      "-> float | Verdict (sync or async)")
    weight: float = Field(1.0, description="weight of its component in the total (entered into reward.weights)")
    name: str | None = Field(None, description="component name (default: the function's name)")

    @model_validator(mode="after")
    def _resolve(self) -> RewardFunctionConfig:
        from posttrain.rewards.plugins import check_reward_function

        check_reward_function(self.path, f"reward.functions {self.path!r}")  # import + signature, now
        if self.name is None:
            self.name = self.path.rpartition(":")[2].rpartition(".")[2]
        return self


class RewardConfig(_Section):
    """Feedback axis: how verdict components become the scalar reward."""

    weights: dict[str, float] = Field(default_factory=lambda: {"task": 1.0}, description="component -> weight")
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="user reward functions by dotted path, each a raw component added to the "
        "task verifier's; its weight is entered into reward.weights (docs/tasks_and_verifiers.md)")

    @model_validator(mode="after")
    def _merge_function_weights(self) -> RewardConfig:
        names = [str(f.name) for f in self.functions]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward.functions: component name(s) {dup} used twice (set name: on each)")
        merged = dict(self.weights)
        for f in self.functions:
            assert f.name is not None  # set by RewardFunctionConfig
            if f.name in merged and merged[f.name] != f.weight:
                raise ValueError(f"reward.functions {f.name!r}: weight {f.weight} conflicts with "
                                 f"reward.weights.{f.name}={merged[f.name]} (give it in one place)")
            merged[f.name] = f.weight
        if merged != self.weights:
            self.weights = merged  # the resolved config shows every weight that enters the total
        return self
    extract: Literal["none", "auto", "last_number", "boxed", "answer_tag", "answer_line"] = Field(
        "none", description="read the final answer from a free-form response before the task's verifier judges it; "
        "nothing readable -> invalid (posttrain/rewards/extract.py)")
    overlong_max_len: int | None = Field(None, ge=1, description="DAPO soft overlong punishment L_max (None = off)")
    overlong_cache_len: int = Field(0, ge=0, description="DAPO overlong cache window L_cache")
    workers: int = Field(0, ge=0, description="verifier worker processes (0 = verify in-process)")
    timeout_s: float = Field(10.0, gt=0, description="per-verification time limit")
    retries: int = Field(1, ge=0, description="retries of a verification that hit an infra error")


class SamplingConfig(_Section):
    """Sampling-structure axis: how many rollouts per prompt and under which sampler."""

    prompts_per_step: int = Field(16, ge=1)
    group_size: int = Field(8, ge=1, description="G samples per prompt")
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    replay_truncation: bool = Field(
        True, description="with top_k > 0 or top_p < 1, the learner's pi_theta / pi_old / pi_ref are the sampler's "
        "truncated distribution (softmax renormalised over the kept set, recomputed from the learner's logits, "
        "the sampled token always kept), so kappa = pi_old / mu stays ~1; false: the full softmax (kappa then "
        "includes the truncation). docs/learner.md")
    max_new_tokens: int = Field(16, ge=1)
    dynamic_sampling: bool = Field(False, description="DAPO: drop groups whose rewards are all equal and oversample")
    max_sampling_rounds: int = Field(4, ge=1, description="oversampling rounds before giving up filling the batch")


class CreditConfig(_Section):
    """Credit axis: the advantage / return estimator."""

    estimator: str = Field("grpo", description="a name in posttrain.algos.ADVANTAGES, or 'package.module:function' "
                           "(same signature; checked at config load)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    kl_in_reward: bool = Field(False, description="subtract kl_coef * KL(token) from token rewards (PPO style)")


class CorrectionConfig(_Section):
    """Behavior-correction axis (train/inference mismatch, staleness)."""

    name: str | None = Field(None, description="a name in posttrain.algos.CORRECTIONS, or None")
    kwargs: dict[str, Any] = Field(default_factory=dict)


class LossConfig(_Section):
    """Policy loss and the reduction axis."""

    policy_loss: str = Field("ppo_clip", description="a name in posttrain.algos.POLICY_LOSSES, or "
                             "'package.module:function' (same signature; checked at config load)")
    kwargs: dict[str, Any] = Field(default_factory=dict)
    reduction: str = Field("token_mean", description="a name in posttrain.algos.REDUCTIONS")
    kl_estimator: str | None = Field(None, description="a name in KL_ESTIMATORS; None = no reference model")
    kl_coef: float = Field(0.0, ge=0.0)
    kl_target: float | None = Field(None, gt=0, description="adaptive KL controller target, in the logged KL's "
                                    "unit (mean per-token estimate: `kl`, or `kl/ref_mean` with credit.kl_in_reward); "
                                    "kl_coef is its starting beta (None = fixed coef; Ziegler et al. 2019)")
    kl_horizon: int = Field(10000, ge=1, description="adaptive KL controller horizon in samples (sequences, as in "
                            "Ziegler et al. 2019's code): each step beta *= 1 + min(n/kl_horizon, 1) * "
                            "clip(kl/kl_target - 1, -0.2, 0.2), n = prompts_per_step * group_size")
    entropy_coef: float = Field(0.0)


class OptimConfig(_Section):
    """Optimiser and update schedule."""

    lr: float = Field(1e-3, ge=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    warmup_steps: int = Field(0, ge=0)
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    max_grad_norm: float | None = Field(1.0, gt=0)
    microbatch_tokens: int = Field(4096, ge=1, description="token budget per micro-batch (rows x padded length)")
    ppo_epochs: int = Field(1, ge=1)
    num_minibatches: int = Field(1, ge=1)
    fuse_old_logprob: bool = Field(
        True, description="with exactly one optimizer step per update (ppo_epochs=1, num_minibatches=1, no "
        "correction, no KL in the reward) take pi_old from the update's own forward instead of a separate "
        "no-grad forward (same weights: identical up to float rounding; recorded in the ledger as before)")
    skip_no_signal_rows: bool = Field(
        True, description="rows whose advantage is 0 on every token (e.g. a GRPO group with equal rewards) are "
        "forwarded without grad and left out of the backward when that is exact: the policy loss vanishes at A=0 "
        "(probed), no KL loss, entropy_coef=0 (docs/learner.md); counted as no_signal_rows")


class LoraConfig(_Section):
    """LoRA adapters on the policy (peft; Hu et al. 2021, arXiv:2106.09685): only the adapters train,
    the rollout engine and checkpoints' ``actor/`` get the merged weights ``W + (alpha/r) B A``."""

    rank: int = Field(0, ge=0, description="adapter rank r; 0 = full fine-tuning (no LoRA)")
    alpha: float | None = Field(None, gt=0, description="scaling alpha (default 2 * rank)")
    target_modules: list[str] | str | None = Field(
        None, description="module names to adapt, 'all-linear', or None = peft's default for the architecture"
    )
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="adapter dropout (must be 0 with gradient checkpointing)")


class CriticConfig(_Section):
    """Optional learned critic (PPO + GAE)."""

    enabled: bool = False
    lr: float = Field(1e-3, ge=0.0)
    shared_backbone: bool = False
    value_clip: float | None = Field(0.2, gt=0)


class LearnerConfig(_Section):
    """Where and how the policy update runs (docs/distributed.md).

    ``single``: the learner lives in the driver process (today's embedded learner). ``ddp`` /
    ``fsdp2``: ``world_size`` learner rank processes (127.0.0.1, gloo on CPU / NCCL on CUDA) driven
    by the loop; each rank computes a token-balanced share of every mini-batch. ``ddp`` replicates
    the model and all-reduces gradients; ``fsdp2`` shards parameters, gradients and AdamW state with
    ``torch.distributed.fsdp.fully_shard``. Rank 0 returns each update's metrics and streams the
    gathered weights to the driver in checksummed buckets (``weight_bucket_mb``).
    """

    strategy: Literal["single", "ddp", "fsdp2"] = Field(
        "single", description="single: embedded learner; ddp: replicated ranks, gradient all-reduce; fsdp2: "
        "sharded parameters / gradients / optimizer state (fully_shard)")
    world_size: int = Field(1, ge=1, description="learner rank processes (> 1 needs strategy ddp or fsdp2)")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="auto: cuda when a GPU is visible and the strategy runs ranks, else cpu; cuda: one GPU "
        "per rank (NCCL), an error when no GPU is visible")
    precision: Literal["fp32", "bf16"] = Field(
        "fp32", description="bf16: mixed precision with float32 master weights (fsdp2: MixedPrecisionPolicy with "
        "float32 gradient reduction; ddp: autocast); CUDA only, refused on CPU")
    rank_timeout_s: float = Field(
        600.0, gt=0, description="a rank call (update, log-probs, state) that gets no reply for this long fails "
        "the run naming the silent ranks; a rank process that exits is detected within 0.5 s")
    startup_timeout_s: float = Field(120.0, gt=0, description="bound on starting the ranks (process group + model)")
    weight_bucket_mb: float = Field(
        64.0, gt=0, description="after each update the ranks gather the weights and stream them to the driver in "
        "buckets of at most this many MiB (each versioned and checksummed); bounds the full-tensor copies any "
        "rank holds at once")

    @model_validator(mode="after")
    def _check_learner(self) -> LearnerConfig:
        if self.world_size > 1 and self.strategy == "single":
            raise ValueError(f"learner.world_size={self.world_size} needs learner.strategy=ddp or fsdp2")
        if self.device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise ValueError("learner.device=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False)")
            if self.strategy == "single":
                raise ValueError("learner.device=cuda runs the learner in rank processes: set learner.strategy=ddp "
                                 "or fsdp2 (world_size 1 is allowed)")
            if self.world_size > torch.cuda.device_count():
                raise ValueError(f"learner.world_size={self.world_size} > {torch.cuda.device_count()} visible GPUs")
        if self.precision == "bf16" and self.resolved_device() != "cuda":
            raise ValueError("learner.precision=bf16 is refused on CPU (mixed precision is supported on CUDA only): "
                             "set learner.precision=fp32 or learner.device=cuda")
        return self

    def resolved_device(self) -> str:
        """``cpu`` or ``cuda``: ``auto`` is cuda only when a GPU is visible and the strategy runs ranks."""
        if self.device != "auto":
            return self.device
        if self.strategy == "single":
            return "cpu"
        import torch

        return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= self.world_size else "cpu"


class SystemConfig(_Section):
    """System axis: how rollout and update are scheduled (see docs/system_modes.md).

    One loop, one knob: ``mode`` decides how batches of trajectories are produced; the update
    is the same code in every mode. The three staleness controls are independent switches:
    ``max_staleness`` (version tags: admission bound + drop at consumption), ``max_queue``
    (depth bound, producers block) and the ``correction`` section / ``decoupled_ppo`` loss
    (importance correction against the recorded behaviour log-probs).
    """

    mode: Literal["sync", "one_step_off", "async"] = Field(
        "sync",
        description="sync: rollout then update (barrier); one_step_off: the rollout of step k+1 runs in a "
        "background thread while step k updates (policy lag 1); async: a rollout worker streams finished "
        "groups into a bounded queue and the learner consumes groups as they complete (AReaL-style)",
    )
    backend: Literal["local", "ray"] = Field(
        "local",
        description="local: engine, verifiers and learner in this process; ray: rollout and reward workers as "
        "Ray actors (settings under system.ray; see docs/distributed.md)",
    )
    ray: RayBackendConfig = Field(
        default_factory=RayBackendConfig,
        description="Ray backend settings (used when backend=ray); a multi-node run changes only ray.address "
        "and the worker counts",
    )
    max_staleness: int | None = Field(
        None, ge=0,
        description="bound on policy lag in versions. A rollout is only started when its batch "
        "slot is at most this many versions ahead of the current policy, and at consumption every sample whose "
        "oldest token is older than this many versions is dropped and counted (staleness/dropped_samples). "
        "None = no version bound (async with neither bound gets max_staleness=1)",
    )
    max_queue: int | None = Field(
        None, ge=1,
        description="async: the queue of finished groups holds at most this many samples; a producer blocks "
        "(time counted in queue/blocked_s) instead of dropping anything. None = no depth bound",
    )
    interrupt_on_update: bool = Field(
        True,
        description="async: a weight update pauses the running generation; its unfinished samples resume under "
        "the new weights (their tokens then span versions; AReaL's interruptible rollout)",
    )
    partial_fraction: float = Field(
        1.0, gt=0.0, le=1.0,
        description="partial rollout lambda (every mode): each rollout call plans K=group_size samples for "
        "prompts_per_step prompts and returns once ceil(lambda*N*K) samples have finished; the rest are paused (not "
        "truncated) and resumed in the next call, topped up with fresh prompts. 1.0 = off",
    )
    max_version_span: int | None = Field(
        None, ge=0,
        description="drop (and count) a paused trajectory instead of resuming it when its tokens would span more "
        "than this many policy versions (newest - oldest behaviour version). None = no limit",
    )
    queue_timeout_s: float = Field(
        600.0, gt=0,
        description="non-sync modes: the learner fails loudly if no finished group arrives for this long",
    )
    engine_sleep: bool = Field(
        False, description="colocation: the rollout engine releases its weights and caches during each update "
        "(its sleep() hook) and re-acquires them before the weight sync (wake()); sync mode only; an engine "
        "that cannot (no hook, vLLM without CUDA) is logged and keeps its memory (docs/distributed.md)",
    )

    @model_validator(mode="before")
    @classmethod
    def _async_default_bound(cls, data: Any) -> Any:
        # async without any bound would run away: default to AReaL's common choice, staleness 1 (explicit
        # in the resolved config).
        if isinstance(data, dict) and data.get("mode") == "async" and data.get("max_staleness") is None \
                and data.get("max_queue") is None:
            data = {**data, "max_staleness": 1}
        return data

    @model_validator(mode="after")
    def _check_mode(self) -> SystemConfig:
        if self.mode == "async" and self.max_staleness is None and self.max_queue is None:
            raise ValueError("system.mode=async needs a bound: system.max_staleness and/or system.max_queue")
        if self.engine_sleep and self.mode != "sync":
            raise ValueError(f"system.engine_sleep=true needs system.mode=sync (in {self.mode} mode the engine "
                             "generates while the learner updates)")
        return self


class EvalConfig(_Section):
    """Held-out evaluation and the promote / reject rule."""

    every: int = Field(10, ge=1, description="evaluate every N steps (and at the start and end)")
    size: int = Field(200, ge=1, description="held-out prompts")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; the accuracy that promotes / rejects")
    sampled_temperature: float | None = Field(
        None, gt=0.0, description="also report held-out accuracy sampled at this temperature (heldout_sampled/*)")
    max_new_tokens: int | None = Field(None, ge=1, description="default: sampling.max_new_tokens")
    reject_drop: float = Field(0.5, ge=0.0, le=1.0, description="reject a revision whose held-out accuracy falls "
                               "more than this below the best promoted one (restore the promoted weights)")
    k: int = Field(1, ge=1, description="report heldout/pass@k (unbiased estimator, Chen et al. 2021) and pass@1 "
                   "over eval.samples sampled responses per held-out prompt")
    samples: int | None = Field(None, ge=1, description="n sampled responses per held-out prompt for pass@k "
                                "(>= k; default k), drawn at eval.temperature if > 0 else eval.sampled_temperature")
    hidden_verifier: str | None = Field(
        None, description="evaluation-only verifier (registered name or module.path:factory) that re-judges every "
        "training and held-out response; verdicts go to the ledger / heldout/hidden/* beside the training "
        "verifier's and never into the reward (posttrain/rewards/hidden.py)")
    hidden_verifier_kwargs: dict[str, Any] = Field(default_factory=dict,
                                                   description="keyword arguments of eval.hidden_verifier")

    @model_validator(mode="after")
    def _check_passk(self) -> EvalConfig:
        if self.samples is None:
            self.samples = self.k  # resolved in the saved config.yaml
        if self.samples < self.k:
            raise ValueError(f"eval.samples={self.samples} must be >= eval.k={self.k}")
        if self.samples > 1 and self.temperature == 0 and self.sampled_temperature is None:
            raise ValueError(f"eval.samples={self.samples} needs sampled responses: set eval.sampled_temperature "
                             "(or eval.temperature > 0); greedy samples are all the same")
        if self.hidden_verifier is not None:
            from posttrain.rewards.hidden import build_hidden_verifier

            build_hidden_verifier(self.hidden_verifier, self.hidden_verifier_kwargs)  # one-line error now, not mid-run
        elif self.hidden_verifier_kwargs:
            raise ValueError("eval.hidden_verifier_kwargs is set but eval.hidden_verifier is not")
        return self


class SFTConfig(_Section):
    """Supervised warm-up on the task's reference answers before RL (the demo uses it)."""

    steps: int = Field(0, ge=0)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(3e-3, gt=0)
    examples: int = Field(2000, ge=1, description="distinct training examples the warm-up sees")


class GuardsConfig(_Section):
    """Monitors: thresholds that warn or stop the run with a reason."""

    action: Literal["warn", "stop"] = "warn"
    max_abs_log_kappa: float = Field(1e-2, gt=0, description="behavior vs recomputed old log-prob (max |log k|)")
    min_entropy: float = Field(1e-3, ge=0, description="entropy collapse")
    max_truncation_rate: float = Field(0.9, ge=0, le=1)
    max_zero_adv_fraction: float = Field(1.0, ge=0, le=1)
    min_response_length: float = Field(0.0, ge=0)
    max_infra_error_fraction: float = Field(
        1.0, gt=0, le=1, description="warn (stop with action: stop) when this fraction of a step's or an evaluation's "
        "verifications has no verdict (infra_error / env_failure); 1.0 = when every one failed")


# Experiment trackers beside metrics.jsonl: config key -> the module it imports. All three come
# with one extra (docs/diagnostics.md, "Tracking").
TRACKER_MODULES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
TRACKING_EXTRA = "pip install 'posttrain[tracking]'"


class LoggingConfig(_Section):
    """Where each step's metrics go: ``metrics.jsonl`` always, and the trackers switched on here
    (each receives the resolved config once and every step's numeric metrics; docs/diagnostics.md)."""

    tensorboard: bool = Field(False, description="TensorBoard event files in RUN_DIR/tensorboard")
    wandb: bool = Field(False, description="a Weights & Biases run (files under RUN_DIR/wandb); WANDB_MODE=offline "
                        "works without an account")
    wandb_project: str | None = Field(None, description="W&B project (default 'posttrain'); needs logging.wandb")
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: the WANDB_MODE environment variable, else W&B's own default); "
        "needs logging.wandb")
    mlflow: bool = Field(False, description="an MLflow run (params = the resolved config, metrics by step)")
    mlflow_tracking_uri: str | None = Field(None, description="MLflow tracking URI (default: a file store in "
                                            "RUN_DIR/mlruns); needs logging.mlflow")
    mlflow_experiment: str | None = Field(None, description="MLflow experiment (default 'posttrain'); needs "
                                          "logging.mlflow")
    progress: bool = True

    @model_validator(mode="after")
    def _check_trackers(self) -> LoggingConfig:
        # A tracker key whose tracker is off would do nothing: refused, as every dead setting.
        for key, owner in (("wandb_project", "wandb"), ("wandb_mode", "wandb"),
                           ("mlflow_tracking_uri", "mlflow"), ("mlflow_experiment", "mlflow")):
            if getattr(self, key) is not None and not getattr(self, owner):
                raise ValueError(f"logging.{key} has no effect without logging.{owner}=true")
        # A missing package is refused here, before the run directory is written.
        import importlib.util

        for key, module in TRACKER_MODULES.items():
            if getattr(self, key) and importlib.util.find_spec(module) is None:
                raise ValueError(f"logging.{key}=true needs the {module} package: {TRACKING_EXTRA}")
        return self


class RunConfig(_Section):
    """A full recipe: the six axes plus model, optimiser and run controls."""

    name: str = "run"
    seed: int = 0
    steps: int = Field(50, ge=0)
    run_dir: str | None = Field(None, description="default: runs/<name>")
    resume: bool = Field(False, description="continue the run in run_dir from its latest complete checkpoint "
                         "(an error if there is none; a corrupt latest one falls back to the previous)")
    resume_force: bool = Field(False, description="resume even though the recipe differs from the run's "
                               "config.yaml (the old one is kept as config.step_<N>.yaml); without it such a "
                               "resume is refused with the differing keys")
    checkpoint_every: int = Field(10, ge=0, description="checkpoint every N steps (and at the end); a crash loses "
                                  "at most the steps since the last one. 0 = only at the end")
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    env: EnvConfig = Field(default_factory=EnvConfig, description="multi-turn environment episodes (env.name set)")
    reward: RewardConfig = Field(default_factory=RewardConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    credit: CreditConfig = Field(default_factory=CreditConfig)
    correction: CorrectionConfig = Field(default_factory=CorrectionConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig, description="LoRA adapters on the policy (rank 0 = off)")
    critic: CriticConfig = Field(default_factory=CriticConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig, description="where the policy update runs: "
                                   "embedded, or ddp / fsdp2 rank processes (docs/distributed.md)")
    system: SystemConfig = Field(default_factory=SystemConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig, description="the rollout engine (docs/rollout.md)")
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _check_names(self) -> RunConfig:
        import posttrain.algos as A

        for key, reg, name in (
            ("credit.estimator", A.ADVANTAGES, self.credit.estimator),
            ("loss.policy_loss", A.POLICY_LOSSES, self.loss.policy_loss),
            ("loss.reduction", A.REDUCTIONS, self.loss.reduction),
            ("loss.kl_estimator", A.KL_ESTIMATORS, self.loss.kl_estimator),
            ("correction.name", A.CORRECTIONS, self.correction.name),
        ):
            if name is not None:
                reg.resolve(name, key=key)  # a registered name, or 'module:function' imported and registered now
        from posttrain.loop.targets import check_estimator_needs

        check_estimator_needs(self)  # what the estimator declared it needs (critic, groups, baseline, step ids)
        if self.env.name is not None:
            _check_env(self)
        if self.sampling.dynamic_sampling and (self.system.mode != "sync" or self.system.partial_fraction < 1.0):
            raise ValueError("sampling.dynamic_sampling is supported with system.mode=sync and partial_fraction=1 only")
        if self.system.max_queue is not None and self.system.max_queue < self.sampling.group_size:
            raise ValueError(f"system.max_queue={self.system.max_queue} cannot hold one group of "
                             f"sampling.group_size={self.sampling.group_size} samples")
        if self.rollout.engine == "vllm" and self.rollout.vllm.dtype == "auto" and self.model.dtype == "float64":
            raise ValueError("rollout.vllm.dtype: vLLM has no float64; set model.dtype=float32 or rollout.vllm.dtype")
        if self.loss.kl_coef > 0 and self.loss.kl_estimator is None:
            raise ValueError("loss.kl_coef > 0 needs loss.kl_estimator (k1, k2 or k3)")
        if self.learner.strategy != "single" and self.lora.rank > 0:
            raise ValueError(f"learner.strategy={self.learner.strategy} does not support LoRA (lora.rank > 0); "
                             "use learner.strategy=single")
        if self.learner.precision == "bf16" and self.model.dtype != "float32":
            raise ValueError(f"learner.precision=bf16 keeps float32 master weights: needs model.dtype=float32, "
                             f"got {self.model.dtype}")
        check_algo_kwargs(self)
        from posttrain.config_rules import check_dead_settings

        check_dead_settings(self)  # a set key that cannot take effect is refused (warnings: load_config)
        return self

    def axes(self) -> dict[str, str]:
        """The recipe's full composition along the six axes (for ``--print-recipe``)."""
        corr = self.correction.name or "none"
        return {
            "feedback": (f"env {self.env.name} {self.env.kwargs or ''} (multi-turn, max_turns {self.env.max_turns})"
                         if self.env.name is not None else f"task {self.task.name} {self.task.kwargs or ''}")
            + f" weights {self.reward.weights}"
            + (f" + overlong(L_max={self.reward.overlong_max_len}, L_cache={self.reward.overlong_cache_len})"
               if self.reward.overlong_max_len else ""),
            "sampling": f"G={self.sampling.group_size} x {self.sampling.prompts_per_step} prompts, "
            f"T={self.sampling.temperature}, top_p={self.sampling.top_p}, max_new={self.sampling.max_new_tokens}"
            + (", dynamic sampling" if self.sampling.dynamic_sampling else ""),
            "credit": f"{self.credit.estimator} {self.credit.kwargs or ''}"
            + (" + critic" if self.critic.enabled else "")
            + (f", KL in reward ({self.loss.kl_estimator}, coef {self.loss.kl_coef})" if self.credit.kl_in_reward else ""),
            "correction": f"{corr} {self.correction.kwargs or ''}",
            "reduction": f"{self.loss.reduction}; loss {self.loss.policy_loss} {self.loss.kwargs or ''}"
            + (f"; KL in loss {self.loss.kl_estimator} coef {self.loss.kl_coef}"
               if self.loss.kl_estimator and not self.credit.kl_in_reward else ""),
            "system": f"{self.system.mode} / {self.system.backend}"
            + (f", max_staleness {self.system.max_staleness}" if self.system.max_staleness is not None else "")
            + (f", max_queue {self.system.max_queue}" if self.system.max_queue is not None else "")
            + (f", partial rollout lambda={self.system.partial_fraction}" if self.system.partial_fraction < 1 else "")
            + (f", max_version_span {self.system.max_version_span}" if self.system.max_version_span is not None else ""),
        }


def _check_env(cfg: RunConfig) -> None:
    """A multi-turn recipe: the environment resolves, and the settings episodes do not support are refused."""
    for bad, why in ((cfg.sampling.dynamic_sampling, "sampling.dynamic_sampling=false"),):
        if bad:
            raise ValueError(f"env.name={cfg.env.name}: multi-turn episodes need {why}")
    from posttrain.envs.episodes import ENVS

    if ":" not in cfg.env.name and cfg.env.name not in ENVS:  # type: ignore[operator]
        raise ValueError(f"env.name: unknown env {cfg.env.name!r}; valid: {', '.join(sorted(ENVS))}, "
                         "or 'package.module:factory'")
    from posttrain.envs.episodes import check_env_reward_weights

    check_env_reward_weights(str(cfg.env.name), cfg.env.kwargs, cfg.reward.weights)  # like single-turn components


def _probe(fn: Any, kwargs: dict[str, Any], key: str, call: Any) -> None:
    """Run ``call(fn, kwargs)`` on tiny dummy tensors; a ValueError / TypeError is the recipe's fault
    only if the same call with the function's defaults succeeds (else the probe inputs cannot judge
    this function, e.g. a plug-in that needs other fields, and the run itself will tell)."""
    try:
        call(fn, kwargs)
    except (ValueError, TypeError) as e:
        try:
            call(fn, {})
        except Exception:  # noqa: BLE001  (the defaults fail too: the probe cannot judge)
            return
        raise ValueError(f"{key} {kwargs}: {e}") from None


def check_algo_kwargs(cfg: RunConfig) -> None:
    """Validate ``credit`` / ``loss`` / ``correction`` ``.kwargs`` against the registered functions.

    Names are checked against each function's signature (unknown keyword -> error naming the key);
    values by calling the function once on tiny dummy tensors, so the constraints each function
    declares (``eps_low`` in [0, 1), ``cap > 0``...) fail at config load, before the run directory,
    the SFT warm-up or the first evaluation. The algorithm functions stay pure: nothing is added
    to them. Raises ``ValueError`` naming the key.
    """
    import torch

    import posttrain.algos as A
    from posttrain.algos.advantages import AdvantageInputs
    from posttrain.algos.policy_losses import PolicyLossInputs

    ones = torch.ones(2, 2)
    lp = torch.tensor([[-0.5, -1.0], [-0.7, -0.2]])

    def loss_call(fn: Any, kw: dict[str, Any]) -> None:
        fn(PolicyLossInputs(logprob=lp, old_logprob=lp - 0.1, advantages=torch.tensor([[1.0, 1.0], [-1.0, -1.0]]),
                            action_mask=ones, behavior_logprob=lp - 0.2), **kw)

    def corr_call(fn: Any, kw: dict[str, Any]) -> None:
        import inspect

        params = inspect.signature(fn).parameters
        extra: dict[str, Any] = {}
        if "behavior_version" in params:
            extra["behavior_version"] = torch.zeros(2, 2, dtype=torch.long)
        if "current_version" in params:
            extra["current_version"] = 0
        fn(lp - 0.2, lp, ones, **{**extra, **kw})

    def adv_call(fn: Any, kw: dict[str, Any]) -> None:
        fn(AdvantageInputs(
            action_mask=ones, rewards=torch.tensor([1.0, 0.0]), token_rewards=torch.zeros(2, 2),
            group_index=torch.tensor([0, 0]), values=torch.zeros(2, 2), baseline=torch.zeros(2),
            step_index=torch.zeros(2, 2, dtype=torch.long), step_anchor=torch.ones(2, 1, dtype=torch.long),
            step_rewards=torch.tensor([[1.0], [0.0]])), **kw)

    # The learner passes the versions to a correction itself (posttrain/learner/actor.py).
    corr_supplied = ("behavior_version", "current_version")
    checks = [("credit.kwargs", A.ADVANTAGES, cfg.credit.estimator, cfg.credit.kwargs, 1, (), adv_call),
              ("loss.kwargs", A.POLICY_LOSSES, cfg.loss.policy_loss, cfg.loss.kwargs, 1, (), loss_call)]
    if cfg.correction.name is not None:
        checks.append(("correction.kwargs", A.CORRECTIONS, cfg.correction.name, cfg.correction.kwargs, 3,
                       corr_supplied, corr_call))
    elif cfg.correction.kwargs:
        raise ValueError(f"correction.kwargs {cfg.correction.kwargs} given but correction.name is not set")
    for key, reg, name, kwargs, data_args, supplied, call in checks:
        reg.check_kwargs(name, kwargs, key=key, data_args=data_args, supplied=supplied)
        _probe(reg[name], dict(kwargs), key, call)


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key (and file)."""


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} is not key=value")
    key, _, raw = item.partition("=")
    if not key or any(not p for p in key.split(".")):
        raise ConfigError(f"override {item!r}: bad key")
    try:
        return key.split("."), yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML ({getattr(e, 'problem', None) or e})") from None


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set dotted ``key=value`` overrides into a nested dict (values parsed as YAML scalars)."""
    for item in overrides:
        path, value = _parse_override(item)
        node = data
        for p in path[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = nxt
        node[path[-1]] = value
    return data


def resolve_recipe_path(recipe: str) -> Path:
    """A path to a YAML file, or the bare name of a shipped recipe (``grpo`` -> recipes/grpo.yaml).

    A name with a path separator or a ``.yaml`` / ``.yml`` suffix is a path and must be an existing
    file: a typo in ``dir/grpo.yaml`` must not silently run the shipped ``grpo``. Only a bare name
    falls back to the shipped recipes (an existing file of that name in the working directory wins).
    """
    p = Path(recipe)
    shipped = ", ".join(sorted(q.stem for q in RECIPES_DIR.glob("*.yaml")))
    if "/" in recipe or "\\" in recipe or p.suffix in (".yaml", ".yml"):
        if p.is_file():
            return p
        why = "is a directory" if p.is_dir() else "does not exist"
        raise ConfigError(f"recipe file {recipe} {why} (shipped recipes are bare names: {shipped})")
    if p.is_file():
        return p
    cand = RECIPES_DIR / f"{recipe}.yaml"
    if cand.is_file():
        return cand
    raise ConfigError(f"recipe {recipe!r} not found (a YAML path, or one of: {shipped})")


def _format_validation(e: ValidationError, source: str) -> str:
    lines = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        msg = msg.removeprefix("Value error, ")  # pydantic's prefix on a validator's ValueError
        # A whole-config check (no location) names its keys in the message itself.
        lines.append(f"{source}: {loc}: {msg}" if loc else f"{source}: {msg}")
    return "; ".join(lines)


def validate_config(data: dict[str, Any], source: str) -> RunConfig:
    """``RunConfig`` of a nested mapping; a :class:`ConfigError` of one line per bad key, each
    prefixed by ``source`` (a file, or e.g. the command line that built ``data``)."""
    try:
        return RunConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation(e, source)) from None


def load_config(recipe: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a recipe (path or shipped name; None = all defaults), apply overrides, validate."""
    data: dict[str, Any] = {}
    source = "defaults"
    if recipe is not None:
        path = resolve_recipe_path(recipe)
        source = str(path)
        try:
            loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
        except yaml.YAMLError as e:
            raise ConfigError(_yaml_error(path, e)) from None
        if loaded is None:
            raise ConfigError(f"{path}: the recipe is empty (expected a mapping of keys, e.g. 'steps: 10')")
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: a recipe must be a mapping of keys, got a YAML {type(loaded).__name__}")
        data = loaded
    data = apply_overrides(data, list(overrides or []))
    cfg = validate_config(data, source)
    from posttrain.config_rules import check_dead_settings

    for line in check_dead_settings(cfg):  # the keys whose rule warns instead of refusing (config_rules.RULES)
        _log.warning("%s: %s", source, line)
    if cfg.optim.lr == 0 and cfg.steps > 0:
        # Legitimate for determinism checks (weights never change), a silent no-op run otherwise.
        _log.warning("%s: optim.lr=0 with steps=%d: the policy weights will not change", source, cfg.steps)
    return cfg


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line ``file:line:column: problem`` for a YAML parse error (1-based, as editors count)."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    context = getattr(e, "context", None)
    return f"{where}: not valid YAML: {problem}" + (f" ({context})" if context else "")


def dump_config(cfg: RunConfig) -> str:
    """The fully resolved config as YAML."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)
