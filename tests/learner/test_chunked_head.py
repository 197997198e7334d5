"""The chunked LM head (posttrain/learner/chunked_head.py) against the full-logits computation.

Tolerances (tests/_tolerance.py, ``SAFETY * n * eps``): the two sides differ only in how their
reductions are blocked — the logits GEMM (``D`` terms), the log-sum-exp / entropy sums over the
vocabulary (``V`` terms) and, for ``grad_W``, the sum over tokens (``N`` terms, chunk by chunk vs
one GEMM) — so every comparison uses ``shape_rtol(max(D, V, N), dtype)``; through a whole model the
hidden states also carry the float32 attention softmax over ``T`` keys, and ``n`` adds ``T``.
"""

import sys
from pathlib import Path

import pytest
import torch

from posttrain.algos.entropy import entropy_from_logits
from posttrain.learner.chunked_head import chunked_token_logprobs
from posttrain.learner.kept_set import kept_set_mask
from posttrain.learner.logprobs import FullLogits, forward_logprobs, linear_head_of
from posttrain.models import build_tiny_model

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _tolerance import assert_grads_close, assert_scaled_close, shape_rtol  # noqa: E402

N, D, V = 23, 16, 50  # 23 tokens in chunks of 5: four full chunks and a partial one
TRUNCATIONS = [(0, 1.0), (7, 1.0), (0, 0.8), (9, 0.9)]


