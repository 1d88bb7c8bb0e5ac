"""The tree round's kernels (``dflashkit.infer.kernels.tree``; on the CPU in Triton's interpreter, which conftest
turns on): the mask and the walk give the torch functions' outputs exactly, on built trees (padded and not)
and hand-made ones, with the target's choices along random paths."""

import pytest
import torch

pytest.importorskip("triton")

from dflashkit.infer.kernels import tree as tree_kernels  # noqa: E402
from dflashkit.infer.kernels.decoder import interpreting  # noqa: E402
from dflashkit.infer.tree import DraftTree, ancestors, build_tree, path_moves, walk_outputs  # noqa: E402

DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not interpreting(), reason="Triton's interpreter is off (a GPU machine)"),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def trees(device: str) -> list[torch.Tensor]:
    """Nodes [3, n] of trees of several shapes: built from drafted slots (confident and flat, so some are
    deep and some wide; one over a tiny vocabulary, so padded), and hand-made."""
    out = []
    for seed, (slots, vocab, budget, sharp) in enumerate(
        [(7, 200, 8, 4.0), (7, 200, 32, 1.0), (7, 200, 32, 8.0), (15, 300, 64, 3.0), (3, 4, 20, 1.0)]
    ):
        gen = torch.Generator().manual_seed(seed)
        probs = torch.softmax(torch.randn(slots, vocab, generator=gen) * sharp, dim=-1)
        out.append(build_tree(5, probs, budget).nodes)
    out.append(DraftTree.of([9, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4]).nodes)
    out.append(DraftTree.of([9], [-1]).nodes)
    return [n.to(device) for n in out]


def choices_along(nodes: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The target's choice after each node: for most nodes the token of one of its children (so that paths
    are accepted to several depths), else a token no child holds."""
    n = nodes.shape[1]
    choices = torch.full((n,), 10_000, dtype=torch.long)
    tokens, _, parents = nodes.cpu()
    for i in range(n):
        children = [j for j in range(1, n) if parents[j] == i and j != i]
        if children and torch.rand(1, generator=gen).item() < 0.8:
            choices[i] = tokens[children[torch.randint(len(children), (1,), generator=gen).item()]]
    return choices.to(nodes.device)


@pytest.mark.parametrize("device", DEVICES)
def test_the_tree_kernels_give_the_torch_functions_outputs(device):
    gen = torch.Generator().manual_seed(0)
    deepest = []
    for nodes in trees(device):
        n = nodes.shape[1]
        assert torch.equal(tree_kernels.ancestors(nodes[2]).bool(), ancestors(nodes[2]))
        for _ in range(6):
            choices = choices_along(nodes, gen)
            start = torch.tensor([17 + n], device=device)
            ref = walk_outputs(nodes, choices)
            walked = torch.full((2 * n + 1,), -7, dtype=torch.long, device=device)
            moves = torch.full((2, n), -7, dtype=torch.long, device=device)
            tree_kernels.walk(nodes, choices, start, walked, moves)
            assert torch.equal(walked, ref)
            assert torch.equal(moves, path_moves(ref[:n].bool(), start))
            deepest.append(int(ref[:n].sum()))
    assert max(deepest) >= 4 and min(deepest) == 1, "paths of several lengths were walked"


@pytest.mark.filterwarnings("ignore:divide by zero encountered in log")  # the zero probabilities' log
@pytest.mark.parametrize("device", DEVICES)
def test_the_build_kernel_builds_the_torch_build_trees(device):
    """``tree_kernels.build`` (torch's top-k, then one launch) writes ``build_tree``'s nodes: confident and
    flat slots, budgets from 1 to 64, a tiny vocabulary (padding), and tokens of probability 0 among the top
    ones (more padding, which must land where the torch build puts it). A candidate table past its one
    program's (7 slots, 64 nodes: 6,005 branches) is refused, naming the torch build."""
    from dflashkit.infer.tree import tree_candidates

    cases = [(7, 200, 1, 0.5), (7, 200, 8, 3.0), (7, 200, 31, 9.0), (7, 200, 32, 0.5), (7, 200, 32, 3.0)]
    cases += [(5, 200, 64, 2.0), (15, 300, 16, 3.0), (3, 4, 20, 1.0), (2, 12, 16, "zeros")]
    big = tree_candidates(7, 200, 64, device)
    with pytest.raises(ValueError, match="build this tree with tree.build_tree"):
        out = torch.zeros(3, 65, dtype=torch.long, device=device)
        tree_kernels.build(torch.tensor([77], device=device), torch.rand(7, 200, device=device), big, out)
    for seed, (slots, vocab, budget, sharp) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed)
        if sharp == "zeros":  # 10 of the 12 tokens impossible in every slot: 6 branches for 16 nodes
            probs = torch.softmax(torch.randn(slots, vocab, generator=gen), dim=-1)
            probs[:, torch.randperm(vocab, generator=gen)[:10]] = 0.0
            probs = probs / probs.sum(-1, keepdim=True)
        else:
            probs = torch.softmax(torch.randn(slots, vocab, generator=gen) * sharp, dim=-1)
        probs = probs.to(device)
        anchor = torch.tensor([77], device=device)
        out = torch.full((3, budget + 1), -5, dtype=torch.long, device=device)
        tree_kernels.build(anchor, probs, tree_candidates(slots, vocab, budget, device), out)
        assert torch.equal(out, build_tree(anchor, probs, budget).nodes), (slots, vocab, budget, sharp)


