"""Exactness of the recursive trees (`dflashkit.infer.recursive`), statistically, as tests/test_sampling_exact.py
holds the chain and the match trees: one node's rule with 1 .. 4 candidates drawn without replacement emits
tokens distributed as the target's p and accepts at least the single draft's sum_x min(p, q); whole rounds of
recursive trees on that file's table engine keep the target's joint distribution of the first three tokens;
and two wrong variants (q not renormalised after removing a rejected candidate; no residual taken after a
rejection) fail the same tests."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from dflashkit.infer import recursive
from dflashkit.infer.recursive import (
    recursive_accept,
    recursive_tree,
    rule_acceptance,
    without_replacement,
)
from dflashkit.infer.sampling import Sampling, race
from dflashkit.infer.tree import build_tree
from test_bench import _chi_square_p
from test_sampling_exact import TRIALS, decode_p_value

NODE_V = 6
NODE_TRIALS = 12_000


def _node_dists() -> tuple[torch.Tensor, torch.Tensor]:
    """A target p and a drafter q over 6 tokens that differ (q gives one token no mass)."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(NODE_V, generator=g) * 1.2, -1)
    q = torch.softmax(torch.randn(NODE_V, generator=g) * 1.5, -1)
    q[2] = 0
    return p, q / q.sum()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run_node(rule, p: torch.Tensor, q: torch.Tensor, k: int, trials: int, seed: int = 0):
    """Counts of the emitted tokens and the acceptance rate over ``trials`` draws: candidates drawn without
    replacement from q (Gumbel-top-k), the rule applied."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(NODE_V, dtype=torch.float64)
    accepted = 0
    for _ in range(trials):
        candidates = without_replacement(q, k, torch.empty(NODE_V).exponential_(generator=gen)).tolist()
        uniforms = torch.rand(k, generator=gen)
        index, token = rule(p, q, candidates, uniforms, torch.empty(NODE_V).exponential_(generator=gen))
        counts[token] += 1
        accepted += index is not None
    return counts, accepted / trials


def _orders(q: torch.Tensor, k: int):
    """Every ordered draw of k tokens without replacement from q, with its probability."""
    support = [int(i) for i in (q > 0).nonzero().flatten()]
    for seq in itertools.permutations(support, k):
        prob, left = 1.0, 1.0
        for y in seq:
            prob *= float(q[y]) / left
            left -= float(q[y])
        yield list(seq), prob


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_one_node_emits_the_target_distribution_and_accepts_at_least_one_draft(k):
    p, q = _node_dists()
    counts, rate = _run_node(recursive_accept, p, q, k, NODE_TRIALS)
    assert _chi_square_p(counts, p.double() * NODE_TRIALS) > 1e-3
    single = float(torch.minimum(p, q).sum())
    exact = sum(prob * rule_acceptance(p, q, seq) for seq, prob in _orders(q, k))  # over the draws, exactly
    assert exact >= single - 1e-9
    if k > 1:
        assert exact > single + 0.02  # more candidates accept more
    spread = 4 * math.sqrt(exact * (1 - exact) / NODE_TRIALS)
    assert abs(rate - exact) < spread  # the rule accepts as `rule_acceptance` says


def test_without_replacement_draws_are_distinct_and_first_is_q():
    p, q = _node_dists()
    gen = torch.Generator().manual_seed(1)
    firsts = torch.zeros(NODE_V, dtype=torch.float64)
    for _ in range(4000):
        drawn = without_replacement(q, 4, torch.empty(NODE_V).exponential_(generator=gen)).tolist()
        assert len(set(drawn)) == 4 and all(q[y] > 0 for y in drawn)
        firsts[drawn[0]] += 1
    assert _chi_square_p(firsts, q.double() * 4000) > 1e-3


def _no_renormalise(p, q, candidates, uniforms, noise):
    """Wrong: a rejected candidate's mass removed from q, the rest not renormalised."""
    p, q = p.double(), (q if q is not None else torch.zeros_like(p)).double().clone()
    for i, y in enumerate(candidates):
        if float(uniforms[i]) * float(q[y]) < float(p[y]):
            return i, int(y)
        residual = (p - q).clamp_min(0)
        p = residual / residual.sum() if residual.sum() > 0 else p
        q[y] = 0
    return None, int(race(p.float(), noise))


def _no_residual(p, q, candidates, uniforms, noise):
    """Wrong: after a rejection the next candidate is tested against p itself, not the residual."""
    p, q = p.double(), (q if q is not None else torch.zeros_like(p)).double().clone()
    for i, y in enumerate(candidates):
        if float(uniforms[i]) * float(q[y]) < float(p[y]):
            return i, int(y)
        q[y] = 0
        q = q / q.sum()
    residual = (p - q).clamp_min(0)
    return None, int(race((residual if residual.sum() > 0 else p).float(), noise))


@pytest.mark.parametrize("wrong", [_no_renormalise, _no_residual])
def test_wrong_variants_fail_the_one_node_test(wrong):
    p, q = _node_dists()
    counts, _ = _run_node(wrong, p, q, 3, NODE_TRIALS)
    assert _chi_square_p(counts, p.double() * NODE_TRIALS) < 1e-6


def test_the_candidate_tree_has_the_match_tree_shape_and_distinct_siblings():
    g = torch.Generator().manual_seed(5)
    q = torch.softmax(torch.randn(7, 50, generator=g) * 2, -1)
    shape = build_tree(3, q, 15)
    tree, children = recursive_tree(3, q, 15, g)
    assert tree.parents == shape.parents and tree.depths == shape.depths and tree.tokens[0] == 3
    for node, kids in enumerate(children):
        assert kids == [c for c, parent in enumerate(tree.parents) if parent == node]
        tokens = [tree.tokens[c] for c in kids]
        assert len(set(tokens)) == len(tokens)
        assert all(q[tree.depths[node], t] > 0 for t in tokens)


