"""benchmarks/decode_steps.py's warm-start child builds the very steps its parent wrote to the kernel cache file:
every argument that enters a step's shape (the capacity: prompt, tokens, calls, profile, tree budgets) reaches
the child (a child without the tree budgets compiled the kernels' variants again, 2026-12-05)."""

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import decode_steps  # noqa: E402


def test_the_warm_start_child_builds_the_parents_steps(tmp_path):
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=8))
    for argv in (
        [
            "--tree-budgets",
            "31",
            "--profile",
            "300",
            "--prompt-len",
            "80",
            "--start-profile",
            "5",
        ],
        ["--tokens", "64", "--calls", "50", "--start-tree-budget", "0"],
    ):
        parent = decode_steps.parser().parse_args(argv)
        cmd = decode_steps.warm_start_command("graphs:triton", tmp_path, "bfloat16", tmp_path / "c", parent)
        assert cmd[:2] == [sys.executable, str(ROOT / "benchmarks" / "decode_steps.py")]
        child = decode_steps.parser().parse_args(cmd[2:])
        assert decode_steps.engine_capacity(child, drafter) == decode_steps.engine_capacity(parent, drafter)
        same = ("shape", "layers", "block", "target_layers", "prompt_len", "tokens", "calls", "tree_budgets")
        for name in (*same, "profile", "start_profile", "start_tree_budget"):
            assert getattr(child, name) == getattr(parent, name), name
        assert child.warm_start_child == str(tmp_path / "c") and child.warm_start_engine == "graphs:triton"


def test_the_start_profile_names_the_slowest_functions():
    import cProfile
    import time

    def slow() -> None:
        time.sleep(0.05)

    profiler = cProfile.Profile()
    profiler.enable()
    slow()
    profiler.disable()
    top = decode_steps.profile_top(profiler, 3)
    assert set(top) == {"cumulative", "tottime"} and all(len(v) <= 3 for v in top.values())
    assert "slow" in top["cumulative"][0] or "slow" in top["cumulative"][1]


def test_the_start_builds_the_tree_steps_the_serving_commands_use():
    """--start-tree-budget auto: the engine measured at its start holds the tree steps `eval` and `bench` serve
    greedy rounds with on it (trees of 15 with Triton layers, none elsewhere); the capacity holds the tree."""
    drafter = SimpleNamespace(config=SimpleNamespace(block_size=8))
    auto = decode_steps.parser().parse_args([])
    assert decode_steps.start_tree_budget("graphs:triton", drafter, auto) == 15
    assert decode_steps.start_tree_budget("graphs", drafter, auto) == 0
    assert decode_steps.start_tree_budget("reference", drafter, auto) == 0
    chain = decode_steps.parser().parse_args(["--start-tree-budget", "0"])
    assert decode_steps.start_tree_budget("graphs:triton", drafter, chain) == 0
    wide = decode_steps.parser().parse_args(["--start-tree-budget", "31"])
    assert (
        decode_steps.engine_capacity(wide, drafter) == decode_steps.engine_capacity(chain, drafter) + 32 - 8
    )


def test_the_decode_8b_json_holds_the_issues_keys(tmp_path):
    """--decode-8b-json on the CPU smoke run (tiny shape, under "tiny"): issue 64's keys, finite where measured
    (no memory floor on the CPU), every engine's figures under "rows"; what the file held for the other shapes
    is kept, and the 8B shape's figures go to the top level beside the 0.6B and 4B shapes'."""
    import json
    import math
    import os
    import subprocess

    path = tmp_path / "decode_8b.json"
    path.write_text(json.dumps({"0.6b": {"ar_ms": 1.0}}))
    cmd = [
        sys.executable,
        str(ROOT / "benchmarks" / "decode_steps.py"),
        "--smoke",
        "--engines",
        "graphs,reference",
    ]
    cmd += ["--tree-budgets", "15", "--no-record-layers", "--decode-8b-json", str(path)]
    env = {**os.environ, "OUT": str(tmp_path / "out")}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    data = json.loads(path.read_text())
    assert data["0.6b"] == {"ar_ms": 1.0}
    tiny = data["tiny"]
    keys = ("ar_ms", "round_cost_ar_tokens", "tree15_round_cost_ar_tokens", "draft_step_ar_tokens")
    assert set(tiny["rows"]) == {"graphs", "reference"}
    for figures in (tiny, *tiny["rows"].values()):
        assert figures["device"] == "cpu" and figures["backend"] == "torch" and figures["floor_ms"] is None
        # trees are the graphs engine's alone: no tree figure where the reference engine's row (or, when it was
        # the faster on this CPU, the summary taken from it) is read
        from_reference = figures is tiny["rows"]["reference"] or figures.get("engine") == "reference"
        for key in keys[:2] + keys[3:] if from_reference else keys:
            assert math.isfinite(figures[key]) and figures[key] > 0, key
    assert (
        tiny["rows"]["reference"]["tree15_round_cost_ar_tokens"] is None
    )  # trees: the graphs engine's alone
    best = min(tiny["rows"].values(), key=lambda r: r["round_cost_ar_tokens"] * r["ar_ms"])
    assert tiny["ar_ms"] == best["ar_ms"]

    decode_steps.merge_decode_figures(path, "qwen3-8b", {"ar_ms": 2.0, "rows": {}})
    decode_steps.merge_decode_figures(path, "qwen3-4b", {"ar_ms": 3.0})
    data = json.loads(path.read_text())
    assert data["ar_ms"] == 2.0 and data["4b"] == {"ar_ms": 3.0} and data["0.6b"] == {"ar_ms": 1.0}
    assert data["tiny"] == tiny