def _data(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(N, D, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    w = (torch.randn(V, D, generator=g, dtype=torch.float64) * 0.7).to(dtype).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    a = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)  # upstream d loss / d logprob
    b = torch.randn(N, generator=g, dtype=torch.float64).to(dtype)  # upstream d loss / d entropy
    return h, w, t, a, b


def _full(h, w, t, T, k, p):
    """Reference: full [N, V] logits, log_softmax over the kept set, gather; untruncated entropy."""
    z = (h @ w.t()) / T
    if k > 0 or p < 1.0:
        keep = kept_set_mask(z.detach(), top_k=k, top_p=p).scatter_(-1, t[:, None], True)
        lp_all = torch.log_softmax(z.masked_fill(~keep, float("-inf")), dim=-1)
    else:
        lp_all = torch.log_softmax(z, dim=-1)
    return lp_all.gather(-1, t[:, None]).squeeze(-1), entropy_from_logits(z)


def _grads(loss, *xs):
    return dict(zip(("h", "w"), torch.autograd.grad(loss, xs), strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1.0, 0.7])
@pytest.mark.parametrize(("k", "p"), TRUNCATIONS)
def test_values_and_gradients_match_full_logits(dtype, T, k, p):
    h, w, t, a, b = _data(dtype)
    lp, ent = chunked_token_logprobs(h, w, t, temperature=T, top_k=k, top_p=p, with_entropy=True, chunk_tokens=5)
    ref_lp, ref_ent = _full(h, w, t, T, k, p)
    rtol = shape_rtol(max(N, D, V), dtype)
    assert lp.dtype == ent.dtype == dtype
    assert_scaled_close(lp, ref_lp, rtol, "logprob")
    assert_scaled_close(ent, ref_ent, rtol, "entropy")
    g = _grads((a * lp).sum() + (b * ent).sum(), h, w)
    ref = _grads((a * ref_lp).sum() + (b * ref_ent).sum(), h, w)
    assert_grads_close(g, ref, rtol, "grad")
    # each gradient on its own too (one of them must not hide behind the other's scale)
    assert_scaled_close(g["h"], ref["h"], rtol, "grad_h")
    assert_scaled_close(g["w"], ref["w"], rtol, "grad_W")
    if k > 0 or p < 1.0:  # the truncation is real: the kept-set normaliser differs from the full one
        assert float((lp - _full(h, w, t, T, 0, 1.0)[0]).detach().abs().max()) > 1e-3


def test_gradcheck_float64():
    """Finite differences on a small case: log-prob (over a top-k kept set) and entropy together."""
    h, w, t, _, _ = _data(torch.float64)
    h, w, t = h[:6].detach().requires_grad_(), w[:11].detach().requires_grad_(), t[:6] % 11

    def f(h, w):
        lp, ent = chunked_token_logprobs(h, w, t, temperature=0.8, top_k=6, with_entropy=True, chunk_tokens=4)
        return lp, ent

    assert torch.autograd.gradcheck(f, (h, w))


def test_entropy_without_grad_and_logprob_only():
    h, w, t, a, _ = _data(torch.float64)
    lp, ent = chunked_token_logprobs(h, w, t, with_entropy=True, entropy_grad=False, chunk_tokens=5)
    assert lp.requires_grad and not ent.requires_grad
    lp2, none = chunked_token_logprobs(h, w, t, chunk_tokens=7)
    assert none is None
    g, g2 = _grads((a * lp).sum(), h, w), _grads((a * lp2).sum(), h, w)
    assert_grads_close(g, g2, shape_rtol(max(N, D, V), torch.float64), "entropy_grad=False changes nothing")


def test_chunk_size_does_not_change_the_result():
    h, w, t, a, b = _data(torch.float64)
    outs = [chunked_token_logprobs(h, w, t, with_entropy=True, chunk_tokens=c) for c in (1, 5, N, 1000)]
    for lp, ent in outs[1:]:
        assert_scaled_close(lp, outs[0][0], shape_rtol(max(N, D, V), torch.float64))
        assert_scaled_close(ent, outs[0][1], shape_rtol(max(N, D, V), torch.float64))


def test_tolerance_catches_a_wrong_chunk_boundary():
    """A chunk that starts one token late (its first token scored with the previous token's hidden
    state) moves the result far outside the tolerance, for values and for gradients."""
    h, w, t, a, _ = _data(torch.float32)
    lp, _ = chunked_token_logprobs(h, w, t, chunk_tokens=5)
    shifted = torch.cat([h[:5], h[4:-1]])  # the second chunk reads hidden states one position early
    wrong, _ = chunked_token_logprobs(shifted, w, t, chunk_tokens=5)
    rtol = shape_rtol(max(N, D, V), torch.float32)
    with pytest.raises(AssertionError):
        assert_scaled_close(wrong, lp, rtol)
    with pytest.raises(AssertionError):
        assert_grads_close(_grads((a * wrong).sum(), h, w), _grads((a * lp).sum(), h, w), rtol)


def test_autocast_bfloat16_matches_linear_under_autocast():
    """Under CPU autocast the GEMMs run in bfloat16, as ``nn.Linear`` does; the softmax in float32.
    Both sides round each logit once to bfloat16 (blocking may flip that rounding): the log-probs
    agree to a few bfloat16 eps of the largest value."""
    h, w, t, a, _ = _data(torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp, _ = chunked_token_logprobs(h, w, t, chunk_tokens=5)
        z = torch.nn.functional.linear(h, w)
    assert z.dtype == torch.bfloat16 and lp.dtype == torch.float32
    ref = torch.log_softmax(z.float(), dim=-1).gather(-1, t[:, None]).squeeze(-1)
    assert_scaled_close(lp, ref, 4 * torch.finfo(torch.bfloat16).eps, "bf16 logprob")
    g = _grads((a * lp).sum(), h, w)
    assert g["h"].dtype == g["w"].dtype == torch.float32
    ref_g = _grads((a * ref).sum(), h, w)
    assert_grads_close(g, ref_g, 4 * torch.finfo(torch.bfloat16).eps * D, "bf16 grad")


def test_bad_shapes_are_clear_errors():
    h, w, t, _, _ = _data(torch.float32)
    with pytest.raises(ValueError, match="weight"):
        chunked_token_logprobs(h, w[:, :-1], t)
    with pytest.raises(ValueError, match="targets"):
        chunked_token_logprobs(h, w, t[:-1])
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(h, w, t, chunk_tokens=0)


# ---------------------------------------------------------------- through forward_logprobs


def _param_grads(model, loss):
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [p for _, p in named], allow_unused=True)
    return {n: (g if g is not None else torch.zeros_like(p)) for (n, p), g in zip(named, grads, strict=True)}


def _compare_paths(model, b, *, dtype, f=1, T=1.0, k=0, p=1.0, chunk=None, rtol=None):
    """forward_logprobs on the split model (chunked head) vs the same model behind FullLogits.

    Default ``rtol``: the micro model's reductions span at most ``max(T, B*T, V)`` terms."""
    assert linear_head_of(model) is not None and linear_head_of(FullLogits(model)) is None
    ids, am = b.input_ids, b.attention_mask
    g = torch.Generator().manual_seed(3)
    a = torch.randn(ids.shape, generator=g, dtype=torch.float64).to(dtype)
    c = torch.randn(ids.shape, generator=g, dtype=torch.float64).to(dtype)
    kw = dict(first_position=f, temperature=T, top_k=k, top_p=p, with_entropy=True, entropy_chunk_size=chunk)
    lp, ent = forward_logprobs(model, ids, am, **kw)
    ref_lp, ref_ent = forward_logprobs(FullLogits(model), ids, am, **kw)
    assert lp.dtype == ref_lp.dtype and ent.dtype == ref_ent.dtype
    assert ((lp == 0) == (ref_lp == 0)).all() and (lp[:, :f] == 0).all()
    if rtol is None:
        rtol = shape_rtol(max(ids.shape[1], ids.numel(), model.config.vocab_size), dtype)
    assert_scaled_close(lp, ref_lp, rtol, "logprob")
    assert_scaled_close(ent, ref_ent, rtol, "entropy")
    grads = _param_grads(model, (a * lp).sum() + (c * ent).sum())
    ref = _param_grads(model, (a * ref_lp).sum() + (c * ref_ent).sum())
    assert_grads_close(grads, ref, rtol, "param grad")
    return grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("tied", [True, False])
def test_model_path_matches_full_logits_tied_and_untied(make_batch, dtype, tied):
    model = build_tiny_model("micro", seed=0).to(dtype)
    if not tied:  # a head of its own: a copy of the embedding that trains separately
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 1.3)
        model.config.tie_word_embeddings = False
    assert (model.get_output_embeddings().weight is model.get_input_embeddings().weight) is tied
    grads = _compare_paths(model, make_batch(n=6), dtype=dtype, chunk=4)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    assert grads[head].abs().max() > 0 and grads["model.layers.0.self_attn.q_proj.weight"].abs().max() > 0
    if not tied:  # the embedding's gradient comes only through the backbone
        assert grads["model.embed_tokens.weight"].abs().max() > 0


