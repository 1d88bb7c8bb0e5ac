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

The rounds run on a decode engine (``dflashkit.infer.engine``): "reference" (growing caches, eager; any
target) or "graphs" (preallocated caches, fixed-shape steps captured as CUDA graphs; its rounds one step each
where they can be). Both loops below take the same engine, so speculative and autoregressive decoding are
always compared like for like, and neither asks which engine it has: a round is ``engine.round(...)``
(``dflashkit.infer.round`` holds its separate calls and the acceptance rules), a token
``engine.next_token(...)``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import Engine, make_engine, round_width
from dflashkit.infer.sampling import Sampling, choose, new_generator
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
    engine: str | Engine = "reference",
    tree_budget: int | None = None,
) -> Generation:
    """Generate up to ``max_new_tokens`` after the prompt with DFlash speculative decoding (batch 1).

    ``engine``: "reference", "graphs" (a one-off graphs engine, eager, sized for this call) or an engine
    object built once and reused over many calls (e.g. a warmed-up ``GraphEngine``: ``engine.ready_engine``).
    ``tree_budget``: verify a tree of that many drafted nodes each round (0 or None: the chain)."""
    s = sampling or Sampling()
    dev = target.device
    B = drafter.config.block_size
    P = len(prompt_ids)
    width = round_width(B, tree_budget)
    dec = make_engine(
        engine, target, drafter, capacity=P + max_new_tokens + width, backend=backend, tree_budget=tree_budget
    )
    if tree_budget and s.tree_rule == "recursive" and not s.greedy and dec.name == "graphs":
        raise DflashkitError("recursive trees run on the reference engine only")
    dec.reserve(P, max_new_tokens, width)
    gen = new_generator(s, dev)
    _sync(dev)
    t0 = time.perf_counter()

    # Prefill: the target reads the prompt; its features become the drafter's first context rows.
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    logits, _ = dec.prefill(prompt)
    new: list[int] = [int(choose(logits, s, gen))]
    _sync(dev)
    out = Generation(tokens=new)
    out.prefill_seconds = time.perf_counter() - t0

    stopped = stopper.check(new, 0)[1] if stopper else None
    while stopped is None and len(new) < max_new_tokens:
        # draft, verify (the chain or a tree), accept, keep: the committed tokens and the accepted path
        r = dec.round(new[-1], s, gen, tree_budget)
        room = max_new_tokens - len(new)
        before = len(new)
        new.extend(r.tokens[:room])
        out.accept_lengths.append(len(r.path))  # tau of this round (the last round may commit fewer)
        if stopper is not None:
            trimmed, stopped = stopper.check(new, before)
            del new[len(trimmed) :]
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    out.stopped = stopped or "length"
    return out


@torch.no_grad()
def autoregressive_generate(
    target: TargetModel,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    sampling: Sampling | None = None,
    stopper: Stopper | None = None,
    layer_ids: Sequence[int] = (0,),
    engine: str | Engine = "reference",
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
    while stopped is None and len(new) < max_new_tokens:
        token = dec.next_token(token, s, gen)  # on the device: the next step's input
        new.append(int(token))
        out.accept_lengths.append(1)
        if stopper is not None:
            trimmed, stopped = stopper.check(new, len(new) - 1)
            del new[len(trimmed) :]
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    out.stopped = stopped or "length"
    return out
