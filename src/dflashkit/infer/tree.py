"""Tree verification: a token tree built from the drafter's block, verified in one target pass.

The drafter fills its whole block in one pass, so it gives a distribution for every drafted slot (slot d
predicts the token d places after the anchor) at once. The chain takes the best token of each slot; a
*tree* keeps several candidates per slot and lets the target pick, in one pass, the longest branch it
agrees with. The method, as DDTree (block diffusion draft trees) describes it:

1. **Build** (``build_tree``): the root is the anchor (the last committed token). A node at depth d holds
   one of the top-k tokens of slot d; its score is the product of the drafter's probabilities along its
   branch. The tree is the **node budget**'s best-scoring branches: every prefix of a branch scores at
   least as high as the branch, so they form a tree. Found on the device in a fixed number of kernels, with
   no copy to the host: only a fixed set of rank branches (each slot's top tokens) can be among the N best
   whatever the probabilities (``_candidates``), so they are all scored at once and the N best kept.
2. **Verify** (an engine's ``verify_tree``): the target reads all nodes in one pass, after its cache. A node
   sees the cache and its own ancestors (``ancestor_mask``); its rotary position is the root's position
   plus its depth, as if its branch alone had been written. Row i of the logits is the target's
   distribution for the token after node i.
3. **Accept** (``accepted_path``: ``walk_outputs`` on the device, one copy to the host, ``read_walk``): from the root, the target chooses its own next token (argmax when
   greedy, a sample otherwise); when a child of the current node holds that token, walk into it and go on;
   otherwise stop. The **accepted path** is the nodes walked (the root first); the committed tokens are the
   accepted nodes' tokens and the target's last choice. Every committed token is the target's own choice
   given the tokens before it, so the output is distributed exactly as the target's (at T = 0: equal to
   greedy decoding). A node's children are fixed tokens, not samples, so no lossless rule can accept a child
   with more than the probability the target gives to the children together, and this rule reaches it.
4. **Keep** (an engine's ``keep``): the caches are left as a chain of the accepted tokens would have left
   them: the accepted nodes' K/V rows move to consecutive positions and the rest is dropped; the drafter's
   next context rows are the accepted path's target features.

Nodes are numbered depth by depth, so a parent always comes before its children, and the root is node 0.
A chain of B tokens is the tree whose node i has parent i - 1. A tree lives on the device as one [3, n]
tensor (token, depth, parent per node); a node that is its own parent is padding (a built tree always has
N+1 nodes, padded when the slots hold fewer branches): it sees only the cache and itself, and is never
accepted.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    """``nodes`` [3, n] long: each node's token, depth and parent (the root, node 0, is its own parent;
    so is a padding node). Build one with ``build_tree`` (on the device) or ``DraftTree.of`` (lists)."""

    nodes: Tensor

    @classmethod
    def of(cls, tokens: Sequence[int], parents: Sequence[int]) -> DraftTree:
        """A tree from its tokens and parents (the root's parent: -1), checked: parents before children,
        no two siblings with one token."""
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a draft tree needs a root (node 0, parent -1) and one parent per node")
        depths, seen = [0], set()
        for i in range(1, len(tokens)):
            if not 0 <= parents[i] < i:
                raise ValueError(f"node {i}: its parent must be an earlier node, got {parents[i]}")
            if (parents[i], tokens[i]) in seen:
                raise ValueError(f"node {i}: a sibling already holds token {tokens[i]}")
            seen.add((parents[i], tokens[i]))
            depths.append(depths[parents[i]] + 1)
        return cls(torch.tensor([list(tokens), depths, [0, *parents[1:]]], dtype=torch.long))

    def __len__(self) -> int:
        return self.nodes.shape[1]

    def to(self, device: torch.device | str) -> DraftTree:
        return DraftTree(self.nodes.to(device))

    def ids(self, device: torch.device | str) -> Tensor:
        """The nodes' tokens as the target's input [1, n]."""
        return self.nodes[:1].to(device)

    def positions(self, start: int | Tensor, device: torch.device | str) -> Tensor:
        """Rotary positions [1, n] of the nodes when the root sits at ``start``: start + depth."""
        return start + self.nodes[1:2].to(device)

    def ancestor_mask(self, device: torch.device | str) -> Tensor:
        """[n, n] bool: node i sees node j when j is i or one of i's ancestors."""
        return ancestors(self.nodes[2].to(device))

    # host views, for tests and reading a tree (each one copies from the device)
    @property
    def tokens(self) -> list[int]:
        return self.nodes[0].tolist()

    @property
    def depths(self) -> list[int]:
        return self.nodes[1].tolist()

    @property
    def parents(self) -> list[int]:
        """Each node's parent, -1 for the root and for padding."""
        return [-1 if p == i else p for i, p in enumerate(self.nodes[2].tolist())]

    @property
    def children(self) -> list[dict[int, int]]:
        """Per node: token -> child node."""
        out: list[dict[int, int]] = [{} for _ in range(len(self))]
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents, strict=True)):
            if parent >= 0:
                out[parent][token] = i
        return out