@pytest.mark.parametrize(("T", "k", "p"), [(0.7, 0, 1.0), (1.0, 10, 1.0), (0.8, 20, 0.9)])
def test_model_path_with_temperature_truncation_and_first_position(make_model, make_batch, T, k, p):
    from posttrain.learner.logprobs import first_scored_position

    b = make_batch(n=6)
    f = first_scored_position(b.action_mask)
    assert f > 1
    _compare_paths(make_model(), b, dtype=torch.float64, f=f, T=T, k=k, p=p)


def test_model_path_with_lora(make_batch):
    from posttrain.learner.lora import wrap_lora

    model = wrap_lora(build_tiny_model("micro", seed=0), rank=4, target_modules="all-linear")
    grads = _compare_paths(model, make_batch(n=5), dtype=torch.float32)
    assert grads and all("lora_" in n for n in grads)  # only the adapters train
    assert max(float(g.abs().max()) for g in grads.values()) > 0


def test_models_without_a_plain_head_take_the_full_path(make_model):
    from posttrain.learner.lora import wrap_lora

    model = make_model()
    assert linear_head_of(model) is not None
    assert linear_head_of(FullLogits(model)) is None  # no config: the model's own forward
    lora_head = wrap_lora(build_tiny_model("micro", seed=0), rank=2, target_modules=["lm_head", "q_proj"])
    assert linear_head_of(lora_head) is None  # an adapted head is not a plain weight
    other = build_tiny_model("micro", seed=0)
    other.config.model_type = "gemma2"  # soft-caps its logits: not lm_head(last hidden state)
    assert linear_head_of(other) is None


def test_smollm2_one_sequence_matches_full_logits():
    """SmolLM2-135M (V = 49,152, tied head), one 24-token sequence, float32: values and the
    gradients of the head (embedding) and of an upstream projection."""
    import posttrain.models.smollm2 as sm

    folder = sm.converted_dir()
    if not sm.is_converted(folder):
        pytest.skip(f"SmolLM2 not converted in {folder} (posttrain convert runs once, offline)")
    _, model = sm.load_smollm2("smollm2-135m-instruct")
    model.eval()
    for n, prm in model.named_parameters():
        prm.requires_grad_(n in ("model.embed_tokens.weight", "model.layers.3.self_attn.v_proj.weight"))
    ids = torch.randint(3, 49_152, (1, 24), generator=torch.Generator().manual_seed(0))

    class _B:
        input_ids, attention_mask = ids, torch.ones_like(ids)

    # The logits GEMM over D = 576 terms bounds the difference; the vocabulary sums are blocked
    # (pairwise) reductions whose error grows like log V, not V. Measured: log-probs 5e-7, entropies
    # 5e-5 (the full path's: it is 6x further from a float64 run than the chunked one), gradients 2e-5.
    rtol = shape_rtol(model.config.hidden_size)
    grads = _compare_paths(model, _B, dtype=torch.float32, f=5, T=0.7, k=50, p=0.95, rtol=rtol)
    assert set(grads) == {"model.embed_tokens.weight", "model.layers.3.self_attn.v_proj.weight"}


