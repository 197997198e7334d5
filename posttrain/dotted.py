"""The one loader of ``'package.module:attr'`` plug-in paths (standard library only).

Every place a recipe, a command or a file names an object by dotted path (a user's advantage
estimator, reward function, task or environment factory, an engine factory, a saved model's
class) resolves it through :func:`import_dotted`, so the shape, the failures and their one-line
messages are the same everywhere.
"""

from __future__ import annotations

import importlib
from typing import Any


def import_dotted(spec: str, *, what: str, shape: str = "package.module:function") -> Any:
    """The object at ``'package.module:attr[.attr]'``, imported now.

    ``what`` names where the path came from (a config key such as ``credit.estimator``, a flag such as
    ``--factory``) and starts every message; ``shape`` is the example form a malformed path is told to
    follow. Raises ``ValueError`` (one line, naming ``what`` and ``spec``) when the path is malformed,
    the module cannot be imported (any import-time error of a user module) or lacks the attribute.
    """
    mod, sep, attr = spec.partition(":")
    if not sep or not mod or not attr:
        raise ValueError(f"{what}: {spec!r} must look like {shape!r}")
    try:
        obj: Any = importlib.import_module(mod)
    except Exception as e:  # noqa: BLE001 - any import-time failure of a user module is a config error
        raise ValueError(f"{what}: cannot import module {mod!r} of {spec!r}: {type(e).__name__}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what}: module {mod!r} has no attribute {attr!r} (from {spec!r})")
        obj = getattr(obj, part)
    return obj
