"""``posttrain eval CHECKPOINT --task NAME``: held-out accuracy of a saved policy."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def register(sub: Any) -> None:
    p = sub.add_parser("eval", help="evaluate a checkpoint (or HF model dir) on a task's held-out split")
    p.add_argument("checkpoint", help="a checkpoint dir (runs/NAME/checkpoints/step_N), its actor/ dir, or a HF model dir")
    p.add_argument("--task", required=True, help="task name (e.g. arithmetic) or module:factory")
    p.add_argument("--task-kwargs", default="{}", help='JSON kwargs of the task, e.g. \'{"digits": 2}\'')
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

    from posttrain.config import RunConfig
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
    cfg = RunConfig.model_validate({"task": {"name": args.task, "kwargs": kwargs}})
    task = build_task(cfg)
    examples = task.examples("heldout", args.n, seed=args.seed)
    renderer = PromptRenderer(tok, chat=args.chat_template == "true", system_prompt=args.system_prompt)
    check_prompts(task_rows(task) or examples, tok, max_context=getattr(model.config, "max_position_embeddings", None),
                  max_new_tokens=args.max_new_tokens, renderer=renderer)
    res = evaluate(build_engine(model, tok), tok, task, examples, max_new_tokens=args.max_new_tokens,
                   temperature=args.temperature, seed=args.seed, renderer=renderer)
    print(json.dumps({"checkpoint": str(path), "task": args.task, **res.as_metrics(), "n": res.n}, indent=2))
    return 0
