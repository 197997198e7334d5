"""Head-to-head with TRL: posttrain's GRPO vs TRL's GRPOTrainer from the same SFT checkpoint (CPU).

Two shapes (``--shape``): ``demo`` (below) and ``realistic``: SmolLM2-135M-Instruct, the
``smollm2_word_problems`` recipe (chat-rendered prompts, last-number answers), G = 8, up to 128 new
tokens, no SFT — both sides start from the pretrained model, and TRL gets posttrain's rendered prompt
text, checked to tokenize to the very ids posttrain samples from.

Both sides start from one SFT checkpoint produced by posttrain's own warm-up (the demo recipe's
``sft`` section), train on the same task (the demo's ``chain_sum``) with the same prompts in the
same order, group size, prompts per step, max new tokens, learning rate, optimiser, clipping,
temperature, loss aggregation and number of steps, and are then evaluated by the *same* held-out
evaluator (:func:`posttrain.evaluation.heldout.evaluate`, greedy, the same held-out problems,
the same built-in engine) so that accuracy differences come from training alone.

Settings matched on the TRL side (``trl.GRPOConfig``): ``num_generations = group_size``,
``per_device_train_batch_size = prompts_per_step * group_size``, ``gradient_accumulation_steps
= 1`` (one optimiser step per rollout batch, like posttrain's ``ppo_epochs = num_minibatches =
1``), ``num_iterations = 1``, ``beta = 0`` (no reference model; the demo recipe has no KL),
``loss_type = "grpo"`` (per-sequence token mean, then batch mean = posttrain's
``seq_mean_token_mean``), ``epsilon / epsilon_high`` = the recipe's ``eps_low / eps_high``,
``scale_rewards = "group"`` (= ``norm_std: true``), ``temperature / top_p / top_k``, constant LR
without warm-up, AdamW with the same betas / weight decay, the same ``max_grad_norm``, float32
(``bf16 = False``), no gradient checkpointing, no vLLM, ``use_cpu = True``, no dataset shuffling
(the dataset holds exactly the prompts posttrain's data cursor draws, in order).

``--precision bf16`` runs both sides at the same dtype policy: bf16 compute over float32 master weights
(Micikevicius et al. 2018, arXiv:1710.03740, with bfloat16: no loss scaling). posttrain:
``rollout.precision=bf16`` (the engine samples from a bfloat16 copy of the weights) and
``learner.precision=bf16`` (bf16 autocast); TRL: ``bf16 = True`` with ``use_cpu = True``, which accelerate
runs as ``torch.autocast("cpu", torch.bfloat16)`` around the model's forward, in generation and in
training alike (checked during the run). It is refused, in one line and before any work, on a CPU without
native bf16 products (AVX512_BF16 / AMX-BF16: :func:`posttrain.rollout.precision.native_bf16`), where
posttrain refuses both keys. The bench's own held-out evaluation stays float32 greedy on both sides (one
judge for both).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NotRequired, TypedDict

import torch
from torch.utils.hooks import RemovableHandle

from posttrain.bench.rollout import cpu_name
from posttrain.bench.vs_trl_seeds import parse_seeds
from posttrain.errors import UserError

if TYPE_CHECKING:  # annotations only: the CLI imports every bench module, these stay lazy
    from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback
    from trl.trainer.grpo_config import GRPOConfig  # the optional [bench] extra: Any for mypy without it

    from posttrain.bench.vs_trl_seeds import SideFigures
    from posttrain.config import RunConfig
    from posttrain.envs.task import Task, TaskExample

log = logging.getLogger("posttrain.bench.vs_trl")

# The smoke-test shape: small enough to run in well under a minute on 2 CPU cores.
QUICK_OVERRIDES = [
    "model.path=builtin:micro", "task.kwargs.terms=2", "sft.steps=60", "sft.batch_size=32", "sft.examples=400",
    "sampling.prompts_per_step=8", "sampling.group_size=4", "eval.size=16",
]
QUICK_STEPS = 3
DEFAULT_STEPS = 20
# ``--shape realistic``: SmolLM2-135M-Instruct from its offline wheel, chat-rendered word problems, the
# answer read as the response's last number, G = 8, up to 128 new tokens, no SFT (both sides start from
# the pretrained model). Fewer steps: each is minutes on a 2-core CPU.
REALISTIC_RECIPE = "smollm2_word_problems"
REALISTIC_OVERRIDES = ["sampling.prompts_per_step=4", "sampling.group_size=8", "sampling.max_new_tokens=128",
                       "eval.size=48", "sft.steps=0",
                       # the one-pattern phrasings and the plain last-number reward (no overlong penalty) the
                       # figures in docs/benchmarks.md were measured on
                       "task.kwargs.phrasings=classic", "reward.weights={task: 1.0}", "reward.overlong_max_len=null",
                       "reward.overlong_cache_len=0"]
REALISTIC_STEPS = 5
# Both sides take one constant-LR step per batch: the demo recipe's LR warm-up is switched off here
# (HF's constant_with_warmup starts at 0, posttrain's at 1/warmup, so a warm-up could not be matched).
MATCHED_OVERRIDES = ["optim.warmup_steps=0"]
# ``--precision``: posttrain's keys per choice (fp32: the recipe's own, float32 on the demo and realistic shapes)
# and TRL's matching TrainingArguments flag (bf16=True: accelerate's CPU autocast over float32 master weights).
PRECISIONS = ("fp32", "bf16")
POSTTRAIN_PRECISION_OVERRIDES: dict[str, list[str]] = {
    "fp32": [], "bf16": ["rollout.precision=bf16", "learner.precision=bf16"]}
PRECISION_KEYS = ("rollout.precision", "learner.precision")
PRECISION_DETAIL: dict[str, dict[str, str]] = {
    "fp32": {"posttrain": "fp32 (rollout.precision=auto: the float32 model's dtype; learner.precision=fp32)",
             "trl": "fp32 (bf16=False)"},
    "bf16": {"posttrain": "bf16 (rollout.precision=bf16: a bfloat16 weight copy samples; learner.precision=bf16: "
                          "bf16 autocast, float32 master weights)",
             "trl": "bf16 (bf16=True, use_cpu=True: accelerate's torch.autocast('cpu', bfloat16) around generation "
                    "and training forwards, float32 master weights)"},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``posttrain bench vs-trl``."""
    parser.add_argument("--steps", type=int, default=None,
                        help=f"RL steps on each side (default {DEFAULT_STEPS}; {QUICK_STEPS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: micro model, 2-term sums, short SFT, 8 prompts x 4 samples, 3 steps, 16 held-out problems")
    parser.add_argument("--recipe", default=None,
                        help=f"the recipe both sides share (default: demo; {REALISTIC_RECIPE} with --shape realistic)")
    parser.add_argument("--shape", choices=["demo", "realistic"], default="demo",
                        help="demo: the demo recipe (tiny model, SFT start, <= 4 new tokens); realistic: "
                        "SmolLM2-135M-Instruct, chat prompts, G=8, up to 128 new tokens, no SFT "
                        f"({REALISTIC_STEPS} steps by default)")
    parser.add_argument("--work-dir", default="runs/bench_vs_trl",
                        help="SFT checkpoint, posttrain run dir and TRL output dir go here")
    parser.add_argument("--fresh-sft", action="store_true",
                        help="redo the SFT warm-up even if a matching checkpoint exists in --work-dir")
    parser.add_argument("--only", choices=["both", "posttrain", "trl"], default="both",
                        help="run one side only (the other's columns are left empty)")
    parser.add_argument("--trl-first", action="store_true",
                        help="run TRL before posttrain (to check that run order / machine load is not the result)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads for both sides (default: torch's own choice)")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp32",
                        help="dtype policy of both sides (default fp32); bf16: bf16 compute over float32 master weights "
                        "(posttrain rollout.precision=bf16 + learner.precision=bf16; TRL bf16=True), refused on a CPU "
                        "without AVX512_BF16 or AMX-BF16")
    parser.add_argument("--seeds", type=parse_seeds, default=None,
                        help="comma-separated seeds (e.g. 0,1,2): the whole comparison once per seed (its own SFT "
                        "start, prompts and sampling; work dir WORK_DIR/seed_S), the held-out problems drawn once for "
                        "all (eval.heldout_seed: the first seed unless given), then posttrain - TRL held-out accuracy "
                        "pooled over seeds with its paired bootstrap interval over problems, and the paired t-interval "
                        "over seeds")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the recipe (applied to both sides)")


