"""One speculative round as separate calls, and the values that pass between them.

    logits, context = engine.prefill(prompt)           # context: rows the drafter has not read yet
    draft_logits = engine.draft(context, anchor)       # the block [anchor, MASK x (B-1)] at context.end
    verified = engine.verify(block)                    # or engine.verify_tree(tree)
    path, tokens = engine.walk(tree, choices)          # a tree: the target's choices along its nodes
    context = engine.keep(verified, accepted_path)     # the caches end as a chain of the kept tokens

Between these calls nothing hides in an engine's state: ``keep`` takes the ``Verified`` it settles, and
``draft`` the ``Context`` it reads (``dflashkit.infer.engine`` describes the calls). ``separate_round`` runs
them for one round (the reference engine's ``round``, and the graphs engine's where its one-step round does
not apply): draft, verify (a chain, or a tree with a node budget), accept, keep. The context it reads is the
engine's ``context``, which ``prefill`` and ``keep`` leave.

Acceptance rules (`Sampling.rule`):
  - "exact": the reference rule. The target draws its own token at every position (argmax when greedy,
    a sample otherwise); a draft token is accepted while it equals that token. Lossless by construction.
  - "rejection": speculative rejection sampling with the drafter's probabilities q: accept d_i with
    probability min(1, p(d_i)/q(d_i)); at the first rejection draw from norm(max(0, p - q)). Also
    lossless (the output is distributed exactly as the target's), and accepts more than "exact" when
    temperature > 0. At temperature 0 both rules are the greedy rule.
The drafts of a chain round at T > 0 (`Sampling.draft_sampling`, `sampling.propose`): "marginal", each slot
raced from the drafter's distribution, or "argmax", each slot's most likely token (a one-hot q); both rules
keep the target's distribution with either.
A tree round (`Sampling.tree_rule`) uses "match" by default: the "exact" rule over the tree (a tree's tokens
are the drafter's top-k, not samples from q; for fixed candidates that rule is the best a lossless rule can
do: ``dflashkit.infer.tree``). "recursive" (the reference engine only, T > 0): each node's children drawn
without replacement from q and accepted by recursive rejection (``dflashkit.infer.recursive``); at T = 0 a
tree round is the match rule's whatever the option.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from dflashkit.errors import DflashkitError
from dflashkit.infer.recursive import recursive_tree_round
from dflashkit.infer.sampling import (
    Sampling,
    accept_sampled,
    choose,
    probabilities,
    propose,
    rejection_noise,
)

if TYPE_CHECKING:
    from dflashkit.infer.engine import Engine


@dataclass(frozen=True)
class Context:
    """Target features [1, s, n*H] of the committed positions start .. start+s-1 that the drafter has not
    read yet (s may be 0: an engine may have let the drafter read them already). The next block's anchor
    sits at ``end``."""

    features: Tensor
    start: int

    @property
    def end(self) -> int:
        return self.start + self.features.shape[1]


@dataclass(frozen=True)
class Verified:
    """One target pass over t new tokens, written after the ``start`` cached positions: logits [t, V] (row
    i: the target's distribution for the token after token i) and features [1, t, n*H] (None when the
    engine computed none: an autoregressive step of the graphs engine). Hand it to ``keep`` before the
    next verify: the engine's caches hold these tokens until then."""

    logits: Tensor
    features: Tensor | None
    start: int


def check_kept_path(verified: Verified, open_pass: Verified | None, path: Sequence[int]) -> int:
    """Refuse a path the caches cannot keep: not of the last verify, not starting at its first token, or
    not increasing node ids within it. Returns its length."""
    if verified is not open_pass:
        raise ValueError("keep() takes the Verified of the last verify(), once")
    t = verified.logits.shape[0]
    if not path or path[0] != 0 or any(path[i] >= path[i + 1] for i in range(len(path) - 1)) or path[-1] >= t:
        raise ValueError(f"a kept path starts at node 0 and increases within the {t} verified tokens: {path}")
    return len(path)


def kept_rows(features: Tensor | None, path: Sequence[int]) -> Tensor:
    """The features [1, len(path), n*H] of the kept nodes (a slice for a chain's prefix)."""
    if features is None:
        raise ValueError("keep() needs the features of the verified tokens; this verify computed none")
    n = len(path)
    if list(path) == list(range(n)):
        return features[:, :n]
    return features[:, list(path)]


@dataclass(frozen=True)
class Round:
    """What one round committed: the accepted drafts then the target's own token (``tokens``), and the
    accepted path (node ids from the anchor, node 0; a chain's 0 .. n): its length is the round's tau."""

    tokens: list[int]
    path: list[int]


