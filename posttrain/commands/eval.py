"""``posttrain eval CHECKPOINT --task NAME`` (or ``--env NAME``): held-out accuracy of a saved policy.

``--task``: single-turn prompts of a task, rendered as ``--chat-template`` / ``--system-prompt`` say.
``--env``: whole multi-turn episodes of an environment (``env.name``), one per held-out start, played
as training plays them (:func:`~posttrain.loop.episode_rollout.evaluate_episodes`), with its tools
unless ``--no-tools``; a checkpoint inside a run directory brings the run's ``env`` settings
(``config.yaml``), so the episodes render exactly as in training."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (or HF model dir) on a task's held-out split")
    p.add_argument("checkpoint", help="a checkpoint dir (runs/NAME/checkpoints/step_N), its actor/ dir, or a HF model dir")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--task", help="task name (e.g. arithmetic) or module:factory")
    what.add_argument("--env", help="multi-turn environment (an env.name: calculator_tool, ... or module:factory)")
    p.add_argument("--task-kwargs", default="{}",
                   help='JSON kwargs of the task (or of the environment with --env), e.g. \'{"digits": 2}\'')
    p.add_argument("--max-turns", type=int, default=4, help="--env: policy turns per episode (the run's env.max_turns)")
    p.add_argument("--max-episode-tokens", type=int, default=256,
                   help="--env: tokens per episode (the run's env.max_tokens)")
    p.add_argument("--no-tools", action="store_true", help="--env: the same episodes without tools")
    p.add_argument("--n", type=int, default=200, help="held-out prompts")
    p.add_argument("--max-new-tokens", type=int, default=16)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", choices=("true", "false"), default="false",
                   help="render prompts with the tokenizer's chat template, as the run did with "
                   "task.chat_template (default: raw text)")
    p.add_argument("--system-prompt", default=None, help="the run's task.system_prompt, if any")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config import validate_config
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.envs.task import check_prompts, task_rows
    from posttrain.evaluation.heldout import evaluate
    from posttrain.loop.builders import build_engine, build_task

    path = Path(args.checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    model_dir = path / "actor" if (path / "actor").is_dir() else path
    if not (model_dir / "config.json").is_file():
        raise FileNotFoundError(f"{model_dir}: no config.json (not a checkpoint, actor/ or Hugging Face model directory)")
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    try:
        kwargs = json.loads(args.task_kwargs)
    except json.JSONDecodeError as e:
        raise ValueError(f"--task-kwargs is not JSON: {e}") from None
    if args.env is not None:
        return _eval_episodes(args, path, tok, model, kwargs)
    if args.no_tools:
        raise ValueError("--no-tools is an --env option (single-turn tasks have no tools)")
    cfg = validate_config({"task": {"name": args.task, "kwargs": kwargs}}, "posttrain eval")
    task = build_task(cfg)
    examples = task.examples("heldout", args.n, seed=args.seed)
    renderer = PromptRenderer(tok, chat=args.chat_template == "true", system_prompt=args.system_prompt)
    check_prompts(task_rows(task) or examples, tok, max_context=getattr(model.config, "max_position_embeddings", None),
                  max_new_tokens=args.max_new_tokens, renderer=renderer)
    res = evaluate(build_engine(model, tok), tok, task, examples, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, seed=args.seed, renderer=renderer)
    print(json.dumps({"checkpoint": str(path), "task": args.task, **res.as_metrics(), "n": res.n}, indent=2))
    return 0


def _eval_episodes(args: argparse.Namespace, path: Path, tok: Any, model: Any, kwargs: dict[str, Any]) -> int:
    """``--env``: one episode per held-out start, greedy unless ``--temperature``."""
    import types

    from posttrain.config import validate_config
    from posttrain.loop.builders import build_engine, build_task
    from posttrain.loop.episode_rollout import EpisodeRollout, evaluate_episodes
    from posttrain.loop.rollout_stage import RolloutStage

    env: dict[str, Any] = {"name": args.env, "kwargs": kwargs, "max_turns": args.max_turns,
                           "max_tokens": args.max_episode_tokens}
    source = "command line"
    run_cfg = _run_config(path)
    if run_cfg is not None and run_cfg.get("env", {}).get("name") == args.env:
        # The run's own episode settings (tool prompt, stop strings, limits, system message), so the
        # episodes are rendered as the policy was trained; explicit --task-kwargs still win.
        env = {**run_cfg["env"], **({"kwargs": kwargs} if kwargs else {})}
        source = str(path.parent.parent / "config.yaml")
    cfg = validate_config({"env": env, "sampling": {"max_new_tokens": args.max_new_tokens}, "seed": args.seed},
                          f"posttrain eval (env settings from {source})")
    task = build_task(cfg)
    if args.no_tools:
        try:
            task.make_env(use_tools=False)
        except TypeError:
            raise ValueError(f"--no-tools: environment {args.env!r} has no use_tools switch") from None
    examples = task.examples("heldout", args.n, seed=args.seed)
    run = types.SimpleNamespace(cfg=cfg, engine=build_engine(model, tok), tokenizer=tok, task=task, plain_model=model,
                                next_prompts=lambda n: examples[:n])
    rollout = EpisodeRollout(cfg, run, RolloutStage.from_config(cfg, run))
    res = evaluate_episodes(rollout, examples, temperature=args.temperature,
                            env_overrides={"use_tools": False} if args.no_tools else None)
    print(json.dumps({"checkpoint": str(path), "env": args.env, "tools": not args.no_tools,
                      "env_settings_from": source, **res.as_metrics(), "n": res.n}, indent=2))
    return 0


def _run_config(checkpoint: Path) -> dict[str, Any] | None:
    """The ``config.yaml`` of the run holding ``checkpoint`` (``RUN/checkpoints/step_N``), else None."""
    from posttrain.loop.run_dir import read_config_yaml

    if checkpoint.parent.name != "checkpoints":
        return None
    return read_config_yaml(checkpoint.parent.parent / "config.yaml")