# ---------------------------------------------------------------------------------------------- precision
@dataclasses.dataclass(frozen=True)
class CpuFacts:
    """This CPU for the report: ``name`` (``model name`` of /proc/cpuinfo), whether its flags have
    ``amx_bf16`` / ``avx512_bf16`` (one field per key of :data:`posttrain.rollout.precision.BF16_CPU_FLAGS`,
    in sorted order), and ``native_bf16``, the feature bf16 runs on (None: none)."""

    name: str
    amx_bf16: bool
    avx512_bf16: bool
    native_bf16: str | None

    def as_json(self) -> dict[str, str | bool | None]:
        """The JSON's ``cpu`` object: the fields in declaration order (``name``, the flags sorted,
        ``native_bf16``)."""
        return dataclasses.asdict(self)


def cpu_facts() -> CpuFacts:
    """This machine's :class:`CpuFacts` (flags from :func:`posttrain.rollout.precision.cpu_flags`)."""
    from posttrain.rollout import precision as rp

    flags = rp.cpu_flags()
    return CpuFacts(name=cpu_name(), amx_bf16="amx_bf16" in flags, avx512_bf16="avx512_bf16" in flags,
                    native_bf16=rp.native_bf16(flags))


def check_precision(precision: str, overrides: Sequence[str], cpu: CpuFacts) -> None:
    """Refuse (one-line :class:`~posttrain.errors.UserError`, before any work) what ``--precision`` cannot
    compare at one dtype: a ``rollout.precision`` / ``learner.precision`` override (the flag sets both);
    for ``bf16``, a CPU without native bf16 products (``cpu.native_bf16`` None: posttrain refuses both keys
    there, bf16 being slower than fp32 without them), or a torch without CPU bf16 autocast (TRL's bf16)."""
    if precision not in PRECISIONS:
        raise UserError(f"vs-trl: --precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    given = sorted({o.partition("=")[0] for o in overrides} & set(PRECISION_KEYS))
    if given:
        raise UserError(f"vs-trl: {', '.join(given)} is set by --precision (which sets both sides), not by an "
                        "override")
    if precision != "bf16":
        return
    if cpu.native_bf16 is None:
        raise UserError(f"vs-trl --precision bf16: refused on this CPU ({cpu.name}: no avx512_bf16, no amx_bf16): "
                        "posttrain refuses rollout.precision=bf16 and learner.precision=bf16 without native bf16 "
                        "products (bf16 would run slower than fp32), so the sides would not share a dtype; use "
                        "--precision fp32")
    if not torch.amp.is_autocast_available("cpu"):
        raise UserError("vs-trl --precision bf16: refused: TRL's bf16=True on CPU runs torch.autocast('cpu', "
                        f"bfloat16), which torch {torch.__version__} does not offer here; use --precision fp32")


# ---------------------------------------------------------------------------------------------- helpers
def _config(recipe: str, overrides: Sequence[str]) -> RunConfig:
    """``recipe`` with ``overrides``, parsed and validated
    (:func:`posttrain.loop.validate.load_run_config`)."""
    from posttrain.loop.validate import load_run_config

    return load_run_config(recipe, list(overrides))


def _heldout(cfg: RunConfig) -> tuple[Task, list[TaskExample]]:
    """``cfg``'s task and its ``eval.size`` held-out examples, drawn as a run draws them: with ``eval.heldout_seed``,
    else the run's ``seed`` (:meth:`~posttrain.config.monitoring.EvalConfig.heldout_seed_of`)."""
    from posttrain.loop.builders import build_task

    task: Task = build_task(cfg)
    return task, list(task.examples("heldout", cfg.eval.size, seed=cfg.eval.heldout_seed_of(cfg.seed)))


class OutcomesJson(TypedDict):
    """Per held-out problem (one entry per distinct prompt id): samples judged and samples correct
    (:class:`~posttrain.diagnostics.heldout_outcomes.SetOutcomes` as JSON), what ``--seeds`` pairs the sides on."""

    prompt_ids: list[str]
    valid: list[int]
    correct: list[int]


class HeldoutFigures(TypedDict):
    """The JSON's ``heldout`` object of one model (:func:`evaluate_model`)."""

    accuracy: float
    reward_mean: float
    n: int
    status_counts: dict[str, int]
    outcomes: OutcomesJson


def evaluate_model(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase,
                   cfg: RunConfig) -> HeldoutFigures:
    """Greedy held-out accuracy of ``model`` with posttrain's evaluator (the same for both sides)."""
    from posttrain.loop.builders import build_engine, build_renderer
    from posttrain.loop.heldout import evaluate, outcomes_of

    task, heldout = _heldout(cfg)
    engine = build_engine(model, tokenizer)
    res = evaluate(engine, tokenizer, task, heldout,
                   max_new_tokens=cfg.eval.max_new_tokens or cfg.sampling.max_new_tokens,
                   temperature=0.0, seed=cfg.seed, renderer=build_renderer(cfg, tokenizer))
    out = outcomes_of(res, heldout)
    return {"accuracy": res.accuracy, "reward_mean": res.reward_mean, "n": res.n, "status_counts": res.status_counts,
            "outcomes": {"prompt_ids": list(out.prompt_ids), "valid": list(out.valid), "correct": list(out.correct)}}


def _load(path: Path) -> tuple[PreTrainedTokenizerBase, PreTrainedModel]:
    """The tokenizer and the float32 causal LM (eval mode) of the ``save_pretrained`` folder ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model.eval()  # type: ignore[no-untyped-call]  # transformers' PreTrainedModel.eval has no annotations
    return tok, model


def _weight_delta(model: torch.nn.Module, ref: dict[str, torch.Tensor]) -> float:
    """L2 norm of the difference between ``model``'s weights and ``ref`` (0.0 = untouched)."""
    sq = 0.0
    for k, v in model.state_dict().items():
        if k in ref:
            sq += float((v.detach().float() - ref[k].float()).pow(2).sum())
    return math.sqrt(sq)


def _steady(xs: Sequence[int], drop_last: bool = False) -> list[int]:
    """Per-step figures without the first step (warm-up) and, if asked, the last one."""
    ys = list(xs)[1:] if len(xs) > 2 else list(xs)
    if drop_last and len(ys) > 1:
        ys = ys[:-1]
    return ys


class StepSummary(TypedDict):
    """Steady-step figures of one side (:func:`_side_summary`); NaN where no step is steady."""

    step_s_mean: float
    step_s_median: float
    steady_steps: float
    gen_tokens_per_s: float


class SideResult(StepSummary):
    """The JSON's ``posttrain`` / ``trl`` object: per-step timings and generated tokens, their steady-step
    summary, the held-out figures after training and how far the weights moved from the start."""

    steps: int
    step_s: list[float]
    generated_tokens_per_step: list[float]
    generated_tokens: float
    train_wall_s: float
    heldout: HeldoutFigures
    heldout_accuracy: float
    weight_delta_l2: float


class PosttrainResult(SideResult):
    """posttrain's side (:func:`run_posttrain`): also the mean rollout / reward / learner split of a steady
    step, the reward mean per step and the precision keys the run used."""

    time_split_s: dict[str, float]
    reward_mean_per_step: list[float | None]
    precision_keys: dict[str, str]


class TrlResult(SideResult):
    """TRL's side (:func:`run_trl`): also TRL's version and the dtypes its forwards computed in."""

    trl_version: str
    precision_seen: TrlDtypesSeen


def _side_summary(step_s: Sequence[float], step_tokens: Sequence[float], drop_last: bool) -> StepSummary:
    """Mean / median step time and generated tokens per second over the steady steps (:func:`_steady`)."""
    idx = list(range(len(step_s)))
    keep = _steady(idx, drop_last=drop_last)
    t = [step_s[i] for i in keep]
    n = [step_tokens[i] for i in keep]
    return {
        "step_s_mean": statistics.fmean(t) if t else float("nan"),
        "step_s_median": statistics.median(t) if t else float("nan"),
        "steady_steps": float(len(t)),
        "gen_tokens_per_s": (sum(n) / sum(t)) if t and sum(t) > 0 else float("nan"),
    }


# ---------------------------------------------------------------------------------------------- SFT
def _save_pretrained(model: torch.nn.Module, out: Path) -> None:
    """``model.save_pretrained(out)``: posttrain's builders type the model as an ``nn.Module``; it is a
    transformers (or PEFT) model, whose ``save_pretrained`` ``nn.Module.__getattr__``'s typing hides."""
    model.save_pretrained(str(out))  # type: ignore[operator]


def prepare_sft(cfg: RunConfig, work: Path, fresh: bool = False) -> tuple[Path, float]:
    """Run posttrain's SFT warm-up of ``cfg`` once and save the model to ``work/sft_model`` (with
    ``sft.steps == 0``: the model of ``model.path`` itself, so both sides share the same start).

    Reused when ``work/sft_model/sft.json`` records the same model / task / SFT settings.
    Returns the checkpoint directory and the SFT time in seconds (0 when reused).
    """
    from posttrain.loop.run import open_run

    out = work / "sft_model"
    key = {"model": cfg.model.model_dump(), "task": cfg.task.model_dump(), "sft": cfg.sft.model_dump(),
           "seed": cfg.seed}
    marker = out / "sft.json"
    if not fresh and marker.exists() and json.loads(marker.read_text()).get("key") == key:
        return out, 0.0
    t0 = time.perf_counter()
    if cfg.sft.steps <= 0:  # no warm-up: both sides start from the model itself, saved once as a HF folder
        from posttrain.loop.builders import build_model

        tok, model = build_model(cfg)
        out.mkdir(parents=True, exist_ok=True)
        _save_pretrained(model, out)
        tok.save_pretrained(str(out))
        marker.write_text(json.dumps({"key": key, "seconds": time.perf_counter() - t0}, indent=1))
        return out, time.perf_counter() - t0
    sft_cfg = cfg.model_copy(deep=True, update={"steps": 0, "run_dir": str(work / "sft_run"), "resume": False})
    run = open_run(sft_cfg)
    try:
        run.warmup_and_baseline(None)
        out.mkdir(parents=True, exist_ok=True)
        _save_pretrained(run.parts.learner.model, out)
        run.parts.tokenizer.save_pretrained(str(out))
    finally:
        run.close()
    secs = time.perf_counter() - t0
    marker.write_text(json.dumps({"key": key, "seconds": secs}, indent=1))
    return out, secs


# ---------------------------------------------------------------------------------------------- posttrain
def run_posttrain(cfg: RunConfig, sft_dir: Path, work: Path, steps: int) -> PosttrainResult:
    """posttrain's synchronous GRPO loop from ``sft_dir`` for ``steps`` steps; timings + held-out.

    ``cfg`` carries the precision keys ``--precision`` set (:data:`POSTTRAIN_PRECISION_OVERRIDES`); they are
    reported as ``precision_keys``."""
    from posttrain.learner.checkpoint import latest_checkpoint
    from posttrain.loop.training_loop import train

    run_dir = work / "posttrain"
    if run_dir.exists():  # a fresh run each time; keep the old one aside rather than deleting it
        run_dir.rename(run_dir.with_name(f"posttrain.old-{int(time.time() * 1000)}"))
    pcfg = cfg.model_copy(deep=True, update={"steps": steps, "run_dir": str(run_dir), "resume": False, "checkpoint_every": 0})
    pcfg.model.path = str(sft_dir)
    pcfg.sft.steps = 0
    pcfg.eval.every = max(steps, 1)  # held-out eval only at the start and the end, as on the TRL side
    pcfg.eval.reject_drop = 1.0  # never restore an earlier revision: TRL has no such rule
    # greedy only (the bench's own evaluator judges both sides); set together: each alone would not validate
    pcfg.eval = pcfg.eval.model_copy(update={"samples": 1, "k": 1, "sampled_temperature": None})
    t0 = time.perf_counter()
    train(pcfg)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_rows = [r for r in rows if r.get("step", 0) >= 1 and "time/step_s" in r]
    step_s = [float(r["time/step_s"]) for r in steps_rows]
    toks = [float(r.get("tokens/generated", 0.0)) for r in steps_rows]
    # the same steady steps as the step mean (not the first, not the last with its eval + checkpoint)
    steady_rows = [steps_rows[i] for i in _steady(list(range(len(steps_rows))), drop_last=True)]
    split = {k: statistics.fmean(float(r.get(k, 0.0)) for r in steady_rows)
             for k in ("time/rollout_s", "time/reward_s", "time/learner_s")} if steady_rows else {}
    ck = latest_checkpoint(run_dir)
    if ck is None:
        raise RuntimeError(f"posttrain run in {run_dir} wrote no checkpoint")
    tok, model = _load(ck / "actor")
    _, sft_model = _load(sft_dir)
    ev = evaluate_model(model, tok, cfg)
    return {
        "steps": len(step_s), "step_s": step_s, "generated_tokens_per_step": toks,
        "generated_tokens": sum(toks), "train_wall_s": wall,
        # the last step also runs the held-out eval and the checkpoint: excluded from the step mean
        **_side_summary(step_s, toks, drop_last=True),
        "time_split_s": split,
        "heldout": ev, "heldout_accuracy": ev["accuracy"],
        "weight_delta_l2": _weight_delta(model, sft_model.state_dict()),
        "reward_mean_per_step": [r.get("reward/mean") for r in steps_rows],
        "precision_keys": {"rollout.precision": pcfg.rollout.precision, "learner.precision": pcfg.learner.precision},
    }


# ---------------------------------------------------------------------------------------------- TRL
def _trl_prompts(cfg: RunConfig, steps: int) -> list[TaskExample]:
    """Exactly the prompts posttrain's data cursor hands out over ``steps`` steps, in order."""
    from posttrain.loop.builders import build_task

    task: Task = build_task(cfg)
    p = cfg.sampling.prompts_per_step
    out: list[TaskExample] = []
    for s in range(steps):  # mirrors Run.next_prompts: seed = seed * 7919 + cursor
        out.extend(task.examples("train", p, seed=cfg.seed * 7_919 + s * p))
    return out


def _trl_prompt_texts(cfg: RunConfig, tokenizer: PreTrainedTokenizerBase,
                      examples: Sequence[TaskExample]) -> list[str]:
    """The prompt text TRL gets for each example: posttrain's own rendering (chat template and system
    prompt when ``task.chat_template``), checked to tokenize to the very ids posttrain samples from.

    TRL tokenizes a plain-text prompt with ``processing_class(text=...)`` (the tokenizer's default
    special tokens); a rendering that would not round-trip (a chat-rendered prompt on a tokenizer that
    adds a BOS, say) is refused rather than compared on different prompts.
    """
    from posttrain.loop.builders import build_renderer

    renderer = build_renderer(cfg, tokenizer)
    texts = [renderer.text(ex) for ex in examples]
    for ex, t in zip(examples, texts, strict=True):
        if list(tokenizer(t).input_ids) != list(renderer.ids(ex)):
            raise ValueError(f"vs-trl: prompt {ex.prompt_id!r} tokenizes differently as text than posttrain renders "
                             "it; the two sides would not see the same prompt")
    return texts


def _checkpointing_field(config_cls: type[GRPOConfig]) -> str:
    """``activation_checkpointing`` (transformers >= 5) or its older name ``gradient_checkpointing``."""
    names = {f.name for f in dataclasses.fields(config_cls)}
    return "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"


def trl_config(cfg: RunConfig, work: Path, steps: int, precision: str = "fp32") -> GRPOConfig:
    """TRL's ``GRPOConfig`` matched to ``cfg`` (the settings listed in this module's docstring), its
    ``bf16`` flag from ``precision`` (``bf16``: bf16 autocast over float32 master weights on CPU)."""
    from trl import GRPOConfig  # type: ignore[attr-defined]

    s, o, lk = cfg.sampling, cfg.optim, cfg.loss.kwargs
    # Any: a field name known only at run time, which mypy cannot match to one of GRPOConfig's parameters
    ckpt_kw: dict[str, Any] = {_checkpointing_field(GRPOConfig): False}
    return GRPOConfig(
        output_dir=str(work / "trl"),
        max_steps=steps,
        per_device_train_batch_size=s.prompts_per_step * s.group_size,
        gradient_accumulation_steps=1,
        num_generations=s.group_size,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        learning_rate=o.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=o.weight_decay,
        adam_beta1=o.betas[0],
        adam_beta2=o.betas[1],
        max_grad_norm=o.max_grad_norm if o.max_grad_norm is not None else 0.0,
        beta=0.0,
        num_iterations=1,
        loss_type="grpo",
        epsilon=float(lk.get("eps_low", lk.get("eps", 0.2))),
        epsilon_high=float(lk.get("eps_high", lk.get("eps_low", lk.get("eps", 0.2)))),
        scale_rewards="group" if cfg.credit.kwargs.get("norm_std", True) else "none",
        shuffle_dataset=False,
        use_cpu=True,
        bf16=precision == "bf16",  # accelerate: torch.autocast("cpu", bfloat16), float32 master weights
        fp16=False,
        report_to="none",
        save_strategy="no",
        logging_steps=max(steps, 1),
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=0,
        # TRL turns activation (gradient) checkpointing on by default; posttrain's demo does not use it.
        **ckpt_kw,
    )


def check_trl_mixed_precision(accelerator: object, precision: str) -> None:
    """The accelerator TRL's trainer built runs ``precision``: ``bf16`` = ``mixed_precision == "bf16"`` with
    accelerate's native autocast (``native_amp``), ``fp32`` = ``mixed_precision == "no"``; ``RuntimeError``
    (one line) otherwise, so that a bf16 comparison never runs TRL in float32. ``accelerator``: an
    ``accelerate.Accelerator`` (the optional [bench] extra), read by ``getattr`` (absent: a mismatch)."""
    want = "bf16" if precision == "bf16" else "no"
    got, amp = getattr(accelerator, "mixed_precision", None), bool(getattr(accelerator, "native_amp", False))
    if got != want or (precision == "bf16") != amp:
        raise RuntimeError(f"vs-trl --precision {precision}: TRL's accelerator runs mixed_precision={got!r} "
                           f"(native autocast {amp}), not {want!r}; the sides would not share a dtype")


def _linear_dtype_probe(model: torch.nn.Module) -> tuple[set[tuple[str, str]], RemovableHandle | None]:
    """A forward hook on ``model``'s first ``nn.Linear`` that records ``(phase, output dtype)`` per call,
    phase ``no_grad`` (generation, old log-probs) or ``grad`` (the training forward); the set and the
    hook's handle (None: no Linear)."""
    seen: set[tuple[str, str]] = set()
    lin = next((m for m in model.modules() if isinstance(m, torch.nn.Linear)), None)
    if lin is None:
        return seen, None

    def hook(_m: torch.nn.Module, _i: tuple[object, ...], out: object) -> None:
        if isinstance(out, torch.Tensor):
            seen.add(("grad" if torch.is_grad_enabled() else "no_grad", str(out.dtype).removeprefix("torch.")))

    return seen, lin.register_forward_hook(hook)


class TrlDtypesSeen(TypedDict):
    """What TRL computed in (:func:`check_trl_dtypes_seen`): the Linear output dtypes per phase, the
    parameters' dtypes."""

    no_grad: list[str]
    grad: list[str]
    param_dtypes: list[str]


def check_trl_dtypes_seen(seen: set[tuple[str, str]], model: torch.nn.Module,
                          precision: str) -> TrlDtypesSeen:
    """What TRL computed in: the Linear output dtypes ``seen`` per phase (:func:`_linear_dtype_probe`) must be
    bfloat16 (``bf16``) or float32 (``fp32``) in each phase that ran, and the master weights float32;
    ``RuntimeError`` (one line) otherwise. Returns ``{"no_grad": [...], "grad": [...], "param_dtypes": [...]}``."""
    want = "bfloat16" if precision == "bf16" else "float32"
    by_phase = {ph: sorted(d for p, d in seen if p == ph) for ph in ("no_grad", "grad")}
    params = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})
    if any(d and d != [want] for d in by_phase.values()):
        raise RuntimeError(f"vs-trl --precision {precision}: TRL's forwards computed in {by_phase} (no_grad = "
                           f"generation, grad = training), not {want} throughout")
    if params != ["float32"]:
        raise RuntimeError(f"vs-trl --precision {precision}: TRL's master weights are {params}, not float32")
    return {"no_grad": by_phase["no_grad"], "grad": by_phase["grad"], "param_dtypes": params}


