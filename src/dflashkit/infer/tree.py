"""Tree verification: a token tree built from the drafter's block, verified in one target pass.

The drafter fills its whole block in one pass, so it gives a distribution for every drafted slot (slot d
predicts the token d places after the anchor) at once. The chain takes the best token of each slot; a
*tree* keeps several candidates per slot and lets the target pick, in one pass, the longest branch it
agrees with. The method, as DDTree (block diffusion draft trees) describes it:

1. **Build** (``build_tree``): the root is the anchor (the last committed token). A node at depth d holds
   one of the top-k tokens of slot d; its score is the product of the drafter's probabilities along its
   branch. Nodes are taken best first until the **node budget** is spent: every prefix of a branch scores
   at least as high as the branch, so the tree is the budget's best-scoring branches, parents first.
2. **Verify** (an engine's ``verify_tree``): the target reads all nodes in one pass, after its cache. A node
   sees the cache and its own ancestors (``ancestor_mask``); its rotary position is the root's position
   plus its depth, as if its branch alone had been written. Row i of the logits is the target's
   distribution for the token after node i.
3. **Accept** (``accepted_path``): from the root, the target chooses its own next token (argmax when
   greedy, a sample otherwise); when a child of the current node holds that token, walk into it and go on;
   otherwise stop. The **accepted path** is the nodes walked (the root first); the committed tokens are the
   accepted nodes' tokens and the target's last choice. Every committed token is the target's own choice
   given the tokens before it, so the output is distributed exactly as the target's (at T = 0: equal to
   greedy decoding). A node's children are fixed tokens, not samples, so no lossless rule can accept a child
   with more than the probability the target gives to the children together, and this rule reaches it.
4. **Keep** (an engine's ``keep``): the caches are left as a chain of the accepted tokens would have left
   them: the accepted nodes' K/V rows move to consecutive positions and the rest is dropped; the drafter's
   next context rows are the accepted path's target features.

Nodes are numbered in the order they are taken, so a parent always comes before its children, and the
root is node 0. A chain of B tokens is the tree whose node i has parent i - 1.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class DraftTree:
    """Tokens of the nodes (node 0: the root, the anchor) and each node's parent (the root's: -1)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int] = field(init=False)
    children: list[dict[int, int]] = field(init=False)  # per node: token -> child node

    def __post_init__(self) -> None:
        if not self.tokens or len(self.tokens) != len(self.parents) or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (node 0, parent -1) and one parent per node")
        depths, children = [0], [{} for _ in self.tokens]
        for i in range(1, len(self.tokens)):
            parent = self.parents[i]
            if not 0 <= parent < i:
                raise ValueError(f"node {i}: its parent must be an earlier node, got {parent}")
            if self.tokens[i] in children[parent]:
                raise ValueError(f"node {i}: a sibling already holds token {self.tokens[i]}")
            children[parent][self.tokens[i]] = i
            depths.append(depths[parent] + 1)
        object.__setattr__(self, "depths", depths)
        object.__setattr__(self, "children", children)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def depth(self) -> int:
        return max(self.depths)

    def ids(self, device: torch.device | str) -> Tensor:
        """The nodes' tokens as the target's input [1, N]."""
        return torch.tensor([self.tokens], dtype=torch.long, device=device)

    def positions(self, start: int, device: torch.device | str) -> Tensor:
        """Rotary positions [1, N] of the nodes when the root sits at ``start``: start + depth."""
        return torch.tensor([[start + d for d in self.depths]], dtype=torch.long, device=device)

    def ancestor_mask(self, device: torch.device | str) -> Tensor:
        """[N, N] bool: node i sees node j when j is i or one of i's ancestors."""
        n = len(self.tokens)
        rows: list[list[bool]] = []
        for i in range(n):
            row = list(rows[self.parents[i]]) if i else [False] * n
            row[i] = True
            rows.append(row)
        return torch.tensor(rows, dtype=torch.bool, device=device)


def chain(tokens: Sequence[int]) -> DraftTree:
    """The tree of a chain: node i is token i, the child of node i - 1."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)))


def build_tree(anchor: int, probs: Tensor, budget: int) -> DraftTree:
    """The best-scoring tree of ``budget`` nodes below the root ``anchor``, from the drafter's
    distributions ``probs`` [D, V] of the drafted slots 1..D (a node's score: the product of the
    probabilities along its branch).

    Best first with a heap: taking a node makes two new candidates, its next sibling (the same parent, the
    slot's next-ranked token) and its first child (the next slot's top token). Both score no higher than the
    node, so each node taken is the best one left. Fewer than ``budget`` nodes only when the slots hold
    fewer branches (a tiny vocabulary)."""
    if budget < 1:
        raise ValueError(f"a tree needs a node budget of at least 1, got {budget}")
    depth = probs.shape[0]
    k = min(budget, probs.shape[-1])
    top_p, top_ids = probs.float().topk(k, dim=-1)
    logp = [[math.log(p) if p > 0 else -math.inf for p in row] for row in top_p.tolist()]
    ids = top_ids.tolist()
    tokens, parents, scores = [anchor], [-1], [0.0]
    # candidates: (-score, depth (1-based), rank within the slot's top-k, parent node)
    heap = [(-logp[0][0], 1, 0, 0)] if depth else []
    while heap and len(tokens) <= budget:
        neg, d, rank, parent = heapq.heappop(heap)
        node = len(tokens)
        tokens.append(ids[d - 1][rank])
        parents.append(parent)
        scores.append(-neg)
        if rank + 1 < k:
            heapq.heappush(heap, (-(scores[parent] + logp[d - 1][rank + 1]), d, rank + 1, parent))
        if d < depth:
            heapq.heappush(heap, (-(scores[node] + logp[d][0]), d + 1, 0, node))
    return DraftTree(tokens, parents)


def accepted_path(tree: DraftTree, choices: Sequence[int]) -> tuple[list[int], list[int]]:
    """Walk from the root while a child holds the target's choice at the current node (``choices[i]``:
    the target's token after node i). Returns the accepted path (node ids, the root first) and the
    committed tokens (the accepted nodes' tokens, then the target's choice at the last node)."""
    node, path, committed = 0, [0], []
    while True:
        choice = int(choices[node])
        committed.append(choice)
        child = tree.children[node].get(choice)
        if child is None:
            return path, committed
        path.append(child)
        node = child
