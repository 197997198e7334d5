"""Feedback axis: the task (``task``) or multi-turn environment (``env``), and how verdict
components become the scalar reward (``reward``).

Names resolve against the registries (``posttrain.envs``, ``posttrain.rewards``) and user
functions are imported in :func:`posttrain.loop.validate.validate_run`, not here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.section import Section


class TaskConfig(Section):
    """Feedback axis: the task (prompt source + verifier)."""

    name: str = Field(default="arithmetic", description="a name in posttrain.envs TASKS, or 'module.path:factory'")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the task factory")
    chat_template: bool | Literal["auto"] = Field(
        default="auto", description="render single-turn prompts with the tokenizer's chat template: true | false | auto "
        "(auto = when the tokenizer has one and the model is not a posttrain char-tokenizer model; "
        "posttrain/envs/prompt_render.py)")
    system_prompt: str | None = Field(default=None, description="system message put before every prompt (a first line in "
                                      "raw-text mode)")


class EnvConfig(Section):
    """Multi-turn episodes (docs/tasks_and_verifiers.md, "Write your own tool environment"): with ``name``
    set the run trains on episodes of that environment instead of single-turn ``task`` prompts."""

    name: str | None = Field(default=None, description="a name in posttrain.envs.episodes ENVS (calculator_tool, "
                             "python_tool, calculator_tags, python_tags) or 'package.module:factory'; None = "
                             "single-turn task")
    kwargs: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the environment factory")
    max_turns: int = Field(default=4, ge=1, description="policy turns per episode; more ends it as truncated")
    max_tokens: int = Field(default=256, ge=2, description="tokens of the whole episode (prompt + actions + observations); "
                            "reaching it ends the episode as truncated. Each turn also has sampling.max_new_tokens")
    max_wall_s: float | None = Field(default=60.0, gt=0, description="wall seconds per episode; past it the episode ends "
                                     "as truncated at its next turn (None = no limit)")
    tool_prompt: Literal["auto", "template", "preamble", "none"] = Field(
        default="auto", description="how the tool schemas reach the model: the chat template's tools= (template), a "
        "plain-text preamble (preamble), auto = template if the chat template mentions tools else preamble, none")
    system: str | None = Field(default=None, description="system message of every episode")
    use_chat_template: bool = Field(default=True, description="render turns with the tokenizer's chat template")
    stop_strings: list[str] = Field(default_factory=list, description="end a policy turn at these strings (e.g. "
                                    "'</tool_call>', '</answer>')")
    heldout_fraction: float = Field(default=0.2, gt=0, lt=1, description="problems (by first observation) held out")
    eval_without_tools: bool = Field(default=False, description="also evaluate the same held-out episodes with tools "
                                     "disabled (heldout_notool/*): success without the tool beside it")


class RewardFunctionConfig(Section):
    """A user reward function by dotted path (signature and contract: posttrain/rewards/plugins.py)."""

    path: str = Field(description="'package.module:function', called as fn(response, reference, *, prompt, meta) "
                      "-> float | Verdict (sync or async)")
    weight: float = Field(default=1.0, description="weight of its component in the total (entered into reward.weights)")
    name: str | None = Field(default=None, description="component name (default: the function's name)")

    @model_validator(mode="after")
    def _default_name(self) -> RewardFunctionConfig:
        # The function is imported and its signature checked by posttrain.loop.validate.validate_run.
        if self.name is None:
            self.name = self.path.rpartition(":")[2].rpartition(".")[2]
        return self


class RewardConfig(Section):
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
        default="none", description="read the final answer from a free-form response before the task's verifier judges it; "
        "nothing readable -> invalid (posttrain/rewards/extract.py)")
    overlong_max_len: int | None = Field(default=None, ge=1, description="DAPO soft overlong punishment L_max (None = off)")
    overlong_cache_len: int = Field(default=0, ge=0, description="DAPO overlong cache window L_cache")
    workers: int = Field(default=0, ge=0, description="verifier worker processes (0 = verify in-process)")
    timeout_s: float = Field(default=10.0, gt=0, description="per-verification time limit")
    retries: int = Field(default=1, ge=0, description="retries of a verification that hit an infra error")