def check_trl_composition(cfg: RunConfig) -> None:
    """Refuse (``ValueError``) a recipe TRL's GRPOTrainer cannot match: it must be GRPO with a clipped ratio
    and no KL, ``loss.reduction=seq_mean_token_mean`` (TRL's ``loss_type='grpo'``), and one constant-LR
    optimiser step per rollout batch (``ppo_epochs = num_minibatches = 1``, no warm-up)."""
    o = cfg.optim
    if cfg.loss.kl_estimator is not None or cfg.credit.estimator != "grpo" or cfg.loss.policy_loss != "ppo_clip":
        raise ValueError("vs-trl compares GRPO with a clipped ratio and no KL (the demo recipe's composition)")
    if cfg.loss.reduction != "seq_mean_token_mean":
        raise ValueError("vs-trl maps loss.reduction=seq_mean_token_mean to TRL loss_type='grpo'; got "
                         f"{cfg.loss.reduction}")
    if o.ppo_epochs != 1 or o.num_minibatches != 1 or o.schedule != "constant" or o.warmup_steps:
        raise ValueError("vs-trl matches one constant-LR optimiser step per rollout batch")


TrlRewardFunc = Callable[..., list[float | None]]
"""A TRL reward function: called with keyword lists (``prompts``, ``completions``, ``completion_ids``, the
dataset's columns) and TRL's own extras; one reward per completion."""


