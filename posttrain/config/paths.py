"""Where a recipe's relative file paths point: the working directory first, then posttrain's install root.

The shipped recipes name their data files under ``posttrain/recipes/data/`` (the dpo and reward_model
pairs, the distill recipe's teacher), paths that exist from a checkout's root; run from any other
directory, or from an installed package, the same relative path is found under the directory that holds
the ``posttrain`` package.
"""

from __future__ import annotations

from pathlib import Path

INSTALL_ROOT = Path(__file__).resolve().parent.parent.parent
"""The directory that holds the ``posttrain`` package (a checkout's root, or site-packages)."""


def resolve_shipped_path(path: str | Path) -> Path:
    """``path`` itself when it exists or is absolute; else the same relative path under :data:`INSTALL_ROOT`
    when that exists; else ``path`` unchanged, so the caller's "no such file" error names what the user gave."""
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    shipped = INSTALL_ROOT / p
    return shipped if shipped.exists() else p


def resolve_model_dir(path: str | Path) -> Path:
    """A model directory as ``posttrain eval`` takes it: a run's checkpoint ``RUN/checkpoints/step_N`` stands
    for its ``actor/`` (the policy's Hugging Face directory); any other path is :func:`resolve_shipped_path`'s."""
    p = resolve_shipped_path(path)
    return p / "actor" if (p / "actor" / "config.json").is_file() else p
