"""Tree verification's pure parts: the budget's best tree (built on the device), the ancestor mask, and the
walk that picks the accepted path."""

import heapq
import itertools
import math

import pytest
import torch

from dflashkit.infer.round import _exact
from dflashkit.infer.tree import (
    DraftTree,
    accepted_path,
    build_tree,
    chain,
    path_moves,
    read_walk,
    tree_candidates,
    walk_outputs,
)


def brute_force_best(probs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """The ``budget`` best-scoring branches (token tuples) over every branch of every depth: the tree's
    nodes, found by enumeration."""
    depth, vocab = probs.shape
    scored = []
    for d in range(1, depth + 1):
        for branch in itertools.product(range(vocab), repeat=d):
            score = math.prod(float(probs[i, t]) for i, t in enumerate(branch))
            scored.append((score, branch))
    scored.sort(reverse=True)
    return {branch for _, branch in scored[:budget]}


def best_first(probs: torch.Tensor, budget: int) -> set[tuple[int, ...]]:
    """The same branches taken best first with a heap (a node taken offers its next sibling and its first
    child; both score no higher): a second reference, fast enough for real vocabularies."""
    logp, ids = probs.double().log().sort(dim=-1, descending=True)
    heap: list[tuple[float, tuple[int, ...], tuple[int, ...]]] = [(-float(logp[0, 0]), (0,), ())]
    taken: list[tuple[int, ...]] = []
    while heap and len(taken) < budget:
        neg, ranks, _ = heapq.heappop(heap)
        taken.append(tuple(int(ids[d, r]) for d, r in enumerate(ranks)))
        d, last = len(ranks) - 1, ranks[-1]
        if last + 1 < probs.shape[-1]:
            heapq.heappush(
                heap, (neg - float(logp[d, last + 1] - logp[d, last]), (*ranks[:-1], last + 1), ())
            )
        if d + 1 < probs.shape[0]:
            heapq.heappush(heap, (neg - float(logp[d + 1, 0]), (*ranks, 0), ()))
    return set(taken)


def branches(tree: DraftTree) -> set[tuple[int, ...]]:
    out = set()
    for node in range(1, len(tree)):
        if tree.parents[node] < 0:  # padding
            continue
        tokens, n = [], node
        while n > 0:
            tokens.append(tree.tokens[n])
            n = tree.parents[n]
        out.add(tuple(reversed(tokens)))
    return out


@pytest.mark.parametrize("budget", [1, 2, 5, 9, 17, 40])
def test_the_tree_is_the_budgets_best_branches_parents_first(budget):
    gen = torch.Generator().manual_seed(budget)
    probs = torch.softmax(torch.randn(3, 5, generator=gen) * 2, dim=-1)  # 3 slots, 5 tokens: no ties
    tree = build_tree(99, probs, budget)
    assert tree.tokens[0] == 99 and tree.parents[0] == -1 and len(tree) == budget + 1
    assert all(0 <= tree.parents[i] < i for i in range(1, len(tree)))
    assert tree.depths == sorted(tree.depths)  # numbered depth by depth
    assert branches(tree) == brute_force_best(probs, budget) == best_first(probs, budget)


@pytest.mark.parametrize("budget", [8, 16, 64])
def test_the_tree_at_a_real_drafters_shape(budget):
    """7 drafted slots over a 3,000-token vocabulary, peaked as a trained drafter's are: the budget's best
    branches, as the heap finds them."""
    gen = torch.Generator().manual_seed(budget)
    probs = torch.softmax(torch.randn(7, 3000, generator=gen) * 4, dim=-1)
    tree = build_tree(5, probs, budget)
    assert branches(tree) == best_first(probs, budget) and len(tree) == budget + 1


@pytest.mark.parametrize("budget", [8, 32])
@pytest.mark.parametrize("scale", [0.3, 8.0])
def test_the_tree_from_flat_and_from_peaked_slots(budget, scale):
    """The build scores a fixed set of rank branches (``_candidates``: those that can be among the budget's
    best whatever the distributions): flat slots (the best branches reach deep ranks) and peaked ones (a
    long chain of first choices) give the heap's branches all the same."""
    gen = torch.Generator().manual_seed(budget)
    probs = torch.softmax(torch.randn(7, 50, generator=gen) * scale, dim=-1)
    assert branches(build_tree(5, probs, budget)) == best_first(probs, budget)


def test_a_tree_holds_no_more_nodes_than_the_slots_have_branches():
    probs = torch.softmax(torch.randn(1, 4), dim=-1)  # one slot of 4 tokens: 4 branches at most
    tree = build_tree(0, probs, 10)
    assert len(tree) == 11 and tree.parents == [-1, 0, 0, 0, 0, *[-1] * 6]  # the rest is padding
    assert len(branches(tree)) == 4
    sees = tree.ancestor_mask("cpu")
    assert sees[5:].int().sum(dim=1).tolist() == [1] * 6  # padding sees only itself (and the cache)
    assert not sees[:5, 5:].any()  # no node sees padding
    choices = [tree.tokens[2], 7, 7, 7, 7] + [tree.tokens[1]] * 6  # padding "matching" is never followed
    assert accepted_path(tree, choices) == ([0, 2], [tree.tokens[2], 7])
    with pytest.raises(ValueError, match="node budget of at least 1"):
        build_tree(0, probs, 0)
    with pytest.raises(ValueError, match="not one for 1 drafted slots"):  # a table made for other slots
        build_tree(0, probs, 10, tree_candidates(3, 4, 10))


def test_ancestor_mask_and_positions():
    #       0
    #     1   2
    #     3     4
    #     5
    tree = DraftTree.of([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 2, 3])
    assert tree.depths == [0, 1, 1, 2, 2, 3]
    sees = tree.ancestor_mask("cpu").int().tolist()
    assert sees == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]
    assert tree.positions(7, "cpu").tolist() == [[7, 8, 8, 9, 9, 10]]
    assert chain([4, 5, 6]).ancestor_mask("cpu").tolist() == torch.ones(3, 3).tril().bool().tolist()


