"""``posttrain eval CHECKPOINT`` (or ``--task NAME`` / ``--env NAME``): held-out accuracy of a saved policy.

A checkpoint inside a run directory (``RUN/checkpoints/step_N`` or its ``actor/``) is evaluated
**as the run evaluated it**: the run's ``config.yaml`` is loaded and its held-out evaluation runs
through the run's own code (:func:`~posttrain.loop.heldout.heldout_metrics` over a
:class:`~posttrain.evaluation.heldout.HeldoutRun`): task and kwargs (``reward.extract``,
``reward.functions``), ``task.chat_template`` / ``task.system_prompt``, the token budget
(``eval.max_new_tokens``, default ``sampling.max_new_tokens``), ``eval.size`` / ``seed`` (the same
held-out split), ``eval.temperature`` / ``sampled_temperature`` / ``samples`` / ``k``, the
environment's ``env.*`` settings and ``reward.weights``. One line on stderr says so; the flags
given override their keys and the line names them. The ``config.yaml`` is read as recorded
(:func:`~posttrain.loop.validate.validate_recorded_config`): a setting refused for new runs since the run
was written is one warning line, and the training machine's GPU, vLLM environment and trackers are not
required here. The greedy figures then equal the run's
``heldout/*`` record at that step (``metrics.jsonl``) unless that step's revision was rejected (the
checkpoint then holds the restored promoted weights). Every held-out set the task declares
(``eval_splits``, e.g. ``heldout_unseen``) is evaluated and printed the same way, and ``intervals_95``
gives each evaluation's bootstrap 95% interval of accuracy over its problems.

A bare Hugging Face model directory (no run around it) needs ``--task`` or ``--env``; the flags'
defaults apply (raw-text prompts, 16 new tokens, 200 prompts, greedy, seed 0). So does a checkpoint of a run
whose trainer sampled no task (its entry in :data:`posttrain.config.trainers.TRAINERS`: offline
``trainer: preference`` measured held-out pair accuracy, ``trainer: sft`` held-out loss): without
``--task`` / ``--env`` it is one error line saying so. A reward model's checkpoint (``trainer: reward_model``)
scores and does not generate: one error line pointing to its pair accuracy and ``reward.model.path``; so is a
reward-model directory outside a run's checkpoints (``RUN/reward_model``, or a third-party
``*ForSequenceClassification`` directory), whatever ``--task`` / ``--env`` say.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from posttrain.config import RunConfig
    from posttrain.diagnostics.intervals import Interval

# The flags' values for a bare model dir (no run config); with a run they default to the run's keys.
_BARE = {"n": 200, "max_new_tokens": 16, "temperature": 0.0, "seed": 0, "max_turns": 4,
         "max_episode_tokens": 256, "chat_template": "false"}


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (as its run did) or a HF model dir on held-out prompts")
    p.add_argument("checkpoint", help="a checkpoint dir (runs/NAME/checkpoints/step_N), its actor/ dir, or a HF model "
                   "dir; inside a run dir the run's config.yaml sets every default below")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--task", help="task name (e.g. arithmetic) or module:factory (needed without a run config)")
    what.add_argument("--env", help="multi-turn environment (an env.name: calculator_tool, ... or module:factory)")
    p.add_argument("--task-kwargs", default=None,
                   help='JSON kwargs of the task (or of the environment with --env), e.g. \'{"digits": 2}\'')
    p.add_argument("--max-turns", type=int, default=None, help="--env: policy turns per episode (env.max_turns; "
                   f"bare dir: {_BARE['max_turns']})")
    p.add_argument("--max-episode-tokens", type=int, default=None,
                   help=f"--env: tokens per episode (env.max_tokens; bare dir: {_BARE['max_episode_tokens']})")
    p.add_argument("--no-tools", action="store_true", help="--env: the same episodes without tools")
    p.add_argument("--n", type=int, default=None, help=f"held-out prompts (eval.size; bare dir: {_BARE['n']})")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"tokens per response / turn (eval.max_new_tokens; bare dir: {_BARE['max_new_tokens']})")
    p.add_argument("--temperature", type=float, default=None, help="eval.temperature (0 = greedy; bare dir: 0)")
    p.add_argument("--seed", type=int, default=None, help="seed: held-out split and sampling (bare dir: 0)")
    p.add_argument("--chat-template", choices=("true", "false", "auto"), default=None,
                   help="task.chat_template: render prompts with the tokenizer's chat template (bare dir: false)")
    p.add_argument("--system-prompt", default=None, help="task.system_prompt")
    p.add_argument("--extract", default=None,
                   help="reward.extract: none|auto|last_number|boxed|answer_tag|answer_line")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM

    from posttrain.diagnostics.intervals import accuracy_interval
    from posttrain.evaluation.heldout import HeldoutRun
    from posttrain.loop.heldout import evaluate_run, heldout_evaluation, outcomes_of
    from posttrain.models.tokenizer import load_pretrained_tokenizer

    path = Path(args.checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    model_dir = path / "actor" if (path / "actor").is_dir() else path
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a checkpoint, actor/ or Hugging Face model directory)")
    kwargs: dict[str, Any] | None = None
    if args.task_kwargs is not None:
        try:
            kwargs = json.loads(args.task_kwargs)
        except json.JSONDecodeError as e:
            raise ValueError(f"--task-kwargs is not JSON: {e}") from None
        if not isinstance(kwargs, dict):
            raise ValueError(f"--task-kwargs must be a JSON object, got {args.task_kwargs!r}")
    cfg_path = run_config_path(path)
    if cfg_path is not None and _evaluated_no_task(cfg_path, args, model_dir):
        cfg_path = None  # the policy of a run that sampled no task, on the flags' task: as a model directory
    if cfg_path is not None:
        cfg, overridden = _as_the_run(cfg_path, args, kwargs, model_dir)
        print(_as_the_run_line(cfg_path, cfg, overridden, args.no_tools), file=sys.stderr)
        note = _rejected_note(model_dir.parent if model_dir.name == "actor" else model_dir)
        if note:
            print(note, file=sys.stderr)
    else:
        _refuse_reward_model(model_dir)
        cfg, overridden = _bare(args, kwargs, model_dir), []
    if args.no_tools and cfg.env.name is None:
        raise ValueError("--no-tools is an --env option (single-turn tasks have no tools)")
    from posttrain.learner.checkpoint import load_pretrained_weights, quiet_hf_progress
    from posttrain.loop.builders import _DTYPES, build_model

    with quiet_hf_progress():  # the one line above stays the command's only line on stderr
        model: Any
        if cfg_path is not None and cfg.model.path.startswith("builtin:"):
            # The run's own model (a builtin preset's attention implementation, dtype and tokenizer: a
            # from_pretrained of actor/ would pick another attention kernel, and greedy near-ties can flip)
            # with the checkpoint's weights.
            tok, model = build_model(cfg)
            try:
                load_pretrained_weights(model, model_dir)
            except RuntimeError as e:  # shapes of another preset
                why = str(e).splitlines()[1].strip() if len(str(e).splitlines()) > 1 else str(e)
                raise ValueError(f"{model_dir}: the weights do not fit the run's model.path={cfg.model.path} "
                                 f"({cfg_path}): {why[:200]}") from None
            model.eval()
        else:  # a run from a local model dir loaded it like this too (model.dtype); a bare dir: as saved
            dtype: dict[str, Any] = {"dtype": _DTYPES[cfg.model.dtype]} if cfg_path is not None else {}
            tok = load_pretrained_tokenizer(model_dir)  # a char tokenizer reloads as itself
            model = AutoModelForCausalLM.from_pretrained(model_dir, **dtype)
            model.eval()
    hr = HeldoutRun.from_config(cfg, model, tok)
    try:
        if args.no_tools:
            from posttrain.envs.episodes import EnvTask

            assert isinstance(hr.task, EnvTask)  # --no-tools without an environment is refused above
            try:
                hr.task.make_env(use_tools=False)
            except TypeError:
                raise ValueError(f"--no-tools: environment {cfg.env.name!r} has no use_tools switch") from None
            res = evaluate_run(hr, env_overrides={"use_tools": False})
            metrics = res.as_metrics()
            sets = {"heldout": outcomes_of(res, hr.heldout)}
        else:
            ev = heldout_evaluation(hr)
            res, metrics, sets = ev.main, ev.metrics, ev.outcomes
    finally:
        hr.close()
    out: dict[str, Any] = {"checkpoint": str(path)}
    if cfg.env.name is not None:
        out.update({"env": cfg.env.name, "tools": not args.no_tools,
                    "env_settings_from": str(cfg_path) if cfg_path is not None else "command line"})
    else:
        out["task"] = cfg.task.name
    out.update({"config_from": None if cfg_path is None else str(cfg_path), "overridden": overridden,
                **metrics, "n": res.n,
                # Bootstrap 95% interval of each set's accuracy over its problems (Efron & Tibshirani 1993).
                "intervals_95": {name: _bounds(accuracy_interval(o.valid, o.correct)) for name, o in sets.items()}})
    print(json.dumps(out, indent=2))
    _check_judged(cfg, metrics, path)
    return 0


def _bounds(iv: Interval) -> list[float] | None:
    return None if iv.n == 0 else [iv.low, iv.high]


def _check_judged(cfg: RunConfig, metrics: dict[str, Any], path: Path) -> None:
    """As a run does: a pass whose failed verifications reach ``guards.max_infra_error_fraction`` warns in
    one line; when none of them could be judged, :class:`NothingJudgedError` (exit 2), since the printed
    figures are then no accuracies."""
    from posttrain.loop.guards import NothingJudgedError, check_guards, verification_counts

    check_guards(cfg.guards, metrics)
    counts = verification_counts(metrics).values()
    n, bad = sum(c[0] for c in counts), sum(c[1] for c in counts)
    if n and bad == n:
        raise NothingJudgedError(f"nothing could be judged: all {n} held-out verifications of {path} failed "
                                 "(infra_error / env_failure: no verdict), so the figures above are not accuracies")


def _evaluated_no_task(cfg_path: Path, args: argparse.Namespace, model_dir: Path) -> bool:
    """True when ``cfg_path`` is a run whose trainer sampled no task (its registry entry's ``samples``: offline
    preference, sft; it measured :attr:`~posttrain.config.trainers.TrainerEntry.heldout`) and ``--task`` /
    ``--env`` name what to evaluate its policy on (one note line on stderr); ``ValueError`` when they do not,
    or when the run's checkpoints hold no policy (``generates`` false: a reward model scores, it does not
    generate); False otherwise."""
    from posttrain.config.trainers import recorded_trainer
    from posttrain.loop.run_dir import read_config_yaml

    entry, view = recorded_trainer(read_config_yaml(cfg_path) or {}, str(cfg_path))
    run = cfg_path.parent
    if not entry.generates:
        raise ValueError(f"{model_dir}: a reward model (trainer={entry.name}, {cfg_path}) scores responses, it does "
                         f"not generate; its {entry.heldout} is in {run / 'metrics.jsonl'}; use it in RL with "
                         f"reward.model.path={run / 'reward_model'}")
    if entry.samples(view):
        return False
    if args.task is None and args.env is None:
        raise ValueError(f"{cfg_path}: trainer={entry.name} measured {entry.heldout} ({run / 'metrics.jsonl'}), on "
                         "no task; give --task NAME or --env NAME to evaluate its policy on held-out prompts")
    print(f"{cfg_path}: a trainer={entry.name} run ({entry.heldout}, no task): evaluating its policy as a model "
          "directory with the flags", file=sys.stderr)
    return True


def _refuse_reward_model(model_dir: Path) -> None:
    """``ValueError`` (one line) when the model directory outside a run's checkpoints is a reward model
    (:func:`~posttrain.rewards.reward_model.reward_model_evidence`, e.g. ``RUN/reward_model``): it scores
    responses and does not generate (loaded as a causal LM it would answer with an untrained LM head)."""
    from posttrain.rewards.reward_model import reward_model_evidence

    why = reward_model_evidence(model_dir)
    if why is None:
        return
    run = model_dir.parent
    where = (f"its held-out pair accuracy is in {run / 'metrics.jsonl'} (`posttrain report {run}`: "
             "pair_accuracy.json); " if (run / "config.yaml").is_file() else "")
    raise ValueError(f"{model_dir}: a reward model ({why}) scores responses, it does not generate, so it has no "
                     f"accuracy on a task; {where}use it in RL with reward.model.path={model_dir} (`posttrain report "
                     "RUN_DIR` of that run gives its agreement with the verifier)")


def run_config_path(checkpoint: Path) -> Path | None:
    """The ``config.yaml`` of the run holding ``checkpoint`` (``RUN/checkpoints/step_N`` or its ``actor/``),
    None for a directory outside a run (or a run without one)."""
    ckpt = checkpoint.parent if checkpoint.name == "actor" else checkpoint
    if ckpt.parent.name != "checkpoints":
        return None
    p = ckpt.parent.parent / "config.yaml"
    return p if p.is_file() else None


def _as_the_run(cfg_path: Path, args: argparse.Namespace, kwargs: dict[str, Any] | None,
                model_dir: Path) -> tuple[RunConfig, list[str]]:
    """The run's config with the given flags applied: ``(RunConfig, ["--flag (key a -> b)", ...])``."""
    from posttrain.loop.run_dir import read_config_yaml
    from posttrain.loop.validate import validate_recorded_config

    data = read_config_yaml(cfg_path)
    if data is None:
        raise ValueError(f"{cfg_path}: unreadable (not a YAML mapping); cannot evaluate as the run did")
    data = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items()}
    for sec in ("task", "env", "eval", "reward", "model"):
        data.setdefault(sec, {})
    was: dict[str, Any] = {"task": dict(data["task"]), "env": dict(data["env"]), "eval": dict(data["eval"]),
           "reward": dict(data["reward"]), "seed": data.get("seed")}
    overridden: list[str] = []

    def put(flag: str, section: str | None, key: str, value: Any) -> None:
        old = (data.get(key) if section is None else data[section].get(key))
        if section is None:
            data[key] = value
        else:
            data[section][key] = value
        name = key if section is None else f"{section}.{key}"
        overridden.append(f"{flag} ({name} {old!r} -> {value!r})")

    if args.task is not None:
        if data["env"].get("name") is not None:  # a single-turn task instead of the run's episodes
            put("--task", "env", "name", None)
        if args.task != was["task"].get("name"):
            put("--task", "task", "name", args.task)
            data["task"]["kwargs"] = {}  # the run's kwargs belong to its own task
    if args.env is not None and args.env != was["env"].get("name"):
        # Another environment: its settings come from the flags, not from the run's environment.
        data["env"] = {"name": args.env, "kwargs": {}, "max_turns": _BARE["max_turns"],
                       "max_tokens": _BARE["max_episode_tokens"]}
        overridden.append(f"--env (env.name {was['env'].get('name')!r} -> {args.env!r}; env.* from the flags)")
    env_mode = data["env"].get("name") is not None
    if kwargs is not None:
        put("--task-kwargs", "env" if env_mode else "task", "kwargs", kwargs)
    if args.max_turns is not None:
        put("--max-turns", "env", "max_turns", args.max_turns)
    if args.max_episode_tokens is not None:
        put("--max-episode-tokens", "env", "max_tokens", args.max_episode_tokens)
    if args.n is not None:
        put("--n", "eval", "size", args.n)
    if args.max_new_tokens is not None:
        put("--max-new-tokens", "eval", "max_new_tokens", args.max_new_tokens)
    if args.temperature is not None:
        put("--temperature", "eval", "temperature", args.temperature)
    if args.seed is not None:
        put("--seed", None, "seed", args.seed)
    if args.chat_template is not None:
        put("--chat-template", "task", "chat_template", _chat(args.chat_template))
    if args.system_prompt is not None:
        put("--system-prompt", "task", "system_prompt", args.system_prompt)
    if args.extract is not None:
        put("--extract", "reward", "extract", args.extract)
    # The weights are the checkpoint's. A builtin model is rebuilt as the run built it (then loaded with
    # them); a local model dir is replaced by the checkpoint's actor/ (the run's may be gone; the
    # renderer's char-preset rule reads the same answer off the saved tokenizer).
    if not str(data["model"].get("path", "builtin:")).startswith("builtin:"):
        data["model"]["path"] = str(model_dir)
    data["resume"] = data["resume_force"] = False  # nothing of the run is written by an evaluation
    # Read as recorded: a setting refused for new runs since the run was written is one warning line.
    return validate_recorded_config(data, f"{cfg_path} (posttrain eval)"), overridden


