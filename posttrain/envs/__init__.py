"""Tasks and environments: single-turn prompt sources + verifiers, multi-turn tool environments.

Importing this package registers the built-in tasks in :data:`TASKS`: ``arithmetic``,
``countdown``, ``linear``, ``chain_sum`` (the demo's task), ``letter_run`` (long-tailed response lengths), the file sources ``jsonl`` / ``parquet`` / ``hf``, and
``reasoning_gym`` (optional extra), ``word_problems`` (English one-step problems for a chat model) and
``instruction_following`` (write about a topic under constraints a program checks).
"""

from posttrain.envs import (  # noqa: F401 - registrations
    arithmetic,
    chain_sum,
    countdown,
    files,
    instruction_following,
    letter_run,
    linear,
    reasoning_gym,
    word_problems,
)
from posttrain.envs.files import FileTask, file_task
from posttrain.envs.multiturn import Environment, StepResult, TurnRenderer, run_episode
from posttrain.envs.task import SPLITS, TASKS, Task, TaskExample, split_of
from posttrain.envs.tools import CalculatorEnv, PythonToolEnv

__all__ = [
    "SPLITS",
    "TASKS",
    "CalculatorEnv",
    "Environment",
    "FileTask",
    "PythonToolEnv",
    "StepResult",
    "Task",
    "TaskExample",
    "TurnRenderer",
    "file_task",
    "run_episode",
    "split_of",
]
