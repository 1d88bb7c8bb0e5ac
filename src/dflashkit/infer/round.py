"""What passes between the calls of one speculative round, as values the decode loop holds.

    logits, context = engine.prefill(prompt)           # context: rows the drafter has not read yet
    draft_logits = engine.draft(context, anchor)       # the block [anchor, MASK x (B-1)] at context.end
    verified = engine.verify(block)                    # or engine.verify_tree(tree)
    path, tokens = engine.walk(tree, choices)          # a tree: the target's choices along its nodes
    context = engine.keep(verified, accepted_path)     # the caches end as a chain of the kept tokens

No engine hides what the next call needs in its own state: ``keep`` takes the ``Verified`` it settles, and
``draft`` the ``Context`` it reads (``dflashkit.infer.engine`` describes the calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from torch import Tensor


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
