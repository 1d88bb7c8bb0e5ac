"""`train --dry-run` checks what the run itself would refuse: drafter.init's weights against their
checksums, and a run folder that cannot be made."""

from __future__ import annotations

from pathlib import Path

from dflashkit.cli import main


def _flip_a_weight_byte(folder: Path) -> None:
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # same size, one bit: only the checksum sees it
    weights.write_bytes(bytes(data))


def test_the_dry_run_refuses_a_damaged_init_checkpoint(tiny_dataset, tmp_path: Path, capsys) -> None:
    from test_train import TINY

    init = tmp_path / "init"
    assert main(["init", "--out", str(init), "--layers", "1", "--block-size", "4", "--dtype", "float32"]) == 0
    over = {**TINY, "data.dir": tiny_dataset, "drafter.init": init}
    argv = ["train", "--out", str(tmp_path / "run"), "--dry-run", *(f"{k}={v}" for k, v in over.items())]
    argv = [a for a in argv if not a.startswith(("drafter.layers=", "drafter.block_size=", "drafter.num_"))]
    capsys.readouterr()
    assert main(argv) == 0  # intact: everything checks out
    assert "everything checks out" in capsys.readouterr().out
    _flip_a_weight_byte(init)
    assert main(argv) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("dflashkit train")]
    assert len(err) == 1 and "model.safetensors" in err[0], err
