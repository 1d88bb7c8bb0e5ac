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
