"""Built-in engine specifics: shared prefill, finished rows leave the batch, greedy == HF generate,
in-place weight updates, batch-independence of the random streams, full log-prob rows."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from posttrain.models import build_tiny_model
from posttrain.rollout.builtin import BuiltinEngine
from posttrain.rollout.runners import HFRunner, StaticCacheRunner
from posttrain.rollout.sampling import SamplingParams
from posttrain.rollout.types import GenerationRequest


def _tiny_llama() -> torch.nn.Module:
    """A micro ``LlamaForCausalLM`` (SmolLM2's family): same sizes as the micro Qwen2 preset."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=106, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True, pad_token_id=0,
        eos_token_id=1, bos_token_id=2, attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def model(request: pytest.FixtureRequest) -> torch.nn.Module:
    """Both decoder families of the static-cache fast path (every test runs on each)."""
    if request.param == "llama":
        return _tiny_llama()
    return build_tiny_model("micro", seed=1, max_position_embeddings=128)


PROMPTS = [[5, 9, 33, 40], [7, 7, 8], [60, 61, 62, 63, 64, 65, 66], [12, 13]]


def test_fast_path_is_taken_for_qwen2_and_llama_and_can_be_disabled(model: torch.nn.Module) -> None:
    assert isinstance(BuiltinEngine(copy.deepcopy(model)).runner, StaticCacheRunner)
    assert isinstance(BuiltinEngine(copy.deepcopy(model), fast_path=False).runner, HFRunner)
    assert BuiltinEngine.reproducible_resume is True


@pytest.mark.parametrize("fast_path", [True, False], ids=["static", "hf-dynamic"])
def test_prompt_prefilled_once_for_n_samples(model: torch.nn.Module, fast_path: bool) -> None:
    eng = BuiltinEngine(copy.deepcopy(model), fast_path=fast_path)
    params = SamplingParams(n=5, max_new_tokens=3, seed=0)
    out = eng.generate([GenerationRequest(f"p{i}", p, params) for i, p in enumerate(PROMPTS[:3])])
    assert len(out) == 15
    assert eng.stats["prefill_rows"] == 3  # not 15
    assert eng.stats["prefill_tokens"] == 4 + 3 + 7
    # the 5 samples share the prompt but not their random streams
    assert len({tuple(c.token_ids) for c in out[:5]}) > 1


@pytest.mark.parametrize("fast_path", [True, False], ids=["static", "hf-dynamic"])
def test_finished_rows_leave_the_batch(model: torch.nn.Module, fast_path: bool) -> None:
    eng = BuiltinEngine(copy.deepcopy(model), eos_token_id=[], fast_path=fast_path)  # no eos: lengths are exact
    budgets = [2, 5, 9]
    reqs = [GenerationRequest(f"b{i}", PROMPTS[i], SamplingParams(max_new_tokens=m, seed=i)) for i, m in enumerate(budgets)]
    out = eng.generate(reqs)
    assert [len(c.token_ids) for c in out] == budgets
    assert all(c.finish_reason == "length" for c in out)
    # a row of budget m is decoded after each of its first m-1 tokens, never after it finished:
    # (2-1) + (5-1) + (9-1) = 13, where keeping finished rows would cost 3 * 8 = 24.
    assert eng.stats["decode_row_steps"] == 13


def test_fast_path_and_generic_runner_sample_the_same_tokens(model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=1.0, top_k=30, max_new_tokens=12, n=2, seed=42)
    reqs = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    a = BuiltinEngine(copy.deepcopy(model), fast_path=True).generate(reqs)
    b = BuiltinEngine(copy.deepcopy(model), fast_path=False).generate(reqs)
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert np.allclose(sum((c.logprobs for c in a), []), sum((c.logprobs for c in b), []), atol=1e-5)


@pytest.mark.parametrize("fast_path", [True, False], ids=["static", "hf-dynamic"])
def test_greedy_matches_transformers_generate(model: torch.nn.Module, fast_path: bool) -> None:
    eng = BuiltinEngine(copy.deepcopy(model), eos_token_id=[], fast_path=fast_path)
    out = eng.generate(
        [GenerationRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=24)) for i, p in enumerate(PROMPTS)]
    )
    for c, p in zip(out, PROMPTS, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = model.generate(
                input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=24,
                min_new_tokens=24, pad_token_id=0,
            )
        assert c.token_ids == ref[0, len(p):].tolist()
        assert c.logprobs == [0.0] * 24


def test_update_weights_in_place(model: torch.nn.Module) -> None:
    eng = BuiltinEngine(copy.deepcopy(model))
    ptrs = {n: p.data_ptr() for n, p in eng.model.named_parameters()}
    new = {n: torch.full_like(p, 0.01) for n, p in model.named_parameters()}
    eng.update_weights(new)
    assert eng.version == 1
    assert {n: p.data_ptr() for n, p in eng.model.named_parameters()} == ptrs
    assert all(bool((p == 0.01).all()) for p in eng.model.parameters())
    # the tied lm_head follows the embedding (same storage)
    assert eng.model.lm_head.weight.data_ptr() == eng.model.model.embed_tokens.weight.data_ptr()
    with pytest.raises(ValueError, match="unknown tensor 'nope'"):
        eng.update_weights({"nope": torch.zeros(1)})
    name = next(iter(new))
    with pytest.raises(ValueError, match="shape"):
        eng.update_weights({name: torch.zeros(3, 3, 3)})
    assert eng.version == 1  # failed updates change nothing


def test_random_stream_does_not_depend_on_batch_company(model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=10, n=3, seed=77)
    alone = BuiltinEngine(copy.deepcopy(model)).generate([GenerationRequest("x", PROMPTS[0], params)])
    crowd = BuiltinEngine(copy.deepcopy(model), max_batch_size=2).generate(
        [GenerationRequest(f"o{i}", p, SamplingParams(max_new_tokens=4, seed=i)) for i, p in enumerate(PROMPTS[1:])]
        + [GenerationRequest("x", PROMPTS[0], params)]
    )
    assert [c.token_ids for c in alone] == [c.token_ids for c in crowd if c.request_id == "x"]


def test_full_logprobs_rows_are_renormalised_kept_set(model: torch.nn.Module) -> None:
    params = SamplingParams(temperature=0.8, top_k=6, max_new_tokens=6, seed=3, return_full_logprobs=True)
    (c,) = BuiltinEngine(copy.deepcopy(model)).generate([GenerationRequest("f", PROMPTS[2], params)])
    full = c.full_logprobs
    assert full is not None and full.shape == (6, 106) and full.dtype == torch.float64
    ids = torch.tensor([PROMPTS[2] + c.token_ids])
    with torch.no_grad():
        z = model(input_ids=ids).logits[0, len(PROMPTS[2]) - 1 : -1].double() / 0.8
    for i in range(6):
        kept = torch.isfinite(full[i])
        assert int(kept.sum()) == 6
        assert set(torch.topk(z[i], 6).indices.tolist()) == set(kept.nonzero().flatten().tolist())
        assert float(torch.logsumexp(full[i][kept], 0)) == pytest.approx(0.0, abs=1e-12)
        # inside the kept set, log mu differs from the tempered logits by one constant (the renormaliser)
        d = (full[i][kept] - z[i][kept]).numpy()
        assert np.ptp(d) < 1e-5
        assert c.logprobs[i] == full[i, c.token_ids[i]]


def test_unseeded_request_records_its_drawn_seed(model: torch.nn.Module) -> None:
    eng = BuiltinEngine(copy.deepcopy(model))
    torch.manual_seed(0)
    (a,) = eng.generate([GenerationRequest("u", PROMPTS[0], SamplingParams(max_new_tokens=8))])
    assert a.seed is not None
    (b,) = eng.generate([GenerationRequest("u", PROMPTS[0], SamplingParams(max_new_tokens=8, seed=a.seed))])
    assert a.token_ids == b.token_ids
