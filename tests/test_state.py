"""Training state: RNG capture/restore, atomic checkpoint folders, latest pointer, rotation, exact resume."""

from __future__ import annotations

import random
from unittest import mock

import numpy as np
import pytest
import torch

from dflashkit.atomic import atomic_dir
from dflashkit.errors import CheckpointError, DflashkitError
from dflashkit.integrity import write_checksums
from dflashkit.train import state as state_mod
from dflashkit.train.state import (
    capture_rng,
    load_training_state,
    read_latest,
    restore_rng,
    rotate_checkpoints,
    save_training_state,
    step_dir_name,
    write_latest,
)


def _draw(gen: torch.Generator) -> tuple:
    return (
        random.random(),
        random.gauss(0, 1),
        float(np.random.rand()),
        torch.rand(3).tolist(),
        torch.rand(3, generator=gen).tolist(),
    )


# ----------------------------------------------------------------------------------------------------- rng


def test_rng_capture_restore_reproduces_every_stream():
    gen = torch.Generator().manual_seed(123)
    random.gauss(0, 1)  # leave a cached gaussian in python's state
    snap = capture_rng({"anchors": gen})
    first = [_draw(gen) for _ in range(3)]
    restore_rng(snap, {"anchors": gen})
    assert [_draw(gen) for _ in range(3)] == first


def test_rng_state_survives_a_weights_only_round_trip(tmp_path):
    gen = torch.Generator().manual_seed(5)
    torch.save(capture_rng({"g": gen}), tmp_path / "rng.pt")
    first = _draw(gen)
    _draw(gen)  # move every stream on
    restore_rng(torch.load(tmp_path / "rng.pt", weights_only=True), {"g": gen})
    assert _draw(gen) == first


def test_restoring_an_unknown_generator_is_an_error():
    snap = capture_rng({"a": torch.Generator()})
    with pytest.raises(CheckpointError, match="'b'"):
        restore_rng(snap, {"b": torch.Generator()})


# ---------------------------------------------------------------------------------------------- atomic dir


def _leftovers(root):
    return sorted(p.name for p in root.iterdir() if p.name.startswith("."))


def test_atomic_dir_publishes_only_on_success(tmp_path):
    final = tmp_path / "ck" / "step-00000001"
    with atomic_dir(final) as tmp:
        assert tmp.parent == final.parent and not final.exists()
        (tmp / "a.txt").write_text("hello")
    assert (final / "a.txt").read_text() == "hello"
    with pytest.raises(RuntimeError), atomic_dir(tmp_path / "ck" / "step-00000002") as tmp:
        (tmp / "a.txt").write_text("half")
        raise RuntimeError("disk full")
    assert not (tmp_path / "ck" / "step-00000002").exists()
    assert _leftovers(tmp_path / "ck") == []


def test_atomic_dir_replaces_an_existing_folder(tmp_path):
    final = tmp_path / "step-00000001"
    for text in ("old", "new"):
        with atomic_dir(final) as tmp:
            (tmp / "a.txt").write_text(text)
    assert (final / "a.txt").read_text() == "new" and _leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt), atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("newer")
        raise KeyboardInterrupt
    assert (final / "a.txt").read_text() == "new"


def test_a_failed_rename_puts_the_old_folder_back(tmp_path):
    final = tmp_path / "step-00000001"
    with atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("old")
    real_rename = state_mod.os.rename

    def rename(src, dst):
        if ".tmp-" in str(src):
            raise OSError("rename failed")
        real_rename(src, dst)

    failing = mock.patch.object(state_mod.os, "rename", rename)
    with failing, pytest.raises(OSError, match="rename failed"), atomic_dir(final) as tmp:
        (tmp / "a.txt").write_text("new")
    assert (final / "a.txt").read_text() == "old" and _leftovers(tmp_path) == []


def test_latest_pointer(tmp_path):
    assert read_latest(tmp_path) is None
    with pytest.raises(CheckpointError):
        write_latest(tmp_path, "step-00000009")
    (tmp_path / "step-00000003").mkdir()
    write_latest(tmp_path, "step-00000003")
    assert read_latest(tmp_path) == tmp_path / "step-00000003"
    assert (tmp_path / "latest").read_text() == "step-00000003\n" and _leftovers(tmp_path) == []
    (tmp_path / "step-00000003").rmdir()
    with pytest.raises(CheckpointError, match="does not exist"):
        read_latest(tmp_path)


