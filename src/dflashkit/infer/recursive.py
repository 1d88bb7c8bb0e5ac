"""Sampled trees that use the drafter's q: children drawn without replacement, accepted by recursive rejection.

Recursive speculative decoding (Jeon et al., arXiv 2402.14160, "recursive rejection sampling" with draft tokens
drawn without replacement by the Gumbel-top-k trick). A node of the tree has a target distribution p (the
target's logits under the tree's ancestor mask, at the serving temperature, top-p applied as
`sampling.probabilities` does) and k candidate children y_1 .. y_k, drawn without replacement from the
drafter's q for the children's depth. The rule (`recursive_accept`): p_1 = p, q_1 = q; for i = 1 .. k, accept
y_i with probability min(1, p_i(y_i) / q_i(y_i)) (the node's token is y_i: the walk descends into that child);
on rejection p_{i+1} = norm(max(p_i - q_i, 0)) and q_{i+1} = q_i with y_i removed, renormalised. When all k are
rejected the node's token is a draw from p_{k+1} and the round ends there (that token is the bonus).

Why the emitted token is distributed exactly as p. Drawn without replacement, y_i given y_1 .. y_{i-1} is
distributed as q_i (q with the earlier candidates removed, renormalised): that is what drawing without
replacement is. Claim: given y_1 .. y_{i-1} (and the rejections before i), step i onwards emits a token
distributed as p_i. For i = k + 1 it draws from p_{k+1}. For i <= k: p_i and q_i are fixed by y_1 .. y_{i-1};
y_i ~ q_i and is accepted with probability min(1, p_i / q_i), so P(emit x by accepting y_i) = min(p_i(x),
q_i(x)); the rejection has probability 1 - sum_x min(p_i, q_i) = sum_x max(p_i - q_i, 0), and after it (by the
claim for i + 1, whatever y_i was) the token is distributed as p_{i+1} = max(p_i - q_i, 0) / that mass, which
does not depend on y_i. Together: min(p_i, q_i)(x) + max(p_i - q_i, 0)(x) = p_i(x). At i = 1 the token is
distributed as p_1 = p. Down the tree: a node's p is the target's distribution given its branch, the
candidates at each node are drawn independently of every other node's and of the acceptance uniforms, so each
committed token is distributed as the target's given the tokens before it, and the output as the target's.
(The paper's residual for its without-replacement drafts is this recursion; with k = 1 it is the chain's
rejection rule.) The first step alone accepts with probability sum_x min(p, q), the single draft's; each
further candidate only adds to it.

DFlash's drafter gives one distribution q_d per drafted slot d, independent of the parent token (block
parallel), so every node at depth d draws its candidates from q_{d+1} (the slot of its children). The tree's
shape: the shape of the match tree `tree.build_tree` builds from the same q (the budget's best branches of
each slot's top tokens), each of its nodes read as a rank: a node's c children are its c candidates, the first
drawn to the child with the largest subtree (siblings are numbered best first). The shape depends on q alone,
never on the draws, so it changes nothing above; it gives the earlier candidates (accepted most often) the
deeper subtrees, and spends the budget by how confident q is per slot, as today's trees do.

Reference path only (host loops, one copy per visited node): `recursive_tree_round` is the reference engine's
tree round when ``Sampling.tree_rule`` is "recursive" at T > 0; at T = 0 the rule would be the match rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashkit.infer.sampling import Sampling, probabilities, race
from dflashkit.infer.tree import DraftTree

if TYPE_CHECKING:
    from dflashkit.infer.engine import Engine
    from dflashkit.infer.round import Verified


def recursive_accept(
    p: Tensor, q: Tensor | None, candidates: Sequence[int], uniforms: Tensor, noise: Tensor
) -> tuple[int | None, int]:
    """One node's rule (see the module docstring): ``p`` [V] the target's distribution at the node, ``q`` [V]
    the distribution the ``candidates`` (tokens, in the order drawn, without replacement) came from (None: no
    candidates), ``uniforms`` [k] U(0, 1) for the acceptance tests, ``noise`` [V] Exp(1) for the draw after
    all are rejected. Returns (the accepted candidate's index, its token), or (None, the token drawn from the
    last residual)."""
    p = p.double()
    if candidates:
        assert q is not None, "candidates need the distribution they were drawn from"
        q = q.double() / q.double().sum()
    for i, y in enumerate(candidates):
        qy = float(q[y])
        if qy <= 0:  # not a draw from q (q's support is used up): nothing after it is either
            break
        if float(uniforms[i]) * qy < float(p[y]):  # probability min(1, p(y) / q(y))
            return i, int(y)
        p, q = after_rejection(p, q, int(y))
        if q is None:
            break
    return None, int(race(p.float(), noise))


def after_rejection(p: Tensor, q: Tensor, y: int) -> tuple[Tensor, Tensor | None]:
    """The target's and the drafter's distributions after candidate ``y`` is rejected: the residual
    norm(max(p - q, 0)) (p kept where it is 0, which only rounding makes: a rejection then has probability
    0), and q without y, renormalised (None once q's support is used up)."""
    residual = (p - q).clamp_min(0)
    mass = float(residual.sum())
    if mass > 0:
        p = residual / mass
    q = q.clone()
    q[y] = 0
    left = float(q.sum())
    return p, (q / left if left > 0 else None)


def rule_accepts(p: Tensor, q: Tensor, candidates: Sequence[int]) -> list[float]:
    """The probability that `recursive_accept` accepts each of ``candidates`` (in draw order), exactly, for
    these candidates: prod_{j < i} (1 - a_j) a_i, a_i = min(1, p_i(y_i) / q_i(y_i)) (0 past a candidate
    outside q's support)."""
    out = [0.0] * len(candidates)
    p, q = p.double(), q.double() / q.double().sum()
    still = 1.0
    for i, y in enumerate(candidates):
        qy = float(q[y])
        if qy <= 0:
            break
        a = min(1.0, float(p[y]) / qy)
        out[i] = still * a
        still *= 1 - a
        if still <= 0:
            break
        p, q = after_rejection(p, q, int(y))
        if q is None:
            break
    return out


def rule_acceptance(p: Tensor, q: Tensor, candidates: Sequence[int]) -> float:
    """The probability that `recursive_accept` accepts one of ``candidates``: the sum of `rule_accepts`."""
    return sum(rule_accepts(p, q, candidates))


def recursive_tree_tokens(tree: DraftTree, children: list[list[int]], p: Tensor, q: Tensor) -> float:
    """Expected tokens of a round over this candidate tree (`recursive_tree`; ``p`` [n, V]: the target's
    distribution after each of its nodes, ``q`` [D, V]: the drafter's per slot), exactly for these
    candidates: 1 + the probability of walking into each node (its parent's, times `rule_accepts` of its
    candidate at the parent)."""
    tokens, depths = tree.tokens, tree.depths
    reach = [0.0] * len(tokens)
    reach[0] = 1.0
    for node, kids in enumerate(children):  # parents before children
        if kids and reach[node] > 0:
            accepts = rule_accepts(p[node], q[depths[node]], [tokens[c] for c in kids])
            for child, a in zip(kids, accepts, strict=True):
                reach[child] = reach[node] * a
    return 1.0 + sum(reach[1:])


def without_replacement(q: Tensor, k: int, noise: Tensor) -> Tensor:
    """k tokens drawn without replacement from q [V] (any scale), in draw order, from Exp(1) ``noise`` [V]:
    the top k of q / noise (log q - log noise is log q plus Gumbel noise: the Gumbel-top-k trick; its top 1 is
    `sampling.race`). Only tokens of q's support are drawn when k is at most its size."""
    return (q / noise.clamp_min(torch.finfo(noise.dtype).tiny)).topk(k).indices


def recursive_tree(
    anchor: int, q: Tensor, budget: int, gen: torch.Generator | None
) -> tuple[DraftTree, list[list[int]]]:
    """The candidate tree of a round: the shape of `tree.build_tree` on the drafter's q [D, V] (at the
    serving temperature), each node's children drawn without replacement from q of their slot, the first
    candidate to the first-numbered child (the one with the deepest subtree). Returns the tree (on q's
    device) and each node's children, node ids in candidate order."""
    from dflashkit.infer.tree import build_tree

    shape = build_tree(anchor, q, budget)
    parents, depths = shape.parents, shape.depths
    kids: list[list[int]] = [[] for _ in parents]
    for i, parent in enumerate(parents):
        if parent >= 0:
            kids[parent].append(i)
    kept = [0] + [i for i in range(1, len(parents)) if parents[i] >= 0]  # padding dropped
    tokens = [anchor] + [0] * (len(parents) - 1)
    noise = torch.empty((len(parents), q.shape[-1]), device=q.device).exponential_(generator=gen)
    for node in kept:
        if kids[node]:
            drawn = without_replacement(q[depths[node]], len(kids[node]), noise[node]).tolist()
            for child, token in zip(kids[node], drawn, strict=True):
                tokens[child] = token
    number = {old: new for new, old in enumerate(kept)}
    tree = DraftTree.of([tokens[i] for i in kept], [-1] + [number[parents[i]] for i in kept[1:]])
    children = [[number[c] for c in kids[old]] for old in kept]
    return tree.to(q.device), children


def recursive_walk(
    tree: DraftTree,
    children: list[list[int]],
    p: Tensor,
    q: Tensor,
    gen: torch.Generator | None,
) -> tuple[list[int], list[int]]:
    """From the root, each visited node's candidates by `recursive_accept` (``p`` [n, V]: the target's
    distribution after each node; ``q`` [D, V]: the drafter's per slot): descend into the accepted child,
    else the residual's draw ends the walk. Returns the accepted path (node ids) and the committed tokens."""
    tokens, depths = tree.tokens, tree.depths
    node, path, committed = 0, [0], []
    dev = p.device
    while True:
        kids = children[node]
        uniforms = torch.rand(len(kids), generator=gen, device=dev)
        noise = torch.empty(p.shape[-1], device=dev).exponential_(generator=gen)
        slot = q[depths[node]] if kids else None
        index, token = recursive_accept(p[node], slot, [tokens[c] for c in kids], uniforms, noise)
        committed.append(token)
        if index is None:
            return path, committed
        node = kids[index]
        path.append(node)


def recursive_tree_round(
    dec: Engine, anchor: int, draft_logits: Tensor, budget: int, s: Sampling, gen: torch.Generator | None
) -> tuple[Verified, list[int], list[int]]:
    """A round of a recursive tree (T > 0): the candidate tree from the drafter's q at the serving
    temperature (`recursive_tree`), verified in one target pass under its ancestor mask (the engine's
    ``verify_tree``), walked by the recursive rule (`recursive_walk`)."""
    q = probabilities(draft_logits, s)
    tree, children = recursive_tree(anchor, q, budget, gen)
    verified = dec.verify_tree(tree)
    path, committed = recursive_walk(tree, children, probabilities(verified.logits, s), q, gen)
    return verified, path, committed