def _trl_reward(cfg: RunConfig, task: Task, examples: Sequence[TaskExample],
                gen_tokens: list[int]) -> TrlRewardFunc:
    """posttrain's reward as a TRL reward function: the task's verifier (with ``reward.extract``) against
    ``examples[example_index].reference`` and, when the recipe sets ``reward.overlong_max_len``, DAPO's
    overlong penalty of the completion's length (Yu et al. 2025, arXiv:2503.14476), composed with the
    recipe's weights: ``total = sum_k weights[k] * components[k]`` (as posttrain scores). Each call appends
    the batch's generated token count to ``gen_tokens``."""
    from posttrain.algos.shaping import dapo_overlong_penalty
    from posttrain.rewards import compose

    weights = dict(cfg.reward.weights)

    def task_reward(prompts: list[str], completions: list[str], completion_ids: list[list[int]],
                    example_index: list[int], **_: object) -> list[float | None]:
        gen_tokens.append(sum(len(c) for c in completion_ids))
        lengths = torch.tensor([len(c) for c in completion_ids], dtype=torch.float64)
        overlong = (dapo_overlong_penalty(lengths, cfg.reward.overlong_max_len, cfg.reward.overlong_cache_len).tolist()
                    if cfg.reward.overlong_max_len is not None else None)
        out: list[float | None] = []
        for j, (text, i) in enumerate(zip(completions, example_index, strict=True)):
            components = dict(task.verifier.verify(text, examples[i].reference).components)
            if overlong is not None:
                components["overlong"] = float(overlong[j])
            out.append(float(compose(components, weights).total or 0.0))
        return out

    return task_reward