@pytest.mark.parametrize("budget", [3, 6])
def test_recursive_tree_rounds_keep_the_target_distribution(budget):
    """Rounds of recursive trees (budget 6: two and three children below the root) through the decode loop."""
    s = Sampling(temperature=1.0, tree_rule="recursive")
    assert decode_p_value(s, TRIALS, tree_budget=budget) > 1e-3


def test_recursive_tree_rounds_keep_the_target_distribution_under_top_p():
    s = Sampling(temperature=1.0, top_p=0.8, tree_rule="recursive")
    assert decode_p_value(s, TRIALS, tree_budget=6) > 1e-3


def test_a_rule_without_the_residual_fails_the_tree_round_test(monkeypatch):
    """(Not renormalising q is caught by the one-node test; on these trees its bias is too small to show in
    this many trials: p ~ 0.02.)"""
    monkeypatch.setattr(recursive, "recursive_accept", _no_residual)
    s = Sampling(temperature=1.0, tree_rule="recursive")
    assert decode_p_value(s, TRIALS, tree_budget=6) < 1e-6


def test_greedy_tree_rounds_take_the_match_rule_whatever_the_option():
    """At T = 0 a recursive tree is the match rule's tree: the same tokens."""
    from dflashkit.infer.speculative import speculative_generate
    from test_sampling_exact import PROMPT, TableEngine

    outs = []
    for rule in ("match", "recursive"):
        engine = TableEngine()
        s = Sampling(tree_rule=rule)
        outs.append(
            speculative_generate(engine.target, engine.drafter, PROMPT, 8, s, engine=engine, tree_budget=6)
        )
    assert outs[0].tokens == outs[1].tokens and outs[0].accept_lengths == outs[1].accept_lengths


@pytest.fixture(scope="module")
def drafter_dir(tmp_path_factory):
    from dflashkit.cli import main

    best = tmp_path_factory.mktemp("run") / "best"
    assert (
        main(["init", "--target", "embedded", "--out", str(best), "--layers", "1", "--block-size", "4"]) == 0
    )
    return best


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--engine", "graphs", "--temperature", "1", "--tree-budget", "4"], "reference engine only"),
        (["--engine", "reference", "--temperature", "0", "--tree-budget", "4"], "temperature 0"),
        (["--engine", "reference", "--temperature", "1", "--tree-budget", "0"], "--tree-budget N above 0"),
    ],
)
def test_generate_refuses_recursive_trees_where_they_do_not_run(drafter_dir, capsys, flags, said):
    from dflashkit.cli import main

    args = ["generate", "--drafter", str(drafter_dir), "--target", "embedded", "--dtype", "float32"]
    assert main([*args, *flags, "--tree-rule", "recursive", "--max-new-tokens", "4", "hello"]) == 2
    captured = capsys.readouterr()
    assert said in " ".join((captured.out + captured.err).split())


def test_generate_and_bench_run_recursive_trees_on_the_reference_engine(drafter_dir, capsys, tmp_path):
    from dflashkit.cli import main

    args = [
        "--drafter",
        str(drafter_dir),
        "--target",
        "embedded",
        "--dtype",
        "float32",
        "--engine",
        "reference",
    ]
    args += ["--tree-budget", "4", "--tree-rule", "recursive"]
    assert main(["generate", *args, "--temperature", "1", "--max-new-tokens", "6", "hello"]) == 0
    assert "trees of 4 drafted nodes" in " ".join(capsys.readouterr().out.split())
    bench = ["bench", *args, "--max-new-tokens", "4", "--ceilings", "0", "--draft-sampling", "marginal"]
    assert main([*bench, "--temperatures", "0,1", "--sets", "mtbench"]) == 2  # refused before anything loads


def test_a_recursive_trees_expected_tokens_are_those_of_its_walk():
    """recursive_tree_tokens (exact for the drawn candidates) against the mean tokens the walk commits."""
    from dflashkit.infer.recursive import recursive_tree_tokens, recursive_walk

    g = torch.Generator().manual_seed(7)
    q = torch.softmax(torch.randn(3, 5, generator=g) * 1.5, -1)
    tree, children = recursive_tree(0, q, 6, g)
    p = torch.softmax(torch.randn(len(tree), 5, generator=g) * 1.5, -1)
    expected = recursive_tree_tokens(tree, children, p, q)
    trials = 6000
    lengths = torch.tensor([len(recursive_walk(tree, children, p, q, g)[1]) for _ in range(trials)]).double()
    assert expected > 1.2, "the test must see accepted candidates"
    assert abs(float(lengths.mean()) - expected) < 4 * float(lengths.std()) / math.sqrt(trials)


def test_the_loop_refuses_recursive_trees_on_the_graphs_engine():
    """A graphs engine fuses sampled tree rounds by the match rule: asked for recursive trees it refuses."""
    from dflashkit.errors import DflashkitError
    from dflashkit.infer.speculative import speculative_generate
    from test_sampling_exact import PROMPT, TableEngine

    engine = TableEngine()
    engine.name = "graphs"
    s = Sampling(temperature=1.0, tree_rule="recursive")
    with pytest.raises(DflashkitError, match="reference engine only"):
        speculative_generate(engine.target, engine.drafter, PROMPT, 4, s, engine=engine, tree_budget=6)
