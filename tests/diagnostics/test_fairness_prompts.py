"""posttrain compare: runs whose prompts were rendered differently (chat template vs raw) do not compare unforced."""

from __future__ import annotations

from pathlib import Path

from posttrain.diagnostics.fairness import blocking_differences, identity
from tests.diagnostics.synthetic import step1, write_run


def test_prompt_rendering_is_part_of_the_tokenizer_template_identity(tmp_path: Path) -> None:
    raw = write_run(tmp_path / "raw")  # no prompt record: a run from before chat templating (raw text)
    chat_trajs = [t.replace(meta={**t.meta, "prompt_format": "chat", "chat_template": "sha256:abc"})
                  for t in step1()]
    chat = write_run(tmp_path / "chat", trajectories={1: chat_trajs})
    ir, ic = identity(raw), identity(chat)
    assert ir["tokenizer/template"].endswith("; prompts raw/none")
    assert ic["tokenizer/template"].endswith("; prompts chat/sha256:abc")
    lines = blocking_differences({"raw": [ir], "chat": [ic]})
    assert [line.split(" differs")[0] for line in lines] == ["tokenizer/template"]