def _bare(args: argparse.Namespace, kwargs: dict[str, Any] | None, model_dir: Path) -> RunConfig:
    """The evaluation config of a model dir outside a run: the flags, else their bare defaults."""
    from posttrain.loop.validate import validate_config

    if args.task is None and args.env is None:
        raise ValueError(f"{args.checkpoint} is not inside a run directory with a config.yaml: give --task NAME "
                         "or --env NAME")

    def val(name: str) -> Any:
        v = getattr(args, name)
        return _BARE[name] if v is None else v

    mnt = val("max_new_tokens")
    data: dict[str, Any] = {
        "model": {"path": str(model_dir)}, "seed": val("seed"),
        "sampling": {"max_new_tokens": mnt},
        "eval": {"size": val("n"), "temperature": val("temperature"), "max_new_tokens": mnt},
    }
    if args.env is not None:
        data["env"] = {"name": args.env, "kwargs": kwargs or {}, "max_turns": val("max_turns"),
                       "max_tokens": val("max_episode_tokens")}
        source = "posttrain eval (env settings from the command line)"
    else:
        data["task"] = {"name": args.task, "kwargs": kwargs or {}, "chat_template": _chat(val("chat_template")),
                        "system_prompt": args.system_prompt}
        if args.extract is not None:
            data["reward"] = {"extract": args.extract}
        source = "posttrain eval"
    return validate_config(data, source)


