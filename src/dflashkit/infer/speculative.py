"""The DFlash draft/verify loop, and the autoregressive baseline on the same engine.

One round, batch 1:
  1. the drafter sees the context rows it has not seen yet (target features of newly committed
     positions) and drafts the whole block [anchor, MASK x (B-1)] in one pass: B-1 draft tokens;
  2. the target verifies [anchor, d1 .. d_{B-1}] in one pass;
  3. the longest acceptable prefix is committed, plus one token from the target (the bonus), so every
     round commits between 1 and B tokens (the acceptance length tau);
  4. the engine keeps the anchor and the accepted drafts (the target cache is cropped to them; the
     drafter's cache only ever holds context rows, so it needs no crop); their target features are the
     drafter's next context rows, and the bonus token is the next anchor.

With a node budget (``tree_budget``), step 2 verifies a token tree instead of the chain: the budget's
best-scoring branches of the drafter's per-slot top-k, all in one target pass, and step 3 accepts the
longest branch the target agrees with (``dflashkit.infer.tree``).

The passes run on a decode engine (``dflashkit.infer.engine``): "dynamic" (growing caches, eager; the
default) or "static" (preallocated caches, fixed-shape steps, compiled once per shape). Both loops below
take the same engine, so speculative and autoregressive decoding are always compared like for like.

Acceptance rules (`rule`):
  - "exact": the reference rule. The target draws its own token at every position (argmax when greedy,
    a sample otherwise); a draft token is accepted while it equals that token. Lossless by construction.
  - "rejection": speculative rejection sampling with the drafter's probabilities q: accept d_i with
    probability min(1, p(d_i)/q(d_i)); at the first rejection draw from norm(max(0, p - q)). Also
    lossless (the output is distributed exactly as the target's), and accepts more than "exact" when
    temperature > 0. At temperature 0 both rules are the greedy rule.
The drafts of a chain round at T > 0 (`Sampling.draft_sampling`, `sampling.propose`): "marginal", each slot
raced from the drafter's distribution, or "argmax", each slot's most likely token (a one-hot q); both rules
keep the target's distribution with either.
A tree round always uses "exact" (a tree's tokens are the drafter's top-k, not samples from q; for fixed
candidates that rule is the best a lossless rule can do: ``dflashkit.infer.tree``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from dflashkit.infer.engine import Engine, Verified, make_engine, round_width
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.sampling import (
    Sampling,
    accept_sampled,
    choose,
    new_generator,
    probabilities,
    propose,
    rejection_noise,
)
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel


@dataclass
class Generation:
    """What one call produced: new tokens (prompt excluded), per-round acceptance lengths, timing."""

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # tau per round (1..B)
    seconds: float = 0.0
    prefill_seconds: float = 0.0
    stopped: str = "length"  # "eos", "stop_string" or "length"

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return len(self.tokens) / decode if decode > 0 else float("nan")

    @property
    def mean_acceptance_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else float("nan")


class Stopper:
    """Ends generation at an EOS token or a stop string; trims what follows."""

    def __init__(self, eos_ids: Sequence[int], stop_strings: Sequence[str] = (), tokenizer=None):
        self.eos = set(int(i) for i in eos_ids)
        self.stop_strings = list(stop_strings)
        self.tokenizer = tokenizer
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need the tokenizer")

    def check(self, tokens: list[int], new_from: int) -> tuple[list[int], str | None]:
        """Trim ``tokens`` (the new tokens so far; ``new_from`` is where this round's start) at a stop."""
        for i in range(new_from, len(tokens)):
            if tokens[i] in self.eos:
                return tokens[: i + 1], "eos"
        if self.stop_strings:
            text = self.tokenizer.decode(tokens)
            for stop in self.stop_strings:
                if stop in text:
                    # the shortest prefix of tokens whose text contains the stop string
                    for n in range(max(1, new_from), len(tokens) + 1):
                        if stop in self.tokenizer.decode(tokens[:n]):
                            return tokens[:n], "stop_string"
        return tokens, None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stopper: Stopper | None = None,
    backend: str = "sdpa",
    engine: str | Engine = "dynamic",
    tree_budget: int | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after the prompt with DFlash speculative decoding (batch 1).

    ``engine``: "dynamic", "static" (a one-off static engine, eager, sized for this call) or an engine
    object built once and reused over many calls (e.g. a compiled, warmed-up ``StaticEngine``).
    ``tree_budget``: verify a tree of that many drafted nodes each round (0 or None: the chain)."""
    s = sampling or Sampling()
    dev = target.device
    B = drafter.config.block_size
    P = len(prompt_ids)
    width = round_width(B, tree_budget)
    dec = make_engine(
        engine, target, drafter, capacity=P + max_new_tokens + width, backend=backend, tree_budget=tree_budget
    )
    dec.reserve(P, max_new_tokens, width)
    gen = new_generator(s, dev)
    _sync(dev)
    t0 = time.perf_counter()

    # Prefill: the target reads the prompt; its features become the drafter's first context rows.
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    logits, context = dec.prefill(prompt)
    new: list[int] = [int(choose(logits, s, gen))]
    _sync(dev)
    out = Generation(tokens=new)
    out.prefill_seconds = time.perf_counter() - t0

    stopped = stopper.check(new, 0)[1] if stopper else None
    # the graphs engine runs a greedy round, chain or tree, a sampled chain round under the rejection rule and
    # a sampled tree round as one step (the four stages below, on the device)
    fused = isinstance(dec, GraphEngine) and dec.fuses_rounds(tree_budget) and fuses(s, tree_budget)
    while stopped is None and len(new) < max_new_tokens:
        if fused:
            assert isinstance(dec, GraphEngine)
            anchor = new[-1] if not out.accept_lengths else None
            if s.greedy:
                committed = dec.greedy_round(anchor, bool(tree_budget))
            else:
                committed = dec.sampled_round(anchor, s, gen, tree=bool(tree_budget))
            path: list[int] = list(range(len(committed)))
        else:
            # 1. draft: the drafter reads the new context rows and fills [anchor, MASK x (B-1)]
            draft_logits = dec.draft(context, new[-1])  # [B-1, V]
            # 2. verify and 3. accept: the accepted path (node ids) and the committed tokens
            if tree_budget:
                verified, path, committed = _tree_round(dec, new[-1], draft_logits, tree_budget, s, gen)
            else:
                verified, path, committed = _chain_round(dec, new[-1], draft_logits, s, gen)
        room = max_new_tokens - len(new)
        before = len(new)
        new.extend(committed[:room])
        out.accept_lengths.append(len(path))  # tau of this round (the last round may commit fewer)
        if stopper is not None:
            trimmed, stopped = stopper.check(new, before)
            del new[len(trimmed) :]
        if not fused:
            # 4. keep: the caches hold the accepted path; its features are the drafter's next context
            context = dec.keep(verified, path)
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    out.stopped = stopped or "length"
    return out


def fuses(s: Sampling, tree_budget: int | None) -> bool:
    """Whether a round of these settings runs as one step on an engine that fuses rounds: a greedy chain or
    tree, a sampled chain under the rejection rule, or a sampled tree (a tree always takes the exact rule)."""
    return s.greedy or bool(tree_budget) or s.rule == "rejection"


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


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stopper: Stopper | None = None,
    layer_ids: Sequence[int] = (0,),
    engine: str | Engine = "dynamic",
) -> Generation:
    """The baseline on the same engine: same target, same cache, same kernels, one token per pass.
    ``engine`` as for ``speculative_generate`` (an engine object brings its own layer ids)."""
    s = sampling or Sampling()
    dev = target.device
    P = len(prompt_ids)
    dec = make_engine(engine, target, capacity=P + max_new_tokens + 1, layer_ids=layer_ids)
    dec.reserve(P, max_new_tokens, 1)
    gen = new_generator(s, dev)
    _sync(dev)
    t0 = time.perf_counter()
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    token = choose(dec.prefill(prompt)[0], s, gen)  # on the device: the next step's input, no copy back
    new = [int(token)]
    _sync(dev)
    out = Generation(tokens=new)
    out.prefill_seconds = time.perf_counter() - t0
    stopped = stopper.check(new, 0)[1] if stopper else None
    # the graphs engine runs the target step and the choice of the next token as one step
    one_step = isinstance(dec, GraphEngine) and dec.fused_rounds
    while stopped is None and len(new) < max_new_tokens:
        if one_step:
            assert isinstance(dec, GraphEngine)
            token = dec.next_token(token, s, gen)
        else:
            logits = dec.verify(token.view(1, 1)).logits  # nothing to keep: every token is committed
            token = choose(logits[-1], s, gen)
        new.append(int(token))
        out.accept_lengths.append(1)
        if stopper is not None:
            trimmed, stopped = stopper.check(new, len(new) - 1)
            del new[len(trimmed) :]
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    out.stopped = stopped or "length"
    return out
