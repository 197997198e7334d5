"""Issue 22 / deliverable 4: a checkpoint write that fails (disk full) leaves no temp dir and the error is an
``OSError`` naming the file being written (before: ``SafetensorError: ...`` naming nothing, exit code 1)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import safetensors
import torch
import transformers.modeling_utils as hf_modeling

from posttrain.learner import checkpoint as ckpt
from posttrain.models import build_char_tokenizer

# What safetensors raises when the disk fills up under save_file (its Rust std::io::Error, code 28 = ENOSPC).
RUST_ENOSPC = 'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left on device" })'


def _full_disk_safetensors(tensors, filename, metadata=None):
    with open(filename, "wb") as fh:
        fh.write(b"\x00" * 64)  # a half-written weight file
    raise safetensors.SafetensorError(RUST_ENOSPC)


def _save(path, model):
    return ckpt.save_checkpoint(path, step=2, actor=model, tokenizer=build_char_tokenizer(),
                                learner_state={"policy": {"x": torch.zeros(2)}}, extra={"k": 1})


def test_disk_full_in_the_weights_names_the_file_and_leaves_no_temp_dir(tmp_path, monkeypatch, make_model):
    monkeypatch.setattr(hf_modeling, "safe_save_file", _full_disk_safetensors)
    final = tmp_path / "checkpoints" / "step_000002"
    with pytest.raises(OSError) as e:
        _save(final, make_model(dtype=torch.float32))
    assert isinstance(e.value, ckpt.CheckpointWriteError)
    assert e.value.errno == errno.ENOSPC
    assert e.value.filename == str(final / "actor" / "model.safetensors")
    assert str(e.value) == f"cannot write checkpoint file {final / 'actor' / 'model.safetensors'}: " \
                           f"{os.strerror(errno.ENOSPC)}"
    assert list((tmp_path / "checkpoints").iterdir()) == []  # no .step_000002.tmp-<pid>, no step_000002


def test_disk_full_in_learner_state_names_that_file(tmp_path, monkeypatch, make_model):
    real = torch.save

    def save(obj, f, *a, **kw):
        if str(f).endswith("learner_state.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")  # a failed write: no filename
        return real(obj, f, *a, **kw)

    monkeypatch.setattr(ckpt.torch, "save", save)
    final = tmp_path / "checkpoints" / "step_000002"
    with pytest.raises(OSError) as e:
        _save(final, make_model(dtype=torch.float32))
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(final / "learner_state.pt")
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_a_bug_is_not_turned_into_a_write_error(tmp_path, make_model):
    def state(_dir):
        raise KeyError("not a write failure")

    final = tmp_path / "checkpoints" / "step_000002"
    with pytest.raises(KeyError):
        ckpt.save_checkpoint(final, step=2, actor=make_model(dtype=torch.float32), learner_state=state)
    assert list((tmp_path / "checkpoints").iterdir()) == []


def test_train_on_a_full_disk_is_one_line_naming_the_checkpoint_file(tmp_path, monkeypatch, capsys):
    from posttrain.cli import main

    monkeypatch.setattr(hf_modeling, "safe_save_file", _full_disk_safetensors)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: r\n")
    run = tmp_path / "run"
    rc = main(["train", str(recipe), "model.path=builtin:micro", "task.name=chain_sum",
               "task.kwargs={terms: 2}", "sampling.prompts_per_step=2",
               "sampling.group_size=2", "sampling.max_new_tokens=3", "eval.size=4", "steps=1", f"run_dir={run}",
               "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert err[-1].startswith(f"posttrain train: error: cannot write "
                              f"{run / 'checkpoints' / 'step_000001' / 'actor' / 'model.safetensors'}: disk full")
    assert "--traceback" not in err[-1]
    assert list((run / "checkpoints").iterdir()) == []


def test_sharded_save_on_a_full_disk_names_the_shard_directory(tmp_path, monkeypatch, make_model):
    """Learner ranks write DCP shards; a full disk comes back inside DCP's CheckpointException (per-rank
    failures, no file name): re-raised as the OSError naming the shard directory (before: the
    CheckpointException, naming nothing)."""
    import traceback

    import torch.distributed.checkpoint.state_dict_saver as saver
    from torch.distributed.checkpoint.api import CheckpointException

    from posttrain.learner.sharded_checkpoint import save_sharded

    def full(state, checkpoint_id):
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"\x00" * 8)
        raise CheckpointException("CheckpointException ranks:dict_keys([0])",
                                  {0: (OSError(errno.ENOSPC, "No space left on device"), traceback.StackSummary())})

    monkeypatch.setattr(saver, "save", full)
    model = make_model(dtype=torch.float32)
    d = tmp_path / "learner_dcp"
    with pytest.raises(OSError) as e:
        save_sharded(model, torch.optim.AdamW(model.parameters()), d, rank=0)
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(d)
    assert "cannot write sharded checkpoint" in str(e.value)
