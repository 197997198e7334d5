"""Issue 22, deliverable 3: whatever would fail at step 1 for a config reason fails at load.

Each case below used to pass ``--print-recipe``, create the run directory (config.yaml, and
metrics.jsonl from the step-0 evaluation) and fail at the first step or the warm-up. Now
``posttrain train`` refuses it before the run directory exists, in one line naming the key(s):
the preflight (posttrain/loop/preflight.py) dry-builds the task, its verdicts, the reward shaping
and one step's advantages on a fake batch.
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterator

import pytest
import torch

import posttrain.algos as A
from posttrain.cli import main
from posttrain.config import RECIPES_DIR, ConfigError
from posttrain.loop.preflight import fake_batch, preflight
from posttrain.loop.validate import load_run_config
from tests._cli_errors import one_error_line
from tests._required_keys import with_required

TINY = ["model.path=builtin:micro", "task.name=chain_sum", "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
        "sampling.group_size=2", "sampling.max_new_tokens=2", "eval.size=4", "eval.every=100", "optim.lr=0.001",
        "steps=2"]
KL = ["loss.kl_estimator=k1", "loss.kl_coef=0.05"]

PLUGINS = '''
import dataclasses

from posttrain.algos.advantages import AdvantageInputs, AdvantageOutputs


def reads_token_rewards(inputs: AdvantageInputs, scale: float = 1.0) -> AdvantageOutputs:
    """A user estimator adding the per-token rewards, which are None unless the KL is in the reward."""
    adv = inputs.rewards[:, None] * inputs.action_mask + inputs.token_rewards
    return AdvantageOutputs(advantages=scale * adv, returns=None)


class NoAnswerTask:
    """chain_sum's prompts and verifier without the reference answer an SFT warm-up trains on."""

    name = "no_answer"

    def __init__(self):
        from posttrain.envs import TASKS

        self.base = TASKS["chain_sum"](terms=2)
        self.verifier = self.base.verifier

    def examples(self, split, n, seed):
        return [dataclasses.replace(e, meta={}) for e in self.base.examples(split, n, seed)]


BUILT = []


def counted_task(terms=2):
    """chain_sum, counting how often the factory runs."""
    from posttrain.envs import TASKS

    BUILT.append(terms)
    return TASKS["chain_sum"](terms=terms)