def _step_timer(step_s: list[float]) -> TrainerCallback:
    """A TRL (transformers) callback appending to ``step_s`` the wall-clock seconds between optimiser steps
    (generation + reward + update all inside), the first step timed from the start of training."""
    from transformers import TrainerCallback

    class _Timer(TrainerCallback):
        """Wall-clock between optimiser steps, into ``step_s``."""

        def on_train_begin(self, *a: object, **k: object) -> None:
            self.t = time.perf_counter()

        def on_step_end(self, *a: object, **k: object) -> None:
            now = time.perf_counter()
            step_s.append(now - self.t)
            self.t = now

    return _Timer()


def run_trl(cfg: RunConfig, sft_dir: Path, work: Path, steps: int, precision: str = "fp32") -> TrlResult:
    """TRL's GRPOTrainer from ``sft_dir`` on the same prompts and settings; timings + held-out.

    The recipe must be one TRL can match (:func:`check_trl_composition`); the reward is posttrain's
    (:func:`_trl_reward`). ``precision`` (``--precision``) sets TRL's ``bf16`` (:func:`trl_config`); the
    accelerator is checked to run it (:func:`check_trl_mixed_precision`) and its forwards to compute in it
    (:func:`check_trl_dtypes_seen`)."""
    try:
        from datasets import Dataset
        from trl import GRPOTrainer  # type: ignore[attr-defined]
    except ImportError as e:
        raise ImportError("posttrain bench vs-trl needs TRL: pip install 'posttrain[bench]'") from e
    from posttrain.loop.builders import build_task

    check_trl_composition(cfg)
    task: Task = build_task(cfg)
    examples = _trl_prompts(cfg, steps)
    tok, model = _load(sft_dir)
    texts = _trl_prompt_texts(cfg, tok, examples)
    ds = Dataset.from_list([{"prompt": t, "example_index": i} for i, t in enumerate(texts)])
    gen_tokens: list[int] = []
    step_s: list[float] = []
    args = trl_config(cfg, work, steps, precision)
    if getattr(args, "gradient_checkpointing", False):
        raise RuntimeError("vs-trl: TRL gradient checkpointing could not be switched off")
    sft_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reward = _trl_reward(cfg, task, examples, gen_tokens)
        trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                              processing_class=tok, callbacks=[_step_timer(step_s)])
        check_trl_mixed_precision(trainer.accelerator, precision)
        seen, probe = _linear_dtype_probe(model)
        t0 = time.perf_counter()
        try:
            trainer.train()
        finally:
            if probe is not None:
                probe.remove()
        wall = time.perf_counter() - t0
    trained = trainer.accelerator.unwrap_model(trainer.model).eval()
    precision_seen = check_trl_dtypes_seen(seen, trained, precision)
    ev = evaluate_model(trained, tok, cfg)
    toks = [float(n) for n in gen_tokens]
    return {
        "steps": len(step_s), "step_s": step_s, "generated_tokens_per_step": toks,
        "generated_tokens": sum(toks), "train_wall_s": wall,
        **_side_summary(step_s, toks, drop_last=True),
        "heldout": ev, "heldout_accuracy": ev["accuracy"],
        "weight_delta_l2": _weight_delta(trained, sft_state),
        "trl_version": __import__("trl").__version__,
        "precision_seen": precision_seen,
    }