def ancestors(parents: Tensor) -> Tensor:
    """[n, n] bool from ``parents`` [n] (the root and padding: their own parents): row i marks node i and
    its ancestors, the reflexive-transitive closure of the parent relation, by squaring (each squaring
    doubles the levels covered; fixed work for a fixed n, so it can be captured)."""
    n = parents.shape[0]
    eye = torch.eye(n, device=parents.device)
    seen = ((eye + eye[parents]) > 0).float()  # itself and its parent
    for _ in range(max(n - 2, 0).bit_length()):  # 2^k levels >= the deepest node's n-1
        seen = ((seen @ seen) > 0).float()
    return seen > 0


def chain(tokens: Sequence[int]) -> DraftTree:
    """The tree of a chain: node i is token i, the child of node i - 1."""
    return DraftTree.of(list(tokens), list(range(-1, len(tokens) - 1)))


@functools.cache
def _candidates(depth: int, ranks: int, budget: int) -> Tensor:
    """Every branch that can be among the ``budget`` best of any distributions over ``depth`` slots with
    ``ranks`` candidate tokens each, as [depth + 3, C] long (columns: candidates, depth by depth): rows
    0..depth-1 each slot's rank (``ranks`` past the branch's depth), then the depth less one, the parent's
    column (itself at depth 1), and 1 for padding columns (there are always at least ``budget`` columns).

    A branch of ranks (r_1..r_d) scores no higher than each branch (r'_1..r'_j), j <= d, with r'_k <= r_k:
    there are sum_j prod_{k<=j} (r_k + 1) of them, itself included, whatever the distributions. When that
    count is above the budget, the branch is never among the best, so only branches within it are candidates
    (53 for a budget of 8 over 7 slots, 1,379 for 32, 6,005 for 64). Every prefix of a candidate is one."""
    columns: list[tuple[int, ...]] = []
    parent_of: list[int] = []

    def grow(branch: tuple[int, ...], parent: int, product: int, count: int) -> None:
        for r in range(ranks):
            p = product * (r + 1)
            if count + p > budget:
                break
            columns.append((*branch, r))
            parent_of.append(parent)
            if len(branch) + 1 < depth:
                grow((*branch, r), len(columns) - 1, p, count + p)

    grow((), -1, 1, 0)
    order = sorted(range(len(columns)), key=lambda c: len(columns[c]))  # depth by depth (stable)
    at = {c: i for i, c in enumerate(order)}
    table = torch.full((depth + 3, max(len(order), budget)), ranks, dtype=torch.long)
    table[depth:] = 0
    table[depth + 2, len(order) :] = 1  # padding columns
    for i, c in enumerate(order):
        branch = columns[c]
        table[: len(branch), i] = torch.tensor(branch)
        table[depth, i] = len(branch) - 1
        table[depth + 1, i] = at[parent_of[c]] if parent_of[c] >= 0 else i
    return table


def tree_candidates(depth: int, vocab: int, budget: int, device: torch.device | str = "cpu") -> Tensor:
    """The candidate table ``build_tree`` reads for drafted slots of this shape (``_candidates``), on
    ``device``: an engine makes it once, outside its captured steps (a copy from the host cannot be
    captured), and passes it to every build."""
    return _candidates(depth, min(budget, vocab), budget).to(device)


