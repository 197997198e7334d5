"""A builtin char model's checkpoint reloads the tokenizer the run used (posttrain/models/tokenizer.py).

``AutoTokenizer.from_pretrained`` of a checkpoint's ``actor/`` (a Qwen2 ``config.json`` beside the
tokenizer) comes back as ``Qwen2Tokenizer``, which drops the spaces of the char vocabulary; a run or an
eval from that folder must see the ids the run saw."""

import pytest
import torch

from posttrain.learner.checkpoint import save_checkpoint
from posttrain.loop.builders import load_model, load_tokenizer
from posttrain.models import build_char_tokenizer, build_tiny_model
from posttrain.models.tokenizer import CharTokenizer, load_pretrained_tokenizer

TEXT = "Compute 12 + 7:  two spaces, a tab\tand <eos> a special token"


@pytest.fixture
def actor_dir(tmp_path):
    tok = build_char_tokenizer()
    path = save_checkpoint(tmp_path / "step_1", step=1, actor=build_tiny_model("micro", vocab_size=len(tok)),
                           tokenizer=tok, learner_state={})
    return path / "actor"


def test_checkpoint_tokenizer_encodes_spaces_as_the_run_did(actor_dir):
    run = build_char_tokenizer()
    tok, model = load_model(str(actor_dir), "float32", init_seed=0)
    assert isinstance(model, torch.nn.Module)
    for reloaded in (tok, load_tokenizer(str(actor_dir)), load_pretrained_tokenizer(actor_dir)):
        assert isinstance(reloaded, CharTokenizer)
        assert reloaded.encode(TEXT) == run.encode(TEXT)
        assert run.encode(" ")[0] in reloaded.encode(TEXT)  # the space id: 102 in the char vocabulary
        assert (reloaded.pad_token_id, reloaded.eos_token_id, reloaded.padding_side) == (0, 1, "left")
        messages = [{"role": "user", "content": "a b"}]
        assert (reloaded.apply_chat_template(messages, add_generation_prompt=True)
                == run.apply_chat_template(messages, add_generation_prompt=True))


def test_reloaded_char_tokenizer_still_refuses_unencodable_text(actor_dir):
    with pytest.raises(ValueError, match="U\\+00E9"):
        load_pretrained_tokenizer(actor_dir).encode("café")


def test_preflight_and_reward_model_read_a_char_folder_as_the_run_saved_it(actor_dir, tmp_path):
    """The preflight's tokenizer of ``model.path=<ckpt>/actor`` and a reward model's tokenizer (a char
    reward-model folder) keep the spaces: both loaded through ``AutoTokenizer`` before."""
    from transformers import Qwen2Config, Qwen2ForSequenceClassification

    from posttrain.loop.preflight import _tokenizer_and_context
    from posttrain.loop.validate import load_run_config
    from posttrain.rewards.reward_model import RewardModelScorer

    run = build_char_tokenizer()
    got = _tokenizer_and_context(load_run_config("grpo", [f"model.path={actor_dir}"]))
    assert got is not None and got[0].encode(TEXT) == run.encode(TEXT)
    rm_dir = tmp_path / "rm"
    config = Qwen2Config(vocab_size=len(run), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, num_labels=1, pad_token_id=0)
    Qwen2ForSequenceClassification(config).save_pretrained(rm_dir)
    run.save_pretrained(rm_dir)
    scorer = RewardModelScorer.from_pretrained(rm_dir)
    assert scorer.tokenizer.encode(TEXT) == run.encode(TEXT)