def separate_round(
    engine: Engine, anchor: int, s: Sampling, gen: torch.Generator | None, tree_budget: int | None = None
) -> Round:
    """One round as the engine's separate calls, from its ``context`` (what ``prefill`` or the last ``keep``
    left): 1. draft: the drafter reads the new context rows and fills [anchor, MASK x (B-1)]; 2. verify and
    3. accept: the chain, or a tree of ``tree_budget`` drafted nodes; 4. keep: the caches hold the accepted
    path, and its features are the drafter's next context."""
    context = engine.context
    if context is None:
        raise DflashkitError(f"the {engine.name} engine holds no context to draft from: prefill() first")
    draft_logits = engine.draft(context, anchor)  # [B-1, V]
    if tree_budget and s.tree_rule == "recursive" and not s.greedy:
        verified, path, committed = recursive_tree_round(engine, anchor, draft_logits, tree_budget, s, gen)
    elif tree_budget:
        verified, path, committed = _tree_round(engine, anchor, draft_logits, tree_budget, s, gen)
    else:
        verified, path, committed = _chain_round(engine, anchor, draft_logits, s, gen)
    engine.keep(verified, path)
    return Round(committed, path)


def _chain_round(
    dec: Engine, anchor: int, draft_logits: Tensor, s: Sampling, gen: torch.Generator | None
) -> tuple[Verified, list[int], list[int]]:
    """The chain: the drafter's choice per slot, verified as one block [anchor, d1 .. d_{B-1}]. At T > 0 the
    drafts are ``s.draft_sampling``'s proposal (`sampling.propose`); under the rejection rule the drafts, the
    acceptance and the token after it come from noise drawn up front (`sampling.accept_sampled`), as the
    graphs engine's one-step round draws them."""
    if not s.greedy and s.rule == "rejection":
        B, V = draft_logits.shape[0] + 1, draft_logits.shape[-1]
        races, uniforms = rejection_noise(B, V, gen, draft_logits.device)
        drafts, q = propose(draft_logits, s, races[:-1])
        verified = dec.verify(torch.cat([drafts.new_full((1,), anchor), drafts])[None])
        n, token = accept_sampled(drafts, q, probabilities(verified.logits, s), uniforms, races[-1])
        out = torch.cat([n, drafts, token]).tolist()  # one copy from the device
        acc = out[0]
        return verified, list(range(acc + 1)), out[1 : 1 + acc] + [out[-1]]
    if s.greedy:
        drafts = draft_logits.argmax(-1)  # [B-1]
    else:  # the noise `choose` would draw
        noise = torch.empty(draft_logits.shape, device=draft_logits.device).exponential_(generator=gen)
        drafts = propose(draft_logits, s, noise)[0]
    block = torch.cat([drafts.new_full((1,), anchor), drafts])[None]
    verified = dec.verify(block)  # logits[i]: the target's distribution for the token after block[i]
    acc, committed = _exact(drafts, choose(verified.logits, s, gen))
    return verified, list(range(acc + 1)), committed


def _tree_round(
    dec: Engine, anchor: int, draft_logits: Tensor, budget: int, s: Sampling, gen: torch.Generator | None
) -> tuple[Verified, list[int], list[int]]:
    """The tree: the budget's best branches of the drafter's per-slot top-k, verified in one pass; the
    target chooses at every node, and the walk follows its choices. At T > 0 this is sample-and-match
    (DDTree's ``follow_verified_tree``): each node's draw is from p_T under the ancestor mask, independent of
    the others, and only the draws at the nodes the walk visits decide anything, so every committed token is
    one target draw given the tokens before it (tests/test_sampling_exact.py holds it to the target's
    distribution). Built and walked on the device: one copy to the host per round, as the chain."""
    probs = torch.softmax(draft_logits.float(), dim=-1) if s.greedy else probabilities(draft_logits, s)
    tree = dec.build_tree(anchor, probs, budget)
    verified = dec.verify_tree(tree)
    path, committed = dec.walk(tree, choose(verified.logits, s, gen))
    return verified, path, committed


def _exact(drafts: Tensor, choices: Tensor) -> tuple[int, list[int]]:
    """The exact rule over one block: drafts [B-1] are accepted while they equal the target's own tokens
    choices [B]; then the target's token follows. Returns (accepted drafts, committed tokens); one copy
    from the device."""
    n = drafts.shape[0]
    both = torch.cat([drafts, choices]).tolist()
    d, c = both[:n], both[n:]
    acc = next((i for i in range(n) if d[i] != c[i]), n)
    return acc, d[:acc] + [c[acc]]
