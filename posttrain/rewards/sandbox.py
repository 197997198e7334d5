"""Moved to :mod:`posttrain.sandbox` (issue 23); this re-export goes once the callers outside
rewards/ (``posttrain/envs/tools.py``, ``posttrain/envs/tool_calling.py``, ``posttrain/rewards/__init__.py``,
``tests/rewards/conftest.py``, ``tests/envs/test_tool_calling.py``) import ``posttrain.sandbox``."""

from posttrain.sandbox import (
    BWRAP,
    DESCRIPTIONS,
    LEVELS,
    RLIMITS_ONLY,
    UNSHARE,
    SandboxLimits,
    SandboxResult,
    available_levels,
    isolation_level,
    run_python,
)
from posttrain.sandbox.runner import probe as _probe  # noqa: F401  (tests/rewards/conftest.py)

__all__ = ["BWRAP", "DESCRIPTIONS", "LEVELS", "RLIMITS_ONLY", "UNSHARE", "SandboxLimits", "SandboxResult",
           "available_levels", "isolation_level", "run_python"]
