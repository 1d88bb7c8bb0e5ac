"""Checkpoints that cannot lose work: checksums written with every checkpoint and checked on load, one clear
line for a truncated or corrupted file in eval, generate and convert, and a convert that never deletes its
source or a folder that is not a checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from dflashkit.cli import main
from dflashkit.errors import CheckpointError
from dflashkit.integrity import CHECKSUMS_FILE, CorruptFileError, verify_files, write_checksums
from dflashkit.model.checkpoint import convert_checkpoint, load_drafter, save_drafter


@pytest.fixture(scope="module")
def embedded_drafter(tmp_path_factory):
    """An untrained drafter for the embedded target, written by `dflashkit init` (with checksums)."""
    out = tmp_path_factory.mktemp("init") / "drafter"
    args = ["init", "--target", "embedded", "--out", str(out), "--layers", "1", "--block-size", "4"]
    assert main(args) == 0
    return out


@pytest.fixture
def drafter_copy(embedded_drafter, tmp_path):
    out = tmp_path / "drafter"
    shutil.copytree(embedded_drafter, out)
    return out


def flip_bytes(path, n=64):
    data = bytearray(path.read_bytes())
    data[-n:] = bytes(b ^ 0xFF for b in data[-n:])  # same size, same header: only a checksum notices
    path.write_bytes(bytes(data))


def truncate(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


# ------------------------------------------------------------------------------------------ checksums


def test_every_written_checkpoint_carries_checksums_of_its_files(embedded_drafter):
    recorded = json.loads((embedded_drafter / CHECKSUMS_FILE).read_text())
    assert recorded["algorithm"] == "sha256"
    assert set(recorded["files"]) == {"config.json", "model.safetensors"}
    verify_files(embedded_drafter)  # intact


def test_flipped_bytes_in_the_weights_are_caught_on_load(drafter_copy):
    load_drafter(drafter_copy)
    flip_bytes(drafter_copy / "model.safetensors")
    with pytest.raises(CorruptFileError, match=r"model.safetensors is corrupted: its sha256 differs"):
        load_drafter(drafter_copy)


def test_a_truncated_file_without_checksums_is_one_clear_error(drafter_copy):
    (drafter_copy / CHECKSUMS_FILE).unlink()  # as written by another tool
    truncate(drafter_copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors is truncated or corrupted"):
        load_drafter(drafter_copy)


def test_a_missing_recorded_file_is_named(tmp_path):
    (tmp_path / "a.json").write_text("{}")
    write_checksums(tmp_path)
    (tmp_path / "a.json").unlink()
    with pytest.raises(CorruptFileError, match=r"a.json is missing"):
        verify_files(tmp_path)


def test_training_checkpoints_and_best_carry_checksums(tiny_dataset, tmp_path):
    from rich.console import Console

    from dflashkit.config import load_config
    from dflashkit.train import trainer

    over = {
        "data.dir": tiny_dataset,
        "run.out_dir": tmp_path / "run",
        "target.dtype": "float32",
        "drafter.num_target_layers": 2,
        "drafter.block_size": 4,
        "train.max_steps": 1,
        "train.max_len": 64,
        "train.num_anchors": 4,
        "train.cache_features": True,
    }
    trainer.train(load_config(None, [f"{k}={v}" for k, v in over.items()]), console=Console(quiet=True))
    step = tmp_path / "run" / "checkpoints" / "step-00000001"
    assert set(json.loads((step / CHECKSUMS_FILE).read_text())["files"]) == {
        "config.json",
        "model.safetensors",
        "training_state.pt",
        "training_state.json",
        "run_config.yaml",
        "fingerprint.json",
        "dataset.json",
    }
    best = json.loads((tmp_path / "run" / "best" / CHECKSUMS_FILE).read_text())["files"]
    assert {"model.safetensors", "metrics.json", "fingerprint.json"} <= set(best)


# ------------------------------------------------------- one clear line in eval, generate and convert


@pytest.mark.parametrize("damage", [truncate, flip_bytes])
@pytest.mark.parametrize("command", ["eval", "generate", "convert"])
def test_a_damaged_drafter_is_one_line_naming_the_file(drafter_copy, tmp_path, capsys, command, damage):
    damage(drafter_copy / "model.safetensors")
    args = {
        "eval": ["eval", "--drafter", str(drafter_copy), "--prompts", "mtbench", "--max-prompts", "1"],
        "generate": ["generate", "--drafter", str(drafter_copy), "hello"],
        "convert": ["convert", str(drafter_copy), str(tmp_path / "out"), "--to", "speculators"],
    }[command]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err and "SafetensorError" not in err
    assert str(drafter_copy / "model.safetensors") in err
    assert not (tmp_path / "out").exists()


def test_a_drafter_path_that_does_not_exist_is_said_before_the_target_loads(tmp_path, capsys, monkeypatch):
    from dflashkit.target.hf import TargetModel

    def no_target(*a, **k):
        raise AssertionError("the target was loaded")

    monkeypatch.setattr(TargetModel, "load", no_target)
    assert main(["generate", "--drafter", str(tmp_path / "nowhere"), "hello"]) == 2
    err = capsys.readouterr().err
    assert "nowhere does not exist" in err and "config.json is missing" not in err


# ------------------------------------------------------------------------------------ convert safety


@pytest.fixture
def run_folder(drafter_copy, tmp_path):
    """A run folder as training leaves it: best/ (with metrics.json and fingerprint.json), metrics.jsonl."""
    run = tmp_path / "run"
    best = run / "best"
    shutil.copytree(drafter_copy, best)
    (best / "metrics.json").write_text(json.dumps({"step": 20, "served_acceptance_length": 1.5}))
    (best / "fingerprint.json").write_text(json.dumps({"torch": {"version": "x"}}))
    write_checksums(best)
    (run / "metrics.jsonl").write_text('{"step": 20}\n')
    return run


def test_convert_never_deletes_the_source_or_what_holds_it(run_folder, capsys):
    best = run_folder / "best"
    for dst in (run_folder, best, best / "inside"):
        assert main(["convert", str(best), str(dst), "--to", "speculators", "--force"]) == 2
        err = capsys.readouterr().err
        assert str(dst) in err and "Traceback" not in err
    assert (run_folder / "metrics.jsonl").is_file() and (best / "model.safetensors").is_file()
    assert not (best / "inside").exists()
    verify_files(best)


def test_force_replaces_only_a_checkpoint_folder(run_folder, tmp_path, capsys):
    best = run_folder / "best"
    other = tmp_path / "notes"
    other.mkdir()
    (other / "todo.txt").write_text("keep me")
    assert main(["convert", str(best), str(other), "--to", "zlab", "--force"]) == 2
    assert "not a drafter checkpoint folder" in capsys.readouterr().err
    assert (other / "todo.txt").read_text() == "keep me"
    dst = tmp_path / "converted"
    assert main(["convert", str(best), str(dst), "--to", "speculators"]) == 0
    assert main(["convert", str(best), str(dst), "--to", "zlab"]) == 2  # exists, no --force
    assert main(["convert", str(best), str(dst), "--to", "zlab", "--force"]) == 0  # a checkpoint: replaced
    assert json.loads((dst / "config.json").read_text())["architectures"] == ["DFlashDraftModel"]


def test_convert_keeps_fingerprint_and_metrics_with_checksums(run_folder, tmp_path):
    best = run_folder / "best"
    dst = convert_checkpoint(best, tmp_path / "spec", "speculators")
    for name in ("metrics.json", "fingerprint.json"):
        assert (dst / name).read_bytes() == (best / name).read_bytes()
    assert {"metrics.json", "fingerprint.json", "model.safetensors", "config.json"} <= set(
        json.loads((dst / CHECKSUMS_FILE).read_text())["files"]
    )
    a, b = load_drafter(best), load_drafter(dst)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())


def test_a_failed_convert_leaves_the_destination_as_it_was(run_folder, tmp_path, monkeypatch):
    from dflashkit.model import checkpoint as ckpt

    best = run_folder / "best"
    dst = tmp_path / "old"
    shutil.copytree(best, dst)
    before = {p.name: p.read_bytes() for p in dst.iterdir()}

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "write_checkpoint", fail)
    with pytest.raises(OSError, match="disk full"):
        convert_checkpoint(best, dst, "speculators", force=True)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []


def test_save_drafter_checksums_cover_every_file(tmp_path, embedded_drafter):
    drafter = load_drafter(embedded_drafter)
    save_drafter(drafter, tmp_path / "again")
    verify_files(tmp_path / "again")
    save_file({"x": torch.zeros(2)}, str(tmp_path / "again" / "model.safetensors"))
    with pytest.raises(CorruptFileError):
        verify_files(tmp_path / "again")