def _chat(v: str) -> bool | str:
    return v if v == "auto" else v == "true"


def _as_the_run_line(cfg_path: Path, cfg: RunConfig, overridden: list[str], no_tools: bool) -> str:
    """``evaluating as the run RUN did (config.yaml): ...; overridden: ...`` (one line)."""
    from posttrain.config.engines import engine_entry

    e = cfg.eval
    budget = e.max_new_tokens or cfg.sampling.max_new_tokens
    if cfg.env.name is not None:
        v = cfg.env
        what = (f"env {v.name} {json.dumps(v.kwargs)} (max_turns {v.max_turns}, max_tokens {v.max_tokens}, "
                f"tool_prompt {v.tool_prompt!r}, stop_strings {list(v.stop_strings)}"
                f"{', without tools' if no_tools else ''})")
    else:
        t = cfg.task
        what = (f"task {t.name} {json.dumps(t.kwargs)}, chat_template {t.chat_template}, "
                f"system_prompt {t.system_prompt!r}, extract {cfg.reward.extract}")
    sampled = f", sampled at {e.sampled_temperature}" if e.sampled_temperature is not None else ""
    line = (f"evaluating as the run {cfg_path.parent} did ({cfg_path.name}): {what}, max_new_tokens {budget}, "
            f"eval.size {e.size}, temperature {e.temperature}{sampled}, samples {e.samples} (k {e.k}), seed {cfg.seed}")
    if not engine_entry(cfg.rollout.engine).samples_as_builtin:
        line += f", engine builtin (the run used rollout.engine={cfg.rollout.engine})"
    return line + ("; overridden: " + ", ".join(overridden) if overridden else "; no flag overrides")


def _rejected_note(ckpt: Path) -> str | None:
    """A line when the run rejected the revision of the checkpoint's step (``meta.json``): the weights
    saved are then the restored promoted ones, not those the run's evaluation at that step judged."""
    try:
        meta = json.loads((ckpt / "meta.json").read_text())
        rs = meta["extra"]["run_state"]
        step = int(meta["step"])
        rejected = any(d.get("step") == step and d.get("decision") == "rejected" for d in rs.get("decisions", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if not rejected:
        return None
    return (f"note: the run rejected its revision at step {step}: {ckpt.name} holds the restored promoted weights "
            f"(step {rs.get('promoted_step')}), so these figures can differ from the record of step {step}")