# ---------------------------------------------------------------------------------------------- report
class VsTrlReport(TypedDict):
    """The JSON ``bench vs-trl`` writes and :func:`_table` prints: the run's settings and CPU, the SFT start's
    held-out accuracy, each side's result (``None``: that side did not run) and, when both ran, the ratios
    ``speedup_vs_trl`` = TRL step s / posttrain step s, ``tokens_per_s_ratio`` (posttrain / TRL generated tokens
    per second), ``heldout_accuracy_diff`` (posttrain - TRL) and ``generated_tokens_ratio``."""

    shape: str
    recipe: str
    overrides: list[str]
    steps: int
    task: str
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    lr: float
    temperature: float
    torch_threads: int
    cpu_count: int | None
    torch: str
    sft_dir: str
    seed: int
    heldout_seed: int
    sft_heldout_accuracy: float
    heldout_size: int
    precision: str
    posttrain_precision: str
    trl_precision: str
    precision_detail: dict[str, str]
    posttrain_precision_overrides: list[str]
    trl_bf16: bool
    cpu: dict[str, str | bool | None]
    posttrain: PosttrainResult | None
    trl: TrlResult | None
    order: list[str]
    speedup_vs_trl: float | None
    speedup_vs_trl_by_shape: NotRequired[dict[str, float]]
    tokens_per_s_ratio: NotRequired[float]
    heldout_accuracy_diff: NotRequired[float]
    generated_tokens_ratio: NotRequired[float]
    posttrain_heldout_accuracy: float | None
    trl_heldout_accuracy: float | None


