"""Token id -> display text for the viewer, from the run's own tokenizer files when there are any."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

Decoder = Callable[[int], str]


def _checkpoint_tokenizer(run_dir: Path) -> Path | None:
    # Every checkpoint saves the actor's tokenizer; any of them will do (the tokenizer is fixed).
    found = sorted(run_dir.glob("checkpoints/*/actor/tokenizer.json"))
    return found[-1] if found else None


def _model_path(run_dir: Path) -> str | None:
    cfg = run_dir / "config.yaml"
    if not cfg.is_file():
        return None
    import yaml

    data = yaml.safe_load(cfg.read_text()) or {}
    return (data.get("model") or {}).get("path")


def load_decoder(run_dir: str | Path) -> tuple[Decoder, str]:
    """A per-token decoder and a line saying where it came from.

    Order: a checkpoint's ``tokenizer.json``; a local model directory's ``tokenizer.json`` named in
    ``config.yaml``; the built-in character tokenizer for ``builtin:tiny*`` models; otherwise token
    ids shown as ``<id>``.
    """
    run = Path(run_dir)
    path = _checkpoint_tokenizer(run)
    model = _model_path(run)
    if path is None and model and not model.startswith("builtin:") and (Path(model) / "tokenizer.json").is_file():
        path = Path(model) / "tokenizer.json"
    if path is not None:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
        return (lambda i: str(tok.decode([i], skip_special_tokens=False))), f"tokenizer {path}"
    if model and model.startswith("builtin:tiny"):
        from posttrain.models.tokenizer import build_char_tokenizer

        ctok = build_char_tokenizer()
        return (lambda i: str(ctok.decode([i]))), "built-in character tokenizer"
    return (lambda i: f"<{i}>"), "no tokenizer found: token ids shown"