# ---------------------------------------------------------------- through plain_logprobs (SFT, the Tinker losses)


def _plain_reference(model, ids, am, targets):
    """Full ``[B, T, V]`` logits of the model's own forward; 0 at column 0 and on padding."""
    logits = model(input_ids=ids, attention_mask=am).logits[:, :-1]
    lp = torch.log_softmax(logits, -1).gather(-1, targets[:, 1:, None]).squeeze(-1) * am[:, 1:].to(logits.dtype)
    return torch.cat([lp.new_zeros(lp.shape[0], 1), lp], dim=1)


@pytest.mark.parametrize("head", ["plain", "lora", "lora_inactive"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_plain_logprobs_runs_the_chunked_head(make_batch, monkeypatch, head, dtype):
    """plain_logprobs never forms ``[tokens x V]`` logits (the LM head module never runs) and gives the full
    logits' log-probs and parameter gradients, for a plain head, a LoRA-adapted one (folded), and one whose
    adapter is not the active one; ``targets`` other than the shifted input are scored."""
    import posttrain.learner.primitives as primitives
    from posttrain.learner.lora import wrap_lora

    model = build_tiny_model("micro", seed=0).to(dtype)
    if head != "plain":
        model = wrap_lora(model, rank=2, target_modules=["lm_head", "q_proj"])
        for n, prm in model.named_parameters():  # B != 0: the adapter changes the head
            if "lora_B" in n:
                torch.nn.init.normal_(prm, std=0.3, generator=torch.Generator().manual_seed(1))
        if head == "lora_inactive":
            model.add_adapter("other", model.peft_config["default"])
            model.set_adapter("other")
    b = make_batch(n=5)
    ids, am = b.input_ids, b.attention_mask
    g = torch.Generator().manual_seed(4)
    targets = torch.randint(0, model.config.vocab_size, ids.shape, generator=g)
    a = torch.randn(ids.shape, generator=g, dtype=torch.float64).to(dtype) * am
    calls = {"chunked": 0, "lm_head": 0}

    def spy(*args, **kw):
        calls["chunked"] += 1
        return chunked_token_logprobs(*args, **kw)

    monkeypatch.setattr(primitives, "chunked_token_logprobs", spy)
    base = model.get_base_model() if head != "plain" else model
    hook = base.get_output_embeddings().register_forward_hook(lambda *_: calls.__setitem__("lm_head", 1))
    try:
        lp = primitives.plain_logprobs(model, ids, am, targets=targets, chunk_tokens=3)
    finally:
        hook.remove()
    assert calls == {"chunked": 1, "lm_head": 0}
    ref = _plain_reference(model, ids, am, targets)
    assert lp.dtype == dtype and lp.shape == ids.shape
    assert ((lp == 0) == (ref == 0)).all()  # column 0 and padding
    rtol = shape_rtol(max(ids.shape[1], ids.numel(), model.config.vocab_size), dtype)
    assert_scaled_close(lp, ref, rtol, "plain log-probs")
    grads, ref_grads = _param_grads(model, (a * lp).sum()), _param_grads(model, (a * ref).sum())
    assert_grads_close(grads, ref_grads, rtol, "param grad")
    if head == "lora":
        assert max(float(v.abs().max()) for k, v in grads.items() if "lm_head.lora_A" in k) > 0


def test_plain_logprobs_without_a_plain_head_or_unchunked_runs_the_model(make_batch):
    """A model whose logits are not ``lm_head(last hidden)``, or ``chunked=False`` (the SFT warm-up's spec),
    keeps the full-logits path exactly (the model's own forward, bit for bit); the split path gives the same
    values within tolerance, the default ``targets`` being the input itself."""
    from posttrain.learner.primitives import plain_logprobs

    model = build_tiny_model("micro", seed=0)
    b = make_batch(n=4)
    ids, am = b.input_ids, b.attention_mask
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=am).logits[:, :-1]
        own = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        full = plain_logprobs(FullLogits(model), ids, am)
        assert torch.equal(full[:, 1:], own) and torch.equal(plain_logprobs(model, ids, am, chunked=False), full)
        split = plain_logprobs(model, ids, am)
    assert_scaled_close(split, full * am, shape_rtol(max(ids.numel(), model.config.vocab_size)), "split vs full")