@pytest.mark.parametrize("device", DEVICES)
def test_the_build_from_logits_builds_the_softmax_trees(device):
    """``tree_kernels.build_from_logits`` (the chunks' top-k, maxima and sums in one launch, each slot's merge in
    another, the build in a third) writes ``build_tree(softmax(logits))``'s nodes: a vocabulary of several chunks and one of
    less than a chunk, a budget of 1, a tiny vocabulary (padding), and logits of -inf (probability 0)."""
    from dflashkit.infer.tree import tree_candidates

    cases = [(3, 2100, 12, 2.0), (7, 200, 8, 3.0), (7, 200, 1, 0.5), (3, 4, 20, 1.0), (2, 12, 16, "zeros")]
    for seed, (slots, vocab, budget, sharp) in enumerate(cases):
        gen = torch.Generator().manual_seed(seed)
        logits = torch.randn(slots, vocab, generator=gen) * (1.0 if sharp == "zeros" else sharp)
        if sharp == "zeros":  # 10 of the 12 tokens impossible in every slot: 6 branches for 16 nodes
            logits[:, torch.randperm(vocab, generator=gen)[:10]] = float("-inf")
        if vocab > 2048:  # the best tokens in the last chunk (past the vocabulary's end in its block)
            logits[:, -3:] += 8.0
        logits = logits.to(device)
        anchor = torch.tensor([77], device=device)
        out = torch.full((3, budget + 1), -5, dtype=torch.long, device=device)
        tree_kernels.build_from_logits(anchor, logits, tree_candidates(slots, vocab, budget, device), out)
        ref = build_tree(anchor, torch.softmax(logits, dim=-1), budget).nodes
        assert torch.equal(out, ref), (slots, vocab, budget, sharp)


