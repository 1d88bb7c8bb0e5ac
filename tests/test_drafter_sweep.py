"""The recipe sweep driver (benchmarks/drafter_sweep.py): its GPU config is a valid fan-out on the GPU
dataset, and it reads each variant's held-out curve, best point and state from what training writes."""

import json
import sys
from pathlib import Path

import pytest

from dflashkit.config import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import drafter_sweep as sweep  # noqa: E402


def test_the_gpu_sweep_config_is_a_fanout_on_the_gpu_dataset():
    cfg = load_config(ROOT / "configs" / "embedded-gpu-sweep.yaml", ["run.device=auto"])  # no GPU needed here
    data = load_config(ROOT / "configs" / "embedded-gpu.yaml").data.dir
    assert cfg.data.dir == data == "runs/embedded-gpu/data"
    assert cfg.fanout is not None and len(cfg.fanout.variants) >= 6
    from dflashkit.train import fanout

    shapes = {name: (v.drafter.layers, v.drafter.block_size) for name, v in fanout.variant_configs(cfg)}
    assert {layers for layers, _ in shapes.values()} == {1, 2, 3}
    assert {block for _, block in shapes.values()} == {8, 16}
    variants = {name: v for name, v in fanout.variant_configs(cfg)}
    assert (
        len({v.decay_gamma() for v in variants.values()}) >= 3
        and len({v.train.lr for v in variants.values()}) >= 3
    )


def _metrics(folder: Path, served: list[float], steps_done: int, every: int = 10) -> None:
    folder.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, steps_done + 1) if s % every]
    for i, tau in enumerate(served, start=1):
        lines.append(json.dumps({"step": i * every, "loss": 1.0, "val": {"acceptance_length": tau + 0.2, "served_acceptance_length": tau}}))  # fmt: skip
    lines.append('{"step": 5, "loss": 2.0')  # a torn last line is skipped
    (folder / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_a_variant_s_curve_best_point_and_state(tmp_path):
    _metrics(tmp_path / "grp" / "a", [1.2, 1.5, 1.4], 30)
    _metrics(tmp_path / "b", [1.1, 1.3], 20)
    cfg = {
        "fanout": {"variants": [{"name": "a"}, {"name": "b", "overrides": {"train.lr": 1e-3}}, {"name": "c"}]}
    }
    variants = sweep.pick_variants(cfg, None)
    a = sweep.variant_result(variants[0], sweep.find_folder(tmp_path, "a"), 30)
    assert a["status"] == "finished" and [c["step"] for c in a["curve"]] == [10, 20, 30]
    assert a["best_served_tau"] == 1.5 and a["best_step"] == 20 and a["improving_at_end"] is False
    assert a["curve"][0]["mean_anchor_tau"] == pytest.approx(1.4)
    b = sweep.variant_result(variants[1], sweep.find_folder(tmp_path, "b"), 30)
    assert b["status"] == "partial (20 of 30 steps)" and b["improving_at_end"] is True
    c = sweep.variant_result(variants[2], sweep.find_folder(tmp_path, "c"), 30)
    assert c["status"] == "not trained" and c["curve"] == []
    head, rows = sweep.table_rows([a, b, c])
    assert rows[1][:5] == ["b", "lr=0.001", "partial (20 of 30 steps)", "20", "1.300"]
    text = sweep.markdown([a, b, c], "python benchmarks/drafter_sweep.py ...")
    assert "- a: 10: 1.200, 20: 1.500, 30: 1.400" in text
    with pytest.raises(SystemExit, match="unknown variant d"):
        sweep.pick_variants(cfg, "a,d")


def test_a_variant_config_is_the_base_with_its_overrides(tmp_path):
    cfg = {"train": {"lr": 6e-4, "max_steps": 10}, "drafter": {"layers": 2}, "fanout": {"variants": []}}
    one = sweep.variant_config(
        cfg, {"name": "x", "overrides": {"drafter.layers": 3, "train.gamma": 4.0}}, tmp_path
    )
    assert one == {
        "train": {"lr": 6e-4, "max_steps": 10, "gamma": 4.0},
        "drafter": {"layers": 3},
        "run": {"out_dir": str(tmp_path)},
    }
    assert cfg["drafter"]["layers"] == 2  # the base is left as it was


def test_a_command_past_its_time_gets_sigterm_before_sigkill(tmp_path):
    """The sweep's time limit lets training checkpoint the step under way: SIGTERM first (SIGKILL after the
    grace), so a child that handles SIGTERM finishes its work."""
    done = tmp_path / "checkpointed"
    child = (
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(done)!r}, 'w').write('step')\n"
        "    sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )
    assert sweep.run_until([sys.executable, "-c", child], None, timeout=8.0, grace=20.0) == 124
    assert done.read_text() == "step"
    assert sweep.run_until([sys.executable, "-c", "pass"], None, timeout=30.0) == 0
