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


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("started_with_sigint_ignored", [False, True])
def test_serve_command_answers_and_stops(tmp_path: Path, started_with_sigint_ignored: bool) -> None:
    """Also when started as a background job of a script (SIGINT ignored at exec: Python then installs no
    KeyboardInterrupt handler of its own; the command installs one)."""
    err_log = (tmp_path / "stderr.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "posttrain.cli", "serve", "--tinker", "--port", "0",
                             "--state-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=err_log,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                            preexec_fn=_ignore_sigint if started_with_sigint_ignored else None)
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
        assert proc.wait(timeout=30) == 0, (tmp_path / "stderr.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        err_log.close()
