"""What ``reward.model.path`` accepts: posttrain's reward models (their marker file) and Hugging Face
``*ForSequenceClassification`` directories whose weights hold the score head; a causal-LM policy checkpoint
(a run's ``actor/``) is refused in one line naming ``reward.model.path`` and what the directory is.

Before: a policy's ``actor/`` loaded as a sequence classifier with a freshly initialised score head (the
only hint transformers' load report, "score.weight MISSING") and RL trained on its noise.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

from posttrain.config.feedback import RewardConfig
from posttrain.errors import ConfigError, UserError
from posttrain.models import build_char_tokenizer
from posttrain.rewards.learned import build_learned_rewards, check_reward_model
from posttrain.rewards.reward_model import RENDER_FILE, RewardModelScorer, check_reward_model_dir


def _config() -> Qwen2Config:
    tok = build_char_tokenizer()
    return Qwen2Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=tok.pad_token_id)


def _save(model: torch.nn.Module, d: Path, *, marker: bool = False) -> Path:
    model.save_pretrained(d)  # type: ignore[operator]
    build_char_tokenizer().save_pretrained(str(d))
    if marker:
        (d / RENDER_FILE).write_text(json.dumps({"use_chat_template": False, "max_length": 64}))
    return d


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("rm_dirs")
    torch.manual_seed(0)
    rm = Qwen2ForSequenceClassification(_config())
    return {"actor": _save(Qwen2ForCausalLM(_config()), root / "run" / "checkpoints" / "step_1" / "actor"),
            "posttrain": _save(rm, root / "rm_run" / "reward_model", marker=True),
            "third_party": _save(rm, root / "hf_rm")}


def test_a_policy_checkpoint_is_refused_naming_reward_model_path_and_what_it_is(dirs: dict[str, Path]) -> None:
    actor = dirs["actor"]
    want = (rf"reward.model.path {actor}: a causal LM policy checkpoint \(config.json architectures "
            r"\['Qwen2ForCausalLM'\]\), not a reward model .*trainer=reward_model")
    with pytest.raises(UserError, match=want) as e:
        RewardModelScorer.from_pretrained(actor)
    assert "\n" not in str(e.value)
    with pytest.raises(UserError, match=want):
        build_learned_rewards(RewardConfig(model={"path": str(actor)}), lambda items: [])
    # the preflight's check (files only, nothing loaded): a ConfigError, before the run directory is written
    with pytest.raises(ConfigError, match=want):
        check_reward_model(RewardConfig(model={"path": str(actor)}))


def test_posttrain_and_third_party_reward_models_are_accepted(dirs: dict[str, Path]) -> None:
    check_reward_model(RewardConfig())  # no reward.model: nothing to check
    for name in ("posttrain", "third_party"):
        check_reward_model(RewardConfig(model={"path": str(dirs[name])}))
        assert check_reward_model_dir(dirs[name]) == dirs[name]
    own, hf = RewardModelScorer.from_pretrained(dirs["posttrain"]), RewardModelScorer.from_pretrained(dirs["third_party"])
    assert (own.max_length, hf.max_length) == (64, 1024)  # the marker's rendering; defaults without it
    assert own.score(["1+1="], ["2"]) == pytest.approx(hf.score(["1+1="], ["2"]), abs=1e-6)  # the same weights


def test_a_classifier_config_over_weights_without_a_score_head_is_refused(dirs: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """A config that says *ForSequenceClassification over a causal LM's weights passes the file check, but
    loading would initialise the head afresh: refused when loaded, naming the missing weight."""
    d = _save(Qwen2ForCausalLM(_config()), tmp_path / "relabelled")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["Qwen2ForSequenceClassification"]}))
    assert check_reward_model_dir(d) == d
    with pytest.raises(UserError, match=rf"reward.model.path {d}: its weights lack \['score.weight'\]"):
        RewardModelScorer.from_pretrained(d)


def test_a_run_directory_instead_of_its_reward_model_points_to_it(dirs: dict[str, Path]) -> None:
    run = dirs["posttrain"].parent
    with pytest.raises(ConfigError, match=rf"reward.model.path {run}: no such model directory .*did you mean "
                                          rf"{run / 'reward_model'}"):
        check_reward_model(RewardConfig(model={"path": str(run)}))


def test_a_model_directory_of_another_kind_is_refused(dirs: dict[str, Path], tmp_path: Path) -> None:
    d = tmp_path / "encoder"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    with pytest.raises(UserError, match=rf"reward.model.path {d}: not a reward model \(no {RENDER_FILE}, and "
                                        r"config.json architectures \['BertModel'\] name no"):
        check_reward_model_dir(d)


def test_train_refuses_a_policy_as_reward_model_before_the_run_dir_is_written(dirs: dict[str, Path], tmp_path: Path,
                                                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Through the preflight (posttrain/loop/preflight.py calls :func:`check_reward_model`)."""
    from posttrain.cli import main
    from tests._cli_errors import one_error_line
    from tests._micro_run import MICRO_RUN

    run_dir = tmp_path / "run"
    assert main(["train", "grpo", *MICRO_RUN, "steps=1", f"reward.model.path={dirs['actor']}",
                 f"run_dir={run_dir}"]) == 2
    line = one_error_line(capsys)
    assert f"reward.model.path {dirs['actor']}: a causal LM policy checkpoint" in line, line
    assert not run_dir.exists()


def test_the_preflight_refuses_a_policy_as_reward_model_from_its_files(dirs: dict[str, Path]) -> None:
    """Before anything is built or written (posttrain/loop/preflight.py's ``check_reward_model(cfg.reward)``):
    the run would otherwise create its directory and build the policy before the reward model's loading refuses."""
    from posttrain.commands.train import check_before_run
    from posttrain.loop.validate import load_run_config
    from tests._micro_run import MICRO_RUN

    cfg = load_run_config("grpo", [*MICRO_RUN, f"reward.model.path={dirs['actor']}"])
    with pytest.raises(ConfigError, match=rf"reward.model.path {dirs['actor']}: a causal LM policy checkpoint"):
        check_before_run(cfg)
    check_before_run(load_run_config("grpo", [*MICRO_RUN, f"reward.model.path={dirs['posttrain']}"]))


def test_a_reward_model_runs_checkpoint_carries_its_rendering(tmp_path: Path) -> None:
    """A reward_model run's RUN/checkpoints/step_N/actor is a reward model with the run's rendering (it was
    taken for a third-party classifier and scored as plain text); step_N itself points to it."""
    from posttrain.cli import main
    from posttrain.learner.checkpoint import latest_checkpoint

    run = tmp_path / "rm"
    assert main(["train", "reward_model", "steps=2", "checkpoint_every=1", "eval.every=100", "logging.progress=false",
                 f"run_dir={run}"]) == 0
    ck = latest_checkpoint(run)
    assert ck is not None
    marker = json.loads((ck / "actor" / RENDER_FILE).read_text())
    assert marker == json.loads((run / "reward_model" / RENDER_FILE).read_text())
    assert check_reward_model_dir(ck / "actor") == ck / "actor"
    with pytest.raises(UserError, match=rf"did you mean {ck / 'actor'}"):
        check_reward_model_dir(ck)
