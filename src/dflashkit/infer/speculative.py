"""The DFlash draft/verify loop, and the autoregressive baseline on the same engine.

One round, batch 1:
  1. the drafter sees the context rows it has not seen yet (target features of newly committed
     positions) and drafts the whole block [anchor, MASK x (B-1)] in one pass: B-1 draft tokens;
  2. the target verifies [anchor, d1 .. d_{B-1}] in one pass;
  3. the longest acceptable prefix is committed, plus one token from the target (the bonus), so every
     round commits between 1 and B tokens (the acceptance length tau);
  4. the target cache is cropped to the committed length; the drafter's cache only ever holds context
     rows, so it needs no crop; the bonus token is the next anchor.

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
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch
from torch import Tensor

from dflashkit.infer.engine import Engine, make_engine
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel

Rule = Literal["exact", "rejection"]


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    rule: Rule = "exact"
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


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


def probabilities(logits: Tensor, s: Sampling) -> Tensor:
    """The distribution tokens are drawn from: softmax(logits / T), restricted to the top-p nucleus."""
    probs = torch.softmax(logits.float() / s.temperature, dim=-1)
    if s.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        keep = sorted_p.cumsum(-1) - sorted_p < s.top_p  # the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def choose(logits: Tensor, s: Sampling, gen: torch.Generator | None) -> Tensor:
    """One token per row of logits [..., V]: argmax when greedy, else a sample."""
    if s.greedy:
        return logits.argmax(-1)
    p = probabilities(logits, s)
    flat = p.reshape(-1, p.shape[-1])
    return torch.multinomial(flat, 1, generator=gen).reshape(p.shape[:-1])


def _new_generator(s: Sampling, device: torch.device) -> torch.Generator | None:
    if s.greedy:
        return None
    g = torch.Generator(device=device)
    if s.seed is not None:
        g.manual_seed(s.seed)
    else:
        g.seed()
    return g


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
) -> Generation:
    """Generate up to ``max_new_tokens`` after the prompt with DFlash speculative decoding (batch 1).

    ``engine``: "dynamic", "static" (a one-off static engine, eager, sized for this call) or an engine
    object built once and reused over many calls (e.g. a compiled, warmed-up ``StaticEngine``)."""
    s = sampling or Sampling()
    dev = target.device
    B = drafter.config.block_size
    P = len(prompt_ids)
    dec = make_engine(engine, target, drafter, capacity=P + max_new_tokens + B, backend=backend)
    dec.reserve(P, max_new_tokens)
    gen = _new_generator(s, dev)
    _sync(dev)
    t0 = time.perf_counter()

    # Prefill: the target reads the prompt; its features become the drafter's first context rows.
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    first = int(choose(dec.prefill(prompt), s, gen))
    new: list[int] = [first]
    start = P  # position of the newest committed token: the next anchor
    _sync(dev)
    out = Generation(tokens=new)
    out.prefill_seconds = time.perf_counter() - t0

    stopped = stopper.check(new, 0)[1] if stopper else None
    while stopped is None and len(new) < max_new_tokens:
        # 1. draft: the block [anchor, MASK x (B-1)] at positions start .. start+B-1
        draft_logits = dec.draft(new[-1], start)  # [B-1, V]
        drafts = choose(draft_logits, s, gen)  # [B-1]
        # 2. verify: the target reads the anchor and the drafts at positions start .. start+B-1
        block = torch.cat([drafts.new_full((1,), new[-1]), drafts])[None]
        logits = dec.verify(block)  # [B, V]: logits[i] is the target's distribution for position start+i+1
        # 3. accept
        if s.greedy or s.rule == "exact":
            acc, committed = _exact(drafts, choose(logits, s, gen))
        else:
            acc, committed = _rejection(drafts, draft_logits, logits, s, gen)
        room = max_new_tokens - len(new)
        committed = committed[:room]
        before = len(new)
        new.extend(committed)
        out.accept_lengths.append(acc + 1)  # tau of this round (the last round may commit fewer)
        if stopper is not None:
            trimmed, stopped = stopper.check(new, before)
            del new[len(trimmed) :]
        # 4. crop: keep the anchor and the accepted drafts; their features feed the drafter next round
        kept = acc + 1
        dec.crop(start + kept)
        start += kept
    _sync(dev)
    out.seconds = time.perf_counter() - t0
    out.stopped = stopped or "length"
    return out


def _exact(drafts: Tensor, choices: Tensor) -> tuple[int, list[int]]:
    """The exact rule over one block: drafts [B-1] are accepted while they equal the target's own tokens
    choices [B]; then the target's token follows. Returns (accepted drafts, committed tokens); one copy
    from the device."""
    n = drafts.shape[0]
    both = torch.cat([drafts, choices]).tolist()
    d, c = both[:n], both[n:]
    acc = next((i for i in range(n) if d[i] != c[i]), n)
    return acc, d[:acc] + [c[acc]]


def _rejection(
    drafts: Tensor, draft_logits: Tensor, target_logits: Tensor, s: Sampling, gen: torch.Generator | None
) -> tuple[int, list[int]]:
    """Speculative rejection sampling over one block. Returns (accepted drafts, committed tokens)."""
    q = probabilities(draft_logits, s)  # [B-1, V]
    p = probabilities(target_logits, s)  # [B, V]
    n = drafts.shape[0]
    idx = torch.arange(n, device=drafts.device)
    ratio = (p[idx, drafts] / q[idx, drafts]).clamp(max=1.0)
    u = torch.rand(n, generator=gen, device=drafts.device)
    ok = (u < ratio).long().cumprod(0)
    acc = int(ok.sum())
    if acc < n:
        residual = (p[acc] - q[acc]).clamp(min=0)
        total = residual.sum()
        dist = residual / total if total > 0 else p[acc]
        extra = int(torch.multinomial(dist, 1, generator=gen))
    else:
        extra = int(torch.multinomial(p[n], 1, generator=gen))
    return acc, drafts[:acc].tolist() + [extra]


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
    dec.reserve(P, max_new_tokens)
    gen = _new_generator(s, dev)
    _sync(dev)
    t0 = time.perf_counter()
    prompt = torch.tensor([list(prompt_ids)], dtype=torch.long, device=dev)
    token = choose(dec.prefill(prompt), s, gen)  # on the device: the next step's input, no copy back
    new = [int(token)]
    _sync(dev)
    out = Generation(tokens=new)
    out.prefill_seconds = time.perf_counter() - t0
    stopped = stopper.check(new, 0)[1] if stopper else None
    while stopped is None and len(new) < max_new_tokens:
        logits = dec.verify(token.view(1, 1))
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
