"""The vLLM environment the tests drive (``make vllm-env``), and the one switch that leaves it out.

vLLM tests are present whenever they can run: without the environment they FAIL with the command
that builds it, unless ``POSTTRAIN_TEST_VLLM=0`` explicitly leaves them out (then they are absent
from the parametrisation, not skipped). ``POSTTRAIN_VLLM_PYTHON`` points at another interpreter.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
OPT_OUT = "POSTTRAIN_TEST_VLLM"


def vllm_wanted() -> bool:
    """False only when the user opted out explicitly (``POSTTRAIN_TEST_VLLM=0``)."""
    return os.environ.get(OPT_OUT, "1") != "0"


def vllm_python() -> Path:
    """The vLLM environment's interpreter; fails the test (not skips) when it is missing."""
    p = Path(os.environ.get("POSTTRAIN_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
    if not p.is_file():
        pytest.fail(f"the vLLM environment is missing ({p}): build it with `make vllm-env` (docs/rollout.md), "
                    f"or set {OPT_OUT}=0 to leave the vLLM tests out explicitly", pytrace=False)
    return p


def spawn_vllm(model: Any, workdir: Path, **engine_kwargs: Any) -> Any:
    """A vLLM engine server (the ``rollout.engine=vllm`` path) on ``model``, saved under ``workdir``."""
    from posttrain.rollout.server_process import SpawnedEngine

    python = vllm_python()
    d = workdir / "model"
    model.save_pretrained(str(d))
    kwargs = {"model": str(d), "dtype": "float32", "seed": 0, **engine_kwargs}
    return SpawnedEngine(python, "posttrain.rollout.vllm_engine:build_vllm_engine", kwargs,
                         log_path=workdir / "server.log", startup_timeout_s=600)