'''


@pytest.fixture
def plugins(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    d = tmp_path_factory.mktemp("plugins")
    (d / "_pf_plugins.py").write_text(textwrap.dedent(PLUGINS))
    monkeypatch.syspath_prepend(str(d))
    yield "_pf_plugins"
    for name in [n for n in A.ADVANTAGES if n.startswith("_pf_plugins:")]:  # registration is process-wide
        A.ADVANTAGES.unregister(name)


# (overrides, what the one error line must name); {m} is the plug-in module.
STEP1_FAILURES = {
    # the issue's repro: KL in the reward with GRPO's sequence-level advantages
    "kl_in_reward_grpo": (["credit.kl_in_reward=true", *KL], ["credit.kl_in_reward", "credit.estimator=grpo",
                                                                  "token-level estimator"]),
    "kl_in_reward_remax": (["credit.estimator=remax", "credit.kwargs={}", "credit.kl_in_reward=true", *KL],
                           ["credit.kl_in_reward", "credit.estimator=remax"]),
    # a weighted reward part the task's verdicts do not carry (compose failed at the first scoring)
    "unknown_reward_part": (["reward.weights={task: 1.0, foo: 0.5}"], ["reward.weights.foo", "'format', 'task'"]),
    # DAPO overlong shaping without its cache window (the penalty function refused it at scoring)
    "overlong_without_cache": (["reward.weights={task: 1.0, overlong: 1.0}", "reward.overlong_max_len=4"],
                               ["reward.overlong_max_len=4", "reward.overlong_cache_len=0"]),
    # a plug-in estimator that fails on the inputs the loop gives it (token_rewards is None)
    "plugin_estimator": (["credit.estimator={m}:reads_token_rewards", "credit.kwargs={}"],
                         ["credit.estimator={m}:reads_token_rewards", "NoneType"]),
    # an SFT warm-up on a task without reference answers (failed in the warm-up, after config.yaml)
    "sft_without_answers": (["task.name={m}:NoAnswerTask", "task.kwargs={}", "sft.steps=2", "sft.examples=4",
                             "sft.batch_size=2"], ["sft.steps=2", "meta['answer']"]),
    # more minibatches than a step's rows (2 prompts x 2 samples): the first update's split refused it
    "minibatches_over_rows": (["optim.num_minibatches=5"], ["optim.num_minibatches=5", "at most 4 rows"]),
    # an unknown task (failed while building the run, after the run directory was created)
    "unknown_task": (["task.name=no_such_task"], ["task.name", "unknown task 'no_such_task'"]),
    # a task kwarg of the wrong type (passed straight to the task's dataclass: a string where an int
    # belongs failed at the first draw; a bool given as "no" was truthy and switched the option on)
    "task_kwarg_wrong_type": (["task.kwargs={terms: two}"],
                              ["task.kwargs.terms: Input should be a valid integer", "got 'two'", "takes terms: int"]),
}


def test_the_issue_repro_fails_at_load_with_no_run_dir(tmp_path, capsys):
    """`posttrain train grpo credit.kl_in_reward=true loss.kl_estimator=k1 loss.kl_coef=0.05 steps=2`: it
    passed --print-recipe, wrote config.yaml and metrics.jsonl, then failed at step 1."""
    run_dir = tmp_path / "grpo"
    assert main(["train", "grpo", "credit.kl_in_reward=true", *KL, "steps=2", f"run_dir={run_dir}"]) == 2
    line = one_error_line(capsys)
    assert "credit.estimator=grpo with credit.kl_in_reward=true" in line and "token-level estimator" in line
    assert not run_dir.exists()


@pytest.mark.parametrize("case", sorted(STEP1_FAILURES))
def test_a_step1_config_error_fails_at_load_before_the_run_dir_exists(case, plugins, tmp_path, capsys):
    overrides, names = STEP1_FAILURES[case]
    overrides = [o.replace("{m}", plugins) for o in overrides]
    run_dir = tmp_path / "run"
    recipe = tmp_path / "t.yaml"
    recipe.write_text("name: t\n")  # the defaults (estimator grpo, no warm-up), whatever the shipped recipes hold
    # --print-recipe is a load: it refuses too (it used to print the recipe and exit 0)
    assert main(["train", str(recipe), *TINY, *overrides, f"run_dir={run_dir}", "--print-recipe"]) == 2
    line = one_error_line(capsys)
    for name in names:
        assert name.replace("{m}", plugins) in line, line
    assert main(["train", str(recipe), *TINY, *overrides, f"run_dir={run_dir}", "--no-progress"]) == 2
    assert one_error_line(capsys) == line
    assert not run_dir.exists()  # nothing was written: the same command, fixed, starts cleanly


# Multi-turn: one episode started as the rollout starts it (what used to fail in the warm-up or the
# step-0 evaluation, after config.yaml was written).
EPISODE_FAILURES = {
    "env_max_tokens_without_room": (["env.max_tokens=8"], ["env.max_tokens=8", "no room for a turn"]),
    "sft_without_demonstrations": (["env.name=calculator_tags", "env.kwargs={}", "sft.steps=2",
                                    # calculator_tags has no use_tools switch and no tools for tool_calc's prompt
                                    "env.eval_without_tools=false", "env.tool_prompt=auto"],
                                   ["env.name=calculator_tags", "no demonstration"]),
    # an env kwarg of the wrong type (a quoted "no" was truthy: the tools stayed on)
    "env_kwarg_wrong_type": (['env.kwargs={digits: 3, use_tools: "no"}'],
                             ["env.kwargs.use_tools: Input should be a valid boolean", "got 'no'"]),
}


@pytest.mark.parametrize("case", sorted(EPISODE_FAILURES))
def test_a_multi_turn_config_error_fails_at_load_before_the_run_dir_exists(case, tmp_path, capsys):
    overrides, names = EPISODE_FAILURES[case]
    run_dir = tmp_path / "run"
    base = ["train", "tool_calc", *overrides, "steps=1", "eval.size=4", f"run_dir={run_dir}"]
    assert main([*base, "--print-recipe"]) == 2
    line = one_error_line(capsys)
    assert all(n in line for n in names), line
    assert main([*base, "--no-progress"]) == 2
    assert one_error_line(capsys) == line
    assert not run_dir.exists()


@pytest.mark.parametrize("overrides", [
    [],
    ["credit.estimator=reinforce_pp", "credit.kwargs={}", "credit.kl_in_reward=true", *KL],
    ["credit.estimator=reinforce_pp_baseline", "credit.kwargs={}", "credit.kl_in_reward=true", *KL],
    ["credit.estimator=gae", "credit.kwargs={}", "critic.enabled=true", "credit.kl_in_reward=true", *KL],
    ["credit.estimator=remax", "credit.kwargs={}", *KL],  # KL in the loss: any estimator
    ["credit.estimator=reinforce", "credit.kwargs={}", "sampling.group_size=1"],
    ["reward.weights={task: 1.0, format: 0.5, overlong: 1.0}", "reward.overlong_max_len=2", "reward.overlong_cache_len=1"],
    ["reward.extract=boxed", "sft.steps=2"],
    ["optim.num_minibatches=4"],  # = the rows of a step
], ids=["grpo", "reinforce_pp_kl_reward", "reinforce_pp_baseline_kl_reward", "gae_kl_reward", "remax_kl_loss",
        "reinforce_g1", "format_weight_overlong", "extract_sft", "minibatches_eq_rows"])
def test_valid_recipes_pass_the_preflight(overrides):
    assert preflight(load_run_config(None, [*TINY, *overrides])) is None


@pytest.mark.parametrize("recipe", sorted(p.stem for p in RECIPES_DIR.glob("*.yaml")))
def test_every_shipped_recipe_passes_the_preflight(recipe):
    assert preflight(load_run_config(recipe, with_required(recipe, []))) is None


@pytest.mark.parametrize("overrides", [
    ["credit.estimator=gigpo", "credit.kwargs={}"],  # GiGPO's step records: built in the fake batch
    # tool_calc's no-tool evaluation and tool prompt off: calculator_tags has neither switch nor tools
    ["env.name=calculator_tags", "env.kwargs={}", "sft.steps=0", "env.max_tokens=64", "env.eval_without_tools=false",
     "env.tool_prompt=auto"],
], ids=["gigpo", "tags_no_sft"])
def test_multi_turn_recipes_pass_the_preflight(overrides):
    assert preflight(load_run_config("tool_calc", overrides)) is None


def test_the_error_is_a_config_error_naming_the_keys():
    with pytest.raises(ConfigError, match=r"^credit\.estimator=rloo with credit\.kl_in_reward=true"):
        preflight(load_run_config(None, [*TINY, "credit.estimator=rloo", "credit.kwargs={}", "credit.kl_in_reward=true",
                                       *KL]))


def test_fake_batch_is_two_groups_shaped_like_a_step():
    """group_size 3: rows g0 = 0,1,2 and g1 = 3,4,5; actions 2 + (j % 2) tokens after 2 prompt tokens, so
    [2, 3, 2, 2, 3, 2] and T = 2 + 3 = 5; rewards 1 when (j + g) is even: [1, 0, 1, 0, 1, 0]."""
    b = fake_batch(load_run_config(None, [*TINY, "sampling.group_size=3"]))
    assert tuple(b.action_mask.shape) == (6, 5)
    assert b.action_mask.sum(dim=1).tolist() == [2, 3, 2, 2, 3, 2]
    assert [t.reward.total for t in b.trajectories] == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]
    assert [t.group_id for t in b.trajectories] == ["g0"] * 3 + ["g1"] * 3
    assert [t.finish.value for t in b.trajectories] == ["terminal"] * 5 + ["truncated"]
    assert torch.equal(b.action_mask[:, :2], torch.zeros(6, 2))  # the prompt tokens


def test_the_task_built_by_the_preflight_is_the_runs(plugins):
    """The preflight's task goes to the run's build_task once (a dataset is not loaded twice)."""
    import importlib

    from posttrain.loop.builders import build_task

    built = importlib.import_module(plugins).BUILT
    cfg = load_run_config(None, [*TINY, f"task.name={plugins}:counted_task", "task.kwargs={terms: 2}"])
    preflight(cfg)
    assert built == [2]
    kept = build_task(cfg)
    assert built == [2]  # the run's build took the preflight's task
    assert build_task(cfg) is not kept and built == [2, 2]  # handed over once, then built as before
    other = load_run_config(None, [*TINY, f"task.name={plugins}:counted_task", "task.kwargs={terms: 3}"])
    preflight(cfg)
    build_task(other)
    assert built == [2, 2, 2, 3]  # a kept task serves only an equal task config


# Hyper-parameter kwargs: validated at load against each function's typed model (its signature).
# (overrides, the start of the one error line)
KWARGS_TYPE_ERRORS = {
    "text_for_a_float": (["loss.kwargs.eps_low='0.2'"], "loss.kwargs.eps_low: Input should be a valid number, "
                                                         "got '0.2' (text, not a number"),
    "yaml_text_exponent": (["loss.kwargs.eps_low=1e-3"], "loss.kwargs.eps_low: Input should be a valid number, "
                                                          "got '1e-3' (text, not a number"),
    "list_for_a_float": (["loss.kwargs.eps_low=[1]"], "loss.kwargs.eps_low: Input should be a valid number, got [1]"),
    "number_for_a_bool": (["credit.kwargs.norm_std=1"], "credit.kwargs.norm_std: Input should be a valid boolean, "
                                                         "got 1"),
    "float_for_an_int": (["correction.name=staleness", "correction.kwargs.max_staleness=1.5"],
                         "correction.kwargs.max_staleness: Input should be a valid integer, got 1.5"),
}


@pytest.mark.parametrize("case", sorted(KWARGS_TYPE_ERRORS))
def test_a_kwarg_of_the_wrong_type_fails_at_load_naming_the_key(case, tmp_path, capsys):
    overrides, start = KWARGS_TYPE_ERRORS[case]
    run_dir = tmp_path / "run"
    recipe = tmp_path / "t.yaml"
    recipe.write_text("name: t\n")
    assert main(["train", str(recipe), *TINY, *overrides, f"run_dir={run_dir}", "--no-progress"]) == 2
    line = one_error_line(capsys)
    assert line.startswith(f"posttrain train: error: {recipe}: {start}"), line
    assert not run_dir.exists()


TYPED_PLUGINS = '''
from posttrain.algos.advantages import AdvantageInputs, AdvantageOutputs
from posttrain.algos.policy_losses import PolicyLossInputs, PolicyLossOutputs

