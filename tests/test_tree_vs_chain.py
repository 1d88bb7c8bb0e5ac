"""benchmarks/tree_vs_chain.py --from-bench: a chain bench and a tree bench of one drafter as one report (the
tree's tau and round cost against the chain's), refused for two benches that are not that pair."""

import copy
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import tree_vs_chain  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def _bench(sets: dict[str, tuple[float, float]], tree_budget: int = 0, temperature: str = "0") -> dict:
    """A bench.json with figures per set at one temperature: (tau, speedup), at an AR rate of 1,000
    tokens/s."""
    return {
        "settings": {
            "drafter_weights": "w",
            "drafter": "d",
            "block_size": 8,
            "target": "t",
            "device": "cuda",
            "engine": "graphs",
            "dtype": "bfloat16",
            "max_new_tokens": 8,
            "tree_budget": tree_budget,
        },
        "sets": {
            name: {
                "temperatures": {
                    temperature: {
                        "tau": tau,
                        "speedup": speedup,
                        "responses": 2,
                        "rounds": 10,
                        "new_tokens": 20,
                        "ar_tokens_per_second": 1000.0,
                        "spec_tokens_per_second": 1000.0 * speedup,
                    }
                }
            }
            for name, (tau, speedup) in sets.items()
        },
    }


def test_a_bench_pair_gives_tau_gain_and_round_cost_against_the_chain():
    chain = _bench({"mtbench": (3.0, 2.0), "gsm8k": (3.5, 2.2)})
    tree = _bench({"mtbench": (4.0, 2.0)}, tree_budget=32)
    report = tree_vs_chain.report_from_bench(chain, tree)
    assert list(report["sets"]) == ["mtbench"]  # only the sets both measured
    fig = report["sets"]["mtbench"]["configs"]["tree-32"]
    assert fig["tau_gain_vs_chain"] == pytest.approx(1 / 3)
    assert report["sets"]["mtbench"]["configs"]["chain"]["round_cost_ar_tokens"] == pytest.approx(1.5)
    assert fig["round_cost_ar_tokens"] == pytest.approx(2.0)
    assert fig["round_cost_vs_chain"] == pytest.approx(2.0 / 1.5 - 1)


def test_a_bench_pair_at_t1_reports_its_t1_sets_only():
    chain = _bench({"mtbench": (1.7, 0.97)}, temperature="1")
    tree = _bench({"mtbench": (2.4, 1.2)}, tree_budget=31, temperature="1")
    report = tree_vs_chain.report_from_bench(chain, tree, 1.0)
    assert report["sets"]["mtbench"]["configs"]["tree-31"]["tau_gain_vs_chain"] == pytest.approx(
        2.4 / 1.7 - 1
    )
    assert "T = 1 (trees: the exact rule)" in tree_vs_chain.markdown({**report, "command": "c"})
    with pytest.raises(SystemExit, match="no set measured at T=0"):
        tree_vs_chain.report_from_bench(chain, tree)


def test_the_pair_must_be_chain_then_tree_of_one_drafter_on_one_engine():
    chain = _bench({"mtbench": (3.0, 2.0)})
    tree = _bench({"mtbench": (4.0, 2.0)}, tree_budget=32)
    with pytest.raises(SystemExit, match="first file must hold chain rounds"):
        tree_vs_chain.report_from_bench(tree, chain)
    other = copy.deepcopy(tree)
    other["settings"]["drafter_weights"] = "another"
    with pytest.raises(SystemExit, match="differ in drafter_weights"):
        tree_vs_chain.report_from_bench(chain, other)


def test_the_committed_tree_figures_follow_from_the_committed_benches():
    """decode_steps.json's tree block (the issue's tree_tau_gain) is what the two benches it names give."""
    results = json.loads((RESULTS / "decode_steps.json").read_text())
    sources = results["tree"]["source"].split(" and ")
    if len(sources) != 2:
        pytest.skip("the tree block comes from a side-by-side run, not a bench pair")
    chain, tree = (json.loads((ROOT / s).read_text()) for s in sources)
    report = tree_vs_chain.report_from_bench(chain, tree)
    name = f"tree-{results['tree']['budget']}"
    assert results["tree_tau_gain"] == pytest.approx(
        report["sets"]["mtbench"]["configs"][name]["tau_gain_vs_chain"]
    )


def test_the_table_marks_rounds_run_as_separate_calls():
    """A configuration whose rounds are not one captured step (a tree smaller than a block on a graphs engine)
    says so in the table: it costs a round more, which the reader must not take for the tree's own cost."""
    report = tree_vs_chain.report_from_bench(
        _bench({"mtbench": (3.0, 2.0)}), _bench({"mtbench": (4.0, 2.0)}, tree_budget=8)
    )
    report["settings"]["one_step_rounds"] = {"chain": True, "tree-8": False}
    table = tree_vs_chain.markdown({**report, "command": "c"})
    assert "| mtbench | tree-8 (calls) |" in table and "| mtbench | chain |" in table
    assert "(calls): rounds as separate calls" in table
    report["settings"]["one_step_rounds"] = {"chain": True, "tree-8": True}
    assert "(calls)" not in tree_vs_chain.markdown({**report, "command": "c"})