def _printed_figures(side: SideResult | None) -> dict[str, float]:
    """The figures :func:`_table` prints of one side, those it has (``{}`` for a side that did not run)."""
    if side is None:
        return {}
    got = (("step_s_mean", side.get("step_s_mean")), ("gen_tokens_per_s", side.get("gen_tokens_per_s")),
           ("generated_tokens", side.get("generated_tokens")), ("heldout_accuracy", side.get("heldout_accuracy")),
           ("train_wall_s", side.get("train_wall_s")))
    return {k: float(v) for k, v in got if v is not None}


def _fmt(x: float | None, spec: str) -> str:
    """``x`` formatted with ``spec``; ``-`` for None or a non-finite float."""
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, spec)


def _cpu_text(cpu: CpuFacts) -> str:
    """``NAME (avx512_bf16 yes, amx_bf16 no)`` from :func:`cpu_facts`."""
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in (("avx512_bf16", cpu.avx512_bf16),
                                                                    ("amx_bf16", cpu.amx_bf16)))
    return f"{cpu.name} ({flags})"


def _table(res: VsTrlReport, cpu: CpuFacts | None = None) -> str:
    """The printed comparison of the results ``res`` (the JSON object; a side not run: ``-``), with a
    ``CPU:`` line when ``cpu`` is given. Held-out gain per 1k generated tokens = (accuracy after RL - the SFT
    start's) / (generated tokens / 1000)."""
    p, t = _printed_figures(res["posttrain"]), _printed_figures(res["trl"])
    sft = res["sft_heldout_accuracy"]

    def gain(side: dict[str, float]) -> float | None:
        if not side or not side.get("generated_tokens"):
            return None
        return (side["heldout_accuracy"] - sft) / (side["generated_tokens"] / 1000.0)

    prec = res["precision"]
    rows = [
        ("precision", prec if p else "-", prec if t else "-", "same dtype policy"),
        ("wall-clock per step (s)", _fmt(p.get("step_s_mean"), ".3f"), _fmt(t.get("step_s_mean"), ".3f"),
         _fmt(res.get("speedup_vs_trl"), ".2f") + "x faster"),
        ("generated tokens / s", _fmt(p.get("gen_tokens_per_s"), ".0f"), _fmt(t.get("gen_tokens_per_s"), ".0f"),
         _fmt(res.get("tokens_per_s_ratio"), ".2f") + "x"),
        ("generated tokens (total)", _fmt(p.get("generated_tokens"), ".0f"), _fmt(t.get("generated_tokens"), ".0f"),
         ""),
        ("held-out accuracy (SFT start)", _fmt(sft, ".3f"), _fmt(sft, ".3f"), ""),
        ("held-out accuracy (after RL)", _fmt(p.get("heldout_accuracy"), ".3f"),
         _fmt(t.get("heldout_accuracy"), ".3f"), _fmt(res.get("heldout_accuracy_diff"), "+.3f") + " (pt - trl)"),
        ("held-out gain / 1k gen. tokens", _fmt(gain(p), "+.4f"), _fmt(gain(t), "+.4f"), ""),
        ("train wall-clock total (s)", _fmt(p.get("train_wall_s"), ".1f"), _fmt(t.get("train_wall_s"), ".1f"), ""),
    ]
    w0 = max(len(r[0]) for r in rows)
    head = f"{'':<{w0}}  {'posttrain':>10}  {'TRL':>10}  ratio"
    lines = [head] + [f"{a:<{w0}}  {b:>10}  {c:>10}  {d}" for a, b, c, d in rows]
    if cpu is not None:
        lines.append(f"CPU: {_cpu_text(cpu)}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Run the benchmark: SFT once, then posttrain GRPO and TRL GRPO back to back; print + JSON."""
    realistic = args.shape == "realistic"
    if args.recipe is None:
        args.recipe = REALISTIC_RECIPE if realistic else "demo"
    shape = REALISTIC_OVERRIDES if realistic else []
    overrides = MATCHED_OVERRIDES + shape + list(QUICK_OVERRIDES if args.quick else []) + list(args.overrides)
    default_steps = REALISTIC_STEPS if realistic else DEFAULT_STEPS
    steps = args.steps if args.steps is not None else (QUICK_STEPS if args.quick else default_steps)
    if steps < 1:
        raise ValueError("--steps must be >= 1")
    cpu = cpu_facts()
    check_precision(getattr(args, "precision", "fp32"), overrides, cpu)  # one line, before any work
    threads_before = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(max(int(args.threads), 1))
    try:
        # The benchmark's own output is the table: quiet the loop's INFO / WARNING lines, and restore the
        # level after (a caller in the same process, e.g. a test run, keeps its logging).
        plog = logging.getLogger("posttrain")
        level_before = plog.level
        plog.setLevel(logging.ERROR)
        try:
            seeds: list[int] | None = getattr(args, "seeds", None)
            if seeds:
                return _run_seeds(args, overrides, steps, cpu, seeds)
            res = _run(args, overrides, steps, cpu, Path(args.work_dir))
            _write_json(args, res)
            return 0
        finally:
            plog.setLevel(level_before)
    finally:
        torch.set_num_threads(threads_before)


def _write_json(args: argparse.Namespace, obj: object) -> None:
    """``obj`` as indented JSON to ``--json`` (when given), its folder made."""
    if getattr(args, "json_path", None):
        Path(args.json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_path).write_text(json.dumps(obj, indent=1, default=str))
        print(f"json: {args.json_path}")


def _run_seeds(args: argparse.Namespace, overrides: list[str], steps: int, cpu: CpuFacts, seeds: list[int]) -> int:
    """``--seeds``: :func:`_run` once per seed (``seed=S``, work dir ``WORK_DIR/seed_S``, the held-out problems of
    :func:`~posttrain.bench.vs_trl_seeds.seeded_overrides`), then the per-seed table and the pooled difference
    (:func:`~posttrain.bench.vs_trl_seeds.summarize`); the JSON holds every seed's report and the summary."""
    from posttrain.bench.vs_trl_seeds import SeedResult, seeded_overrides, seeds_table, summarize

    base, heldout_seed = seeded_overrides(overrides, seeds, _config(args.recipe, overrides).eval.heldout_seed)
    reports: list[VsTrlReport] = []
    for seed in seeds:
        print(f"--- seed {seed} (held-out problems drawn with seed {heldout_seed}) ---", flush=True)
        reports.append(_run(args, [*base, f"seed={seed}"], steps, cpu, Path(args.work_dir) / f"seed_{seed}"))
    summary = summarize(heldout_seed, [SeedResult(r["seed"], r["sft_heldout_accuracy"], _side_figures(r["posttrain"]),
                                                  _side_figures(r["trl"])) for r in reports])
    print(seeds_table(summary))
    _write_json(args, {"seeds": seeds, "runs": reports, "summary": summary})
    return 0


def _side_figures(side: SideResult | None) -> SideFigures | None:
    """What ``--seeds``' summary reads of one side's result (``None``: the side did not run)."""
    from posttrain.bench.vs_trl_seeds import SideFigures
    from posttrain.diagnostics.heldout_outcomes import SetOutcomes

    if side is None:
        return None
    o = side["heldout"]["outcomes"]
    return SideFigures(side["heldout_accuracy"], side["step_s_mean"],
                       SetOutcomes(tuple(o["prompt_ids"]), tuple(o["valid"]), tuple(o["correct"])))


def _run(args: argparse.Namespace, overrides: list[str], steps: int, cpu: CpuFacts, work: Path) -> VsTrlReport:
    """One comparison with ``overrides`` in ``work``: the SFT start, then both sides in ``--trl-first`` order;
    prints the header, the table and posttrain's step split; returns the report (the JSON of one run)."""
    precision = getattr(args, "precision", "fp32")
    cfg = _config(args.recipe, overrides)  # SFT start, TRL's settings, the held-out judge: float32
    precision_overrides = POSTTRAIN_PRECISION_OVERRIDES[precision]
    pt_cfg = _config(args.recipe, overrides + precision_overrides) if precision_overrides else cfg
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    sft_dir, sft_s = prepare_sft(cfg, work, fresh=args.fresh_sft)
    tok, sft_model = _load(sft_dir)
    sft_eval = evaluate_model(sft_model, tok, cfg)
    s = cfg.sampling
    print(f"vs-trl: recipe {args.recipe}, task {cfg.task.name} {cfg.task.kwargs}, {steps} steps x "
          f"{s.prompts_per_step} prompts x G={s.group_size}, max_new_tokens={s.max_new_tokens}, lr={cfg.optim.lr}, "
          f"torch threads={torch.get_num_threads()}; SFT held-out accuracy {sft_eval['accuracy']:.3f}"
          + (f" (SFT took {sft_s:.0f} s)" if sft_s else " (SFT checkpoint reused)"), flush=True)
    print(f"precision {precision}: posttrain {PRECISION_DETAIL[precision]['posttrain']}; TRL "
          f"{PRECISION_DETAIL[precision]['trl']}; CPU {_cpu_text(cpu)}", flush=True)

    order = ["trl", "posttrain"] if args.trl_first else ["posttrain", "trl"]
    res: VsTrlReport = {  # the JSON written (a side not run: None)
        "shape": args.shape, "recipe": args.recipe, "overrides": overrides, "steps": steps, "task": cfg.task.name,
        "prompts_per_step": s.prompts_per_step, "group_size": s.group_size, "max_new_tokens": s.max_new_tokens,
        "lr": cfg.optim.lr, "temperature": s.temperature, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(), "torch": torch.__version__, "sft_dir": str(sft_dir),
        "seed": cfg.seed, "heldout_seed": cfg.eval.heldout_seed_of(cfg.seed),
        "sft_heldout_accuracy": sft_eval["accuracy"], "heldout_size": cfg.eval.size,
        "precision": precision, "posttrain_precision": precision, "trl_precision": precision,
        "precision_detail": PRECISION_DETAIL[precision], "posttrain_precision_overrides": precision_overrides,
        "trl_bf16": precision == "bf16", "cpu": cpu.as_json(),
        "posttrain": None, "trl": None, "order": order, "speedup_vs_trl": None,
        "posttrain_heldout_accuracy": None, "trl_heldout_accuracy": None,
    }
    for side in order:
        if args.only not in ("both", side):
            continue
        print("posttrain GRPO ..." if side == "posttrain" else "TRL GRPOTrainer ...", flush=True)
        if side == "posttrain":
            res["posttrain"] = run_posttrain(pt_cfg, sft_dir, work, steps)
        else:
            res["trl"] = run_trl(cfg, sft_dir, work, steps, precision)
    p, t = res["posttrain"], res["trl"]
    if p and t:
        speedup = t["step_s_mean"] / p["step_s_mean"]
        res["speedup_vs_trl"] = speedup
        res["speedup_vs_trl_by_shape"] = {str(args.shape): speedup}
        res["tokens_per_s_ratio"] = p["gen_tokens_per_s"] / t["gen_tokens_per_s"]
        res["heldout_accuracy_diff"] = p["heldout_accuracy"] - t["heldout_accuracy"]
        res["generated_tokens_ratio"] = p["generated_tokens"] / max(t["generated_tokens"], 1.0)
    res["posttrain_heldout_accuracy"] = p["heldout_accuracy"] if p else None
    res["trl_heldout_accuracy"] = t["heldout_accuracy"] if t else None
    print(_table(res, cpu))
    if p:
        sp = p["time_split_s"]
        print(f"posttrain step split (mean s): rollout {sp['time/rollout_s']:.3f}, reward {sp['time/reward_s']:.3f}, "
              f"learner {sp['time/learner_s']:.3f}, other {p['step_s_mean'] - sum(sp.values()):.3f}")
    return res