SEEN = []


def scaled(inputs: AdvantageInputs, scale: float = 1.0) -> AdvantageOutputs:
    """The reward on every action token, times ``scale``; records what it was given."""
    SEEN.append(("scale", scale))
    return AdvantageOutputs(advantages=scale * inputs.rewards[:, None] * inputs.action_mask, returns=None)


def plain(inputs: PolicyLossInputs, *, weight: float = 1.0) -> PolicyLossOutputs:
    """-weight * ratio * A; records what it was given."""
    SEEN.append(("weight", weight))
    ratio = (inputs.logprob - inputs.old_logprob).exp()
    return PolicyLossOutputs(loss=-weight * ratio * inputs.advantages, diagnostics={})
'''


@pytest.fixture
def typed_plugins(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    d = tmp_path_factory.mktemp("typed_plugins")
    (d / "_typed_plugins.py").write_text(textwrap.dedent(TYPED_PLUGINS))
    monkeypatch.syspath_prepend(str(d))
    yield "_typed_plugins"
    for reg in (A.ADVANTAGES, A.POLICY_LOSSES):  # registration is process-wide
        for name in [n for n in reg if n.startswith("_typed_plugins:")]:
            reg.unregister(name)


def test_the_functions_receive_the_validated_values(typed_plugins):
    """An int given for a float parameter reaches the function as a float: in the config the run
    records, in the load-time probe, in the targets and in the learner."""
    import importlib

    from posttrain.config import dump_config
    from posttrain.learner.actor import PolicyLearner
    from posttrain.loop.targets import build_targets
    from posttrain.models import build_char_tokenizer, build_tiny_model

    seen = importlib.import_module(typed_plugins).SEEN
    est, loss = f"{typed_plugins}:scaled", f"{typed_plugins}:plain"
    cfg = load_run_config(None, [*TINY, f"credit.estimator={est}", "credit.kwargs={scale: 2}",
                                 f"loss.policy_loss={loss}", "loss.kwargs={weight: 3}"])
    assert cfg.credit.kwargs == {"scale": 2.0} and type(cfg.credit.kwargs["scale"]) is float
    assert type(cfg.loss.kwargs["weight"]) is float
    assert "scale: 2.0" in dump_config(cfg) and "weight: 3.0" in dump_config(cfg)  # config.yaml's record
    assert seen and all(type(v) is float for _, v in seen)  # the load-time probe calls
    seen.clear()
    batch = fake_batch(cfg)
    adv = build_targets(batch, estimator=est, estimator_kwargs={"scale": 2}).advantages  # as given, untyped
    assert seen == [("scale", 2.0)] and type(seen[0][1]) is float
    learner = PolicyLearner(build_tiny_model("micro", vocab_size=len(build_char_tokenizer()), seed=0),
                            policy_loss=loss, policy_loss_kwargs={"weight": 3}, lr=0.0)
    assert learner.policy_loss_kwargs == {"weight": 3.0}
    seen.clear()
    learner.compute_gradients(batch, adv.to(torch.float32), old_logprob=learner.compute_logprobs(batch))
    assert seen and all(v == 3.0 and type(v) is float for _, v in seen)