@pytest.mark.parametrize("device", DEVICES)
def test_the_keep_kernel_moves_the_path_rows_as_the_torch_keep(device):
    """``tree_kernels.keep`` leaves every layer's keys and values as ``graph_engine.keep_step`` (one gather, one
    copy) does, for the row moves of walked paths (a path of the root alone moves nothing; a path such as
    (0, 2, 3) reads a row that another of its moves writes), trees of 1 to 65 rows."""
    from dflashkit.infer.graph_engine import keep_step

    gen = torch.Generator().manual_seed(3)
    layers, positions, heads, dim = 3, 80, 3, 8
    walked = 0
    for nodes in trees(device):
        n = nodes.shape[1]
        for _ in range(4):
            choices = choices_along(nodes, gen)
            start = torch.tensor([5], device=device)
            path = walk_outputs(nodes, choices)[:n].bool()
            moves = path_moves(path, start)
            cache = torch.randn(2, layers, 2, positions, heads, dim, generator=gen).to(device)
            ours, ref = cache.clone(), cache.clone()
            tree_kernels.keep(ours[0][:, 0], ours[1][:, 0], moves)
            keep_step(ref[0][:, 0], ref[1][:, 0], moves)
            assert torch.equal(ours, ref), (n, path.nonzero().flatten().tolist())
            walked += int(path.sum()) > 1 and not bool(path[: int(path.sum())].all())
    assert walked >= 3, "paths whose rows move were kept"


@pytest.mark.parametrize("device", DEVICES)
def test_the_argmax_kernels_give_torchs_argmax(device):
    """``tree_kernels.argmax`` equals ``logits.argmax(-1)``: one row and several, a vocabulary of several chunks
    (its best in the last, partial one) and of less than one, the largest logit twice (the earlier column, as
    torch), rows of -inf."""
    gen = torch.Generator().manual_seed(4)
    for rows, vocab, chunk in [(1, 5000, 2048), (16, 5000, 1024), (7, 300, 2048), (3, 2048, 512)]:
        logits = torch.randn(rows, vocab, generator=gen)
        logits[0, -2] = 9.0  # the best in the last chunk
        if rows > 2:
            logits[1, [17, vocab - 1]] = 9.5  # a tie across chunks: the earlier column
            logits[2] = float("-inf")  # every column ties: the first
        logits = logits.to(device)
        out = torch.full((rows,), -1, dtype=torch.long, device=device)
        tree_kernels.argmax(logits, out, chunk=chunk)
        assert torch.equal(out, logits.argmax(-1)), (rows, vocab, chunk)
    with pytest.raises(ValueError, match="contiguous rows"):
        tree_kernels.argmax(torch.zeros(4, 6, device=device).t(), out)


@pytest.mark.parametrize("device", DEVICES)
def test_the_finish_kernel_leaves_the_torch_tree_rounds_state(device):
    """``tree_kernels.finish`` writes what a tree round's tail in torch writes (``graph_engine.finish_step``:
    the context rows of the path then of the nodes after it, the round's outputs, the next round's starts and
    anchor), for walked paths of several lengths and a feature width of several of its programs."""
    from dflashkit.infer.graph_engine import finish_step

    gen = torch.Generator().manual_seed(5)
    lengths = set()
    for nodes in trees(device)[:4]:
        n = nodes.shape[1]
        b = min(8, n)
        for _ in range(4):
            choices = choices_along(nodes, gen)
            start = torch.tensor([40], device=device)
            walked = torch.empty(2 * n + 1, dtype=torch.long, device=device)
            moves = torch.empty(2, n, dtype=torch.long, device=device)
            tree_kernels.walk(nodes, choices, start, walked, moves)
            tree_rows = torch.randn(n, 2100, generator=gen).to(device)
            state = [
                torch.full((b, 2100), -1.0, device=device),  # rows
                torch.full((b + 1,), -1, dtype=torch.long, device=device),  # round_out
                torch.tensor([3], device=device),  # row_start
                torch.tensor([40], device=device),  # block_start
                torch.full((b,), 9, dtype=torch.long, device=device),  # block
            ]
            ours = [t.clone() for t in state]
            tree_kernels.finish(walked, moves, start, nodes, tree_rows, *ours)
            finish_step(walked, moves, start, nodes, tree_rows, *state)
            for mine, ref in zip(ours, state, strict=True):
                assert torch.equal(mine, ref)
            lengths.add(int(state[1][0]))  # accepted
    assert len(lengths) >= 3, "paths of several lengths were finished"