def test_the_walk_follows_the_targets_choices():
    tree = DraftTree.of([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 2, 3])
    # the target's choice after each node: after the root 12 (node 2), after node 2 14 (node 4), then 9
    choices = [12, 0, 14, 0, 9, 0]
    assert accepted_path(tree, choices) == ([0, 2, 4], [12, 14, 9])
    assert accepted_path(tree, [5, 0, 0, 0, 0, 0]) == ([0], [5])  # no child holds it: the bonus only
    assert accepted_path(tree, [11, 13, 0, 15, 0, 8]) == ([0, 1, 3, 5], [11, 13, 15, 8])


def test_the_row_moves_keep_the_walked_path_as_a_chain():
    """`path_moves` on the device (from the walk's output) equals the host's rule: row start + j takes the
    path's j-th node, rows past the path's end stay."""
    tree = DraftTree.of([10, 11, 12, 13, 14, 15], [-1, 0, 0, 1, 2, 3])
    for choices in ([12, 0, 14, 0, 9, 0], [5, 0, 0, 0, 0, 0], [11, 13, 0, 15, 0, 8]):
        out = walk_outputs(tree.nodes, torch.tensor(choices))
        path, _ = read_walk(out.tolist(), 6)
        moves = path_moves(out[:6].bool(), torch.tensor(40)).tolist()
        assert moves == [[40 + x for x in path] + list(range(40 + len(path), 46)), list(range(40, 46))]


def test_a_chain_walks_as_the_exact_rule():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = torch.randint(0, 3, (5,), generator=gen)
        choices = torch.randint(0, 3, (6,), generator=gen)
        acc, committed = _exact(drafts, choices)
        path, walked = accepted_path(chain([7, *drafts.tolist()]), choices.tolist())
        assert path == list(range(acc + 1)) and walked == committed


def test_a_malformed_tree_is_refused():
    with pytest.raises(ValueError, match="parent must be an earlier node"):
        DraftTree.of([1, 2, 3], [-1, 2, 0])
    with pytest.raises(ValueError, match="a sibling already holds token 2"):
        DraftTree.of([1, 2, 2], [-1, 0, 0])
    with pytest.raises(ValueError, match="needs a root"):
        DraftTree.of([1, 2], [0, 0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_tree_plan_attends_as_the_masked_plan(dtype):
    """The GPU tree step's attention (``_tree_plan``: slot 0 of a one-slot cache read as a view, one additive
    bias per step) gives the masked plan's output under a tree mask; the scratch slot and the positions beyond
    the mask's width change nothing."""
    from dflashkit.target.slot_decoder import _masked_plan, _tree_plan

    g = torch.Generator().manual_seed(0)
    nq, nk, d, capacity, chunk, kv_len = 6, 2, 8, 24, 5, 19
    k = torch.randn(2, capacity, nk, d, generator=g).to(dtype)  # slot 0 and the scratch slot
    v = torch.randn(2, capacity, nk, d, generator=g).to(dtype)
    q = torch.randn(1, chunk, nq, d, generator=g).to(dtype)
    tree = DraftTree.of([5, 6, 7, 8, 9], [-1, 0, 0, 1, 2])
    start = 11
    seen = ancestors_of(tree)  # [chunk, chunk]
    at = torch.arange(kv_len) - start
    allowed = ((at < 0)[None, :] | (seen[:, at.clamp(0, chunk - 1)] & (at >= 0) & (at < chunk)))[None]
    want = _masked_plan(torch.tensor([0]), allowed, nq, nk)(q, k, v)
    got = _tree_plan(allowed, nq, nk, dtype)(q, k, v)
    tol = 1e-6 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    k2 = k.clone()
    k2[1] = 100.0  # the scratch slot
    k2[0, kv_len:] = 100.0  # beyond the mask's width
    torch.testing.assert_close(_tree_plan(allowed, nq, nk, dtype)(q, k2, v), got, atol=0, rtol=0)


def ancestors_of(tree: DraftTree) -> torch.Tensor:
    from dflashkit.infer.tree import ancestors

    return ancestors(tree.nodes[2])
