"""Feedback axis: the task (``task``) or multi-turn environment (``env``), and how verdict
components become the scalar reward (``reward``).

Names resolve against the registries (``posttrain.envs``, ``posttrain.rewards``) and user
functions are imported in :func:`posttrain.loop.validate.validate_run`, not here.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

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


class RewardModelConfig(Section):
    """A learned reward model scoring each response in RL (``reward.model``): its score is a raw component
    beside the verifier's (posttrain/rewards/learned.py; train one with ``posttrain train reward_model``).
    With ``env.name`` it scores each episode beside the environment's reward parts: prompt = the first
    observation, response = the episode after it (posttrain/loop/episode_rollout.py)."""

    path: str = Field(description="a reward-model directory: <run_dir>/reward_model of a trainer=reward_model run, "
                      "or any local Hugging Face *ForSequenceClassification directory (num_labels=1)")
    batch_size: int = Field(default=16, ge=1, description="responses per forward of the reward model")
    name: str = Field(default="rm", min_length=1, description="component name of its score")
    weight: float = Field(default=1.0, description="weight of its component in the total (entered into reward.weights)")


JUDGE_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The hosts an LLM judge may be reached on: this machine only (no response leaves it)."""


def local_url_error(url: str) -> str | None:
    """Why ``url`` is not an http(s) URL on this machine (a loopback address or ``localhost``), or None."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "need an http(s) URL with a host, e.g. http://127.0.0.1:8000"
    host = parts.hostname
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        return (f"host {host!r} is not this machine; an LLM judge is reached on {', '.join(JUDGE_HOSTS)} only "
                "(serve the judge model locally)")
    return None


class JudgeConfig(Section):
    """An LLM judge behind an OpenAI-compatible ``/v1/chat/completions`` endpoint on this machine
    (``reward.judge``): its parsed verdict is a raw component beside the verifier's
    (posttrain/rewards/judge.py). A call that times out, fails or cannot be parsed is retried, then the
    sample is an ``infra_error`` (never a zero reward). With ``env.name`` it judges each episode as
    ``reward.model`` scores it (:class:`RewardModelConfig`)."""

    url: str = Field(description="base URL of the server on 127.0.0.1 / localhost / ::1, e.g. http://127.0.0.1:8000 "
                     "(/v1/chat/completions is appended unless the URL ends with it)")
    model: str = Field(default="judge", min_length=1, description="the 'model' field of each request")
    prompt_template: str = Field(
        default="Question:\n{prompt}\n\nAnswer:\n{response}\n\nIs the answer correct? Reply yes or no.",
        description="the user message sent to the judge; must contain {prompt} and {response}")
    parse: Literal["yes_no", "score"] = Field(
        default="yes_no", description="yes_no: a reply starting with yes -> 1, no -> 0; score: the first match of "
        "score_pattern (its first group) as a number")
    score_pattern: str = Field(default=r"(-?\d+(?:\.\d+)?)", description="regex of the score (parse=score): the "
                               "first match's group 1 (or the whole match) is the component")
    timeout_s: float = Field(default=30.0, gt=0, le=600, description="one deadline per HTTP attempt for the "
                             "connect, send and whole reply; a row takes at most (retries + 1) x timeout_s + "
                             "0.1 s x (2^retries - 1) of backoff")
    retries: int = Field(default=2, ge=0, le=10, description="retries of a call that failed, timed out or was "
                         "unparseable; then infra_error")
    concurrency: int = Field(default=4, ge=1, le=64, description="calls in flight at once")
    max_tokens: int = Field(default=16, ge=1, description="max_tokens of each request")
    name: str = Field(default="judge", min_length=1, description="component name of its verdict")
    weight: float = Field(default=1.0, description="weight of its component in the total (entered into reward.weights)")

    @field_validator("url")
    @classmethod
    def _local_only(cls, url: str) -> str:
        why = local_url_error(url)
        if why is not None:
            raise ValueError(f"reward.judge.url {url!r}: {why}")
        return url

    @field_validator("prompt_template")
    @classmethod
    def _has_fields(cls, template: str) -> str:
        missing = [f for f in ("{prompt}", "{response}") if f not in template]
        if missing:
            raise ValueError(f"reward.judge.prompt_template must contain {' and '.join(missing)}")
        try:
            template.format(prompt="", response="")
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"reward.judge.prompt_template: only {{prompt}} and {{response}} may be fields "
                             f"(write {{{{ and }}}} for braces): {e!r}") from None
        return template

    @field_validator("score_pattern")
    @classmethod
    def _compiles(cls, pattern: str) -> str:
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"reward.judge.score_pattern {pattern!r} is not a regex: {e}") from None
        return pattern


class RewardConfig(Section):
    """Feedback axis: how verdict components become the scalar reward."""

    weights: dict[str, float] = Field(default_factory=lambda: {"task": 1.0}, description="component -> weight")
    functions: list[RewardFunctionConfig] = Field(
        default_factory=list, description="user reward functions by dotted path, each a raw component added to the "
        "task verifier's; its weight is entered into reward.weights (docs/tasks_and_verifiers.md)")
    model: RewardModelConfig | None = Field(
        default=None, description="a learned reward model whose score is a component (default name rm) beside the "
        "verifier's; its weight is entered into reward.weights (docs/tasks_and_verifiers.md, \"Learned rewards\")")
    judge: JudgeConfig | None = Field(
        default=None, description="an LLM judge on 127.0.0.1 whose verdict is a component (default name judge) "
        "beside the verifier's; its weight is entered into reward.weights")

    def learned_components(self) -> dict[str, float]:
        """``{component name: weight}`` of the reward model and the judge (what they add to each verdict)."""
        return {c.name: c.weight for c in (self.model, self.judge) if c is not None}

    @model_validator(mode="after")
    def _merge_function_weights(self) -> RewardConfig:
        added = [(f"reward.functions {f.name!r}", str(f.name), f.weight) for f in self.functions]
        added += [(f"reward.{key} {c.name!r}", c.name, c.weight)
                  for key, c in (("model", self.model), ("judge", self.judge)) if c is not None]
        names = [n for _, n, _ in added]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"reward.functions / reward.model / reward.judge: component name(s) {dup} used twice "
                             "(set name: on each)")
        merged = dict(self.weights)
        for where, name, weight in added:
            if name in merged and merged[name] != weight:
                raise ValueError(f"{where}: weight {weight} conflicts with "
                                 f"reward.weights.{name}={merged[name]} (give it in one place)")
            merged[name] = weight
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