def build_tree(
    anchor: int | Tensor, probs: Tensor, budget: int, candidates: Tensor | None = None
) -> DraftTree:
    """The best-scoring tree of ``budget`` drafted nodes below the root ``anchor``, from the drafter's
    distributions ``probs`` [D, V] of the drafted slots 1..D (a node's score: the product of the
    probabilities along its branch), on probs' device with no copy to the host.

    Every node is a branch of token ranks (each slot's top tokens by probability); only a fixed set of rank
    branches can ever be among the best (``_candidates``: ``candidates`` from ``tree_candidates``, else
    made here), so the build scores them all at once and keeps the budget's best: a fixed number of kernels,
    whatever the depth. A parent scores at least as high as its child, so the best form a tree. Ties go to
    the shallower node, so a parent always ranks before its child. Nodes are numbered depth by depth, best
    first within a depth. Always budget + 1 nodes: where the slots hold fewer branches (a tiny vocabulary, or
    tokens of probability 0), the rest is padding, after them."""
    if budget < 1:
        raise ValueError(f"a tree needs a node budget of at least 1, got {budget}")
    depth, dev, n = probs.shape[0], probs.device, budget
    t = min(n, probs.shape[-1])  # candidate tokens per slot
    if candidates is None:
        candidates = tree_candidates(depth, probs.shape[-1], n, dev)
    elif candidates.shape[0] != depth + 3 or candidates.shape[1] < n:
        raise ValueError(
            f"a candidate table of shape {tuple(candidates.shape)} is not one for {depth} drafted slots and "
            f"{n} nodes: make it with tree_candidates({depth}, vocab, {n})"
        )
    ranks, d_of, parent_of, pad = candidates[:depth], candidates[depth], candidates[depth + 1], candidates[-1]
    top_p, top_ids = probs.float().topk(t, dim=-1)  # [D, t]
    # each slot's log-probabilities by rank, and a 0 past the branch's depth (rank t)
    logp = torch.cat([top_p.log(), torch.zeros(depth, 1, device=dev)], dim=1)  # -inf: probability 0
    score = logp.gather(1, ranks).sum(0).masked_fill(pad.bool(), -math.inf)  # [C]
    best = (score - 1e-4 * d_of).topk(n).indices  # ties go to the shallower node
    # depth by depth, best first within a depth; padding (and branches of probability 0) last, so that
    # which of them the top-k took (all tie at -inf) does not move a node
    last = torch.where(score[best] > -math.inf, d_of[best], depth)
    chosen = best[last.sort(stable=True).indices]
    valid = score[chosen] > -math.inf
    d = d_of[chosen]
    token = top_ids[d, ranks[d, chosen].clamp(max=t - 1)]  # its last rank (padding: any, dropped)
    number = torch.zeros(candidates.shape[1], dtype=torch.long, device=dev)
    number[chosen] = torch.arange(1, n + 1, device=dev)
    parent = torch.where(d == 0, 0, number[parent_of[chosen]])
    own = torch.arange(n + 1, device=dev)
    nodes = torch.stack(
        [
            torch.cat([_root(anchor, dev), torch.where(valid, token, 0)]),
            torch.cat([own[:1], torch.where(valid, d + 1, 0)]),
            torch.cat([own[:1], torch.where(valid, parent, own[1:])]),  # padding: its own parent
        ]
    )
    return DraftTree(nodes)


def _root(anchor: int | Tensor, dev: torch.device) -> Tensor:
    """The anchor as a [1] tensor on the device: a fill for an int (a copy from the host would wait for
    every step queued before it)."""
    if isinstance(anchor, Tensor):
        return anchor.to(dev).long().reshape(1)
    return torch.full((1,), anchor, dtype=torch.long, device=dev)


def accepted_path(tree: DraftTree, choices: Sequence[int] | Tensor) -> tuple[list[int], list[int]]:
    """Walk from the root while a child holds the target's choice at the current node (``choices[i]``:
    the target's token after node i). Returns the accepted path (node ids, the root first) and the
    committed tokens (the accepted nodes' tokens, then the target's choice at the last node).

    On the device (`walk_outputs`: fixed work for a fixed tree size, so it can be captured), then one copy
    to the host (`read_walk`)."""
    nodes = tree.nodes
    choices = torch.as_tensor(choices, device=nodes.device).long()
    return read_walk(walk_outputs(nodes, choices).tolist(), nodes.shape[1])


def walk_outputs(nodes: Tensor, choices: Tensor) -> Tensor:
    """The walk on the device, for a tree's ``nodes`` [3, n] and the target's ``choices`` [n]: [2n + 1] long,
    whether each node is on the accepted path, each node's token, and the target's choice at the path's
    last node. A node matches when its token is its parent's choice; it is accepted when it and all its
    ancestors match (siblings hold different tokens, so the accepted nodes form one path); the path ends
    at the deepest accepted node."""
    n, dev = nodes.shape[1], nodes.device
    tokens, depths, parents = nodes
    along = torch.arange(n, device=dev)
    own = parents == along  # the root and padding
    # the root always matches (no in-place write of a host value: that would copy during a capture)
    match = ((tokens == choices[parents]) & ~own) | (along == 0)
    seen = ancestors(parents)
    accepted = ~(seen & ~match[None, :]).any(dim=1)
    last = torch.where(accepted, depths, -1).argmax().view(1)
    # index_select, not seen[last]: indexing by a 0-d tensor reads it on the host (a sync, fatal in a capture)
    on_path = seen.index_select(0, last)[0]
    return torch.cat([on_path.long(), tokens, choices.index_select(0, last)])


def read_walk(out: Sequence[int], n: int) -> tuple[list[int], list[int]]:
    """(the accepted path, the committed tokens) from `walk_outputs`' values on the host."""
    path = [i for i in range(n) if out[i]]
    return path, [out[n + i] for i in path[1:]] + [out[2 * n]]


def path_moves(on_path: Tensor, start: Tensor) -> Tensor:
    """[2, n] long, on the device: the cache rows that keep an accepted path as a chain, from (the path's
    j-th node, written at start + node) to (start + j); rows past the path's end stay where they are. The
    path's nodes in node order are its nodes by depth (parents come before children)."""
    n, dev = on_path.shape[0], on_path.device
    along = torch.arange(n, device=dev)
    rank = torch.where(on_path, on_path.long().cumsum(0) - 1, n)  # j for the path's j-th node, else n
    frm = torch.arange(n + 1, device=dev)  # index n: where the nodes off the path land, dropped
    frm.scatter_(0, rank, along)
    return torch.stack([frm[:n], along]) + start