def test_rotation_keeps_the_last_k_and_the_latest(tmp_path):
    for s in (1, 2, 3, 4, 5):
        (tmp_path / step_dir_name(s)).mkdir()
    (tmp_path / ".step-00000006.tmp-abc").mkdir()  # a save the process died in
    (tmp_path / "notes").mkdir()  # not ours: left alone
    write_latest(tmp_path, step_dir_name(2))  # e.g. the user pointed back at step 2
    deleted = rotate_checkpoints(tmp_path, keep_last=2)
    assert sorted(p.name for p in deleted) == [".step-00000006.tmp-abc", "step-00000001", "step-00000003"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "notes",
        "step-00000002",
        "step-00000004",
        "step-00000005",
    ]


# -------------------------------------------------------------------------------------------- resume


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.3), torch.nn.Linear(8, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return model, opt, sched


def _train(model, opt, sched, gen, steps):
    for _ in range(steps):
        x = torch.randn(16, 4, generator=gen)
        loss = model(x).pow(2).mean()  # dropout draws from the global torch stream
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()


def _checkpoint(root, step, model, opt, sched, gen):
    with atomic_dir(root / step_dir_name(step), checksums=True) as tmp:  # as training writes them
        torch.save(model.state_dict(), tmp / "model.pt")
        save_training_state(
            tmp,
            opt,
            sched,
            step,
            {"epoch": 0, "index": step * 16},
            capture_rng({"data": gen}),
            {"note": "test"},
        )
    write_latest(root, step_dir_name(step))


def _resume(root):
    path = read_latest(root)
    model, opt, sched = _setup(seed=99)  # different init: everything must come from the checkpoint
    model.load_state_dict(torch.load(path / "model.pt", weights_only=True))
    st = load_training_state(path, opt, sched)
    gen = torch.Generator()
    restore_rng(st.rng, {"data": gen})
    return model, opt, sched, gen, st


def test_resume_continues_exactly(tmp_path):
    model, opt, sched = _setup()
    gen = torch.Generator().manual_seed(1)
    _train(model, opt, sched, gen, 3)
    _checkpoint(tmp_path, 3, model, opt, sched, gen)
    _train(model, opt, sched, gen, 2)
    straight = [p.detach().clone() for p in model.parameters()]

    model, opt, sched, gen, st = _resume(tmp_path)
    assert (st.step, st.data_cursor, st.extra) == (3, {"epoch": 0, "index": 48}, {"note": "test"})
    assert sched.last_epoch == 3
    _train(model, opt, sched, gen, 2)
    for a, b in zip(straight, model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_loadable(tmp_path):
    model, opt, sched = _setup()
    gen = torch.Generator().manual_seed(1)
    _train(model, opt, sched, gen, 2)
    _checkpoint(tmp_path, 2, model, opt, sched, gen)
    saved_params = [p.detach().clone() for p in model.parameters()]
    _train(model, opt, sched, gen, 2)

    real_save = torch.save

    def dies_halfway(obj, f, *args, **kwargs):
        if str(f).endswith(state_mod.STATE_TENSORS):
            with open(f, "wb") as fh:
                fh.write(b"\x00partial")
            raise OSError("No space left on device")
        return real_save(obj, f, *args, **kwargs)

    # the full disk is said in one line (dflashkit.atomic.disk_full_error), the earlier checkpoint kept
    with (
        mock.patch.object(torch, "save", dies_halfway),
        pytest.raises(DflashkitError, match="the disk is full"),
    ):
        _checkpoint(tmp_path, 4, model, opt, sched, gen)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-00000002"]
    model2, opt2, sched2, _, st = _resume(tmp_path)
    assert st.step == 2 and sched2.last_epoch == 2
    for a, b in zip(saved_params, model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert int(opt2.state_dict()["state"][0]["step"]) == 2


def test_bad_inputs_fail_before_writing(tmp_path):
    model, opt, sched = _setup()
    with pytest.raises(TypeError):
        save_training_state(tmp_path / "x", opt, sched, 1, {"cursor": object()}, capture_rng())
    assert not (tmp_path / "x" / state_mod.STATE_TENSORS).exists()
    with pytest.raises(CheckpointError, match="no training state"):
        load_training_state(tmp_path, opt, sched)
    save_training_state(tmp_path / "y", opt, None, 1, None, capture_rng())
    write_checksums(tmp_path / "y")
    with pytest.raises(CheckpointError, match="without a scheduler"):
        load_training_state(tmp_path / "y", opt, sched)
