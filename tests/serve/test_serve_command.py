"""``posttrain serve --tinker`` starts, answers on 127.0.0.1, and stops on SIGINT with exit code 0."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("tinker", reason="needs the extra posttrain[tinker]")


@pytest.mark.timeout(120)
def test_serve_command_answers_and_stops(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--tinker", "--port", "0",
                             "--state-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+)", line)
        assert m, line
        with urllib.request.urlopen(f"{m.group(1)}/api/v1/healthz", timeout=10) as r:
            assert json.loads(r.read()) == {"status": "ok"}
        req = urllib.request.Request(f"{m.group(1)}/api/v1/create_model", method="POST",
                                     data=json.dumps({"base_model": "other", "session_id": "s", "model_seq_id": 0,
                                                      "lora_config": {"rank": 2}}).encode())
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=10)
        assert err.value.code == 400 and "not served here" in json.loads(err.value.read())["detail"]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
