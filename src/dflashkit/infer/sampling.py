"""Drawing tokens at T > 0, and speculative rejection sampling on the device.

- `Sampling`: temperature, top-p, the acceptance rule, the draft proposal and the seed of one generation.
- `probabilities`: softmax(logits / T), restricted to the top-p nucleus.
- `choose`: one token per row (argmax when greedy, else a sample).
- `race`: a sample from each row of p given Exp(1) noise of its shape, argmax p / noise: the first of
  independent exponential clocks of rates p to ring is token i with probability p_i. It needs no copy to the
  host (torch.multinomial's callers read its result at once) and takes its randomness as a tensor, so a
  captured step (a CUDA graph) can draw from noise written before each replay.
- `propose`: a chain round's drafts and the distribution q they were drawn from, by ``Sampling.draft_sampling``:
  "marginal" races each slot from the drafter's distribution at the temperature (q: that distribution);
  "argmax" takes each slot's most likely token (q: one-hot on it, so the rejection rule accepts it with
  probability p(x) and on rejection draws from p with x removed, renormalised: what z-lab's reference loop,
  vLLM's default and SGLang do). Both keep the target's distribution exactly; which accepts more depends on
  the drafter and the temperature (measured by `dflashkit.infer.ceilings`).
- `rejection_noise` and `accept_sampled`: one chain round's rejection sampling from noise drawn up front,
  on the device: the drafts from `propose`, each accepted with probability min(1, p/q), the token after them
  raced from the residual max(0, p - q) (or from p after a whole block). The round's separate calls and the
  graphs engine's one-step round (`GraphEngine.sampled_round`) both run it, on the same noise drawn in the
  same order, so they commit the same tokens for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Rule = Literal["exact", "rejection"]
DraftSampling = Literal["marginal", "argmax"]
DRAFT_SAMPLINGS: tuple[DraftSampling, ...] = ("marginal", "argmax")
TreeRule = Literal["match", "recursive"]
TREE_RULES: tuple[TreeRule, ...] = ("match", "recursive")


@dataclass
class Sampling:
    temperature: float = 0.0
    top_p: float = 1.0
    rule: Rule = "exact"
    seed: int | None = None
    draft_sampling: DraftSampling = "marginal"  # a chain round's proposal at T > 0 (`propose`)
    tree_rule: TreeRule = "match"  # a tree round's rule at T > 0 (`dflashkit.infer.recursive`)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


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
    """One token per row of logits [..., V]: argmax when greedy, else a sample (raced from Exp(1) noise
    ``gen`` draws, of the logits' shape: what a one-step token of the graphs engine draws)."""
    if s.greedy:
        return logits.argmax(-1)
    p = probabilities(logits, s)
    return race(p, torch.empty_like(p).exponential_(generator=gen))


def new_generator(s: Sampling, device: torch.device) -> torch.Generator | None:
    """The generation's random source: None when greedy, seeded with ``s.seed`` when given."""
    if s.greedy:
        return None
    g = torch.Generator(device=device)
    if s.seed is not None:
        g.manual_seed(s.seed)
    else:
        g.seed()
    return g


def race(p: Tensor, noise: Tensor) -> Tensor:
    """A token per row of p [..., V] (non-negative, any scale) from Exp(1) ``noise`` of its shape: the exponential
    race, argmax p / noise, distributed as p normalised (see the module docstring). A draw of exactly 0 (which
    an exponential sampler can return) is taken as the smallest positive float: 0 / 0 would be NaN, which argmax
    takes as the largest, and would pick a token of probability 0."""
    return (p / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax(-1)


def propose(draft_logits: Tensor, s: Sampling, noise: Tensor) -> tuple[Tensor, Tensor]:
    """A chain round's drafts [D] from the drafter's logits [D, V] at T > 0 and the distribution q [D, V] each
    was drawn from (see the module docstring): "marginal", raced from softmax(logits / T) in top-p with Exp(1)
    ``noise`` [D, V]; "argmax", each slot's most likely token (``noise`` unread), q one-hot on it."""
    if s.draft_sampling == "argmax":
        drafts = draft_logits.argmax(-1)
        q = torch.zeros(draft_logits.shape, dtype=torch.float32, device=draft_logits.device)
        return drafts, q.scatter_(-1, drafts[..., None], 1.0)
    if s.draft_sampling != "marginal":
        raise ValueError(f"draft sampling is one of {', '.join(DRAFT_SAMPLINGS)}, not {s.draft_sampling!r}")
    q = probabilities(draft_logits, s)
    return race(q, noise), q


def rejection_noise(
    block_size: int,
    vocab: int,
    gen: torch.Generator | None,
    device: torch.device,
    out: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """One chain round's randomness, drawn in this order: Exp(1) races [B, V] (rows 0 .. B-2 draw the drafts,
    row B-1 the token after the accepted ones) and uniforms [B-1] (the acceptance tests). ``out``: buffers to
    fill in place (a captured step's inputs)."""
    races, uniforms = (
        out
        if out is not None
        else (
            torch.empty(block_size, vocab, device=device),
            torch.empty(block_size - 1, device=device),
        )
    )
    races.exponential_(generator=gen)
    uniforms.uniform_(generator=gen)
    return races, uniforms


def accept_sampled(
    drafts: Tensor, q: Tensor, p: Tensor, uniforms: Tensor, residual_race: Tensor
) -> tuple[Tensor, Tensor]:
    """Speculative rejection sampling over one block, on the device: drafts [B-1] drawn from q [B-1, V]
    (`propose`'s), the target's p [B, V] (p[i]: its distribution for the token after block[i]). Draft i is kept
    while uniforms[i] < min(1, p_i(d_i) / q_i(d_i)); the token after the n kept ones is raced
    (``residual_race`` [V]) from max(0, p_n - q_n), or from p_n when that is zero everywhere or n = B-1.
    Returns (n [1], that token [1]): the target's own distribution exactly, whatever q."""
    idx = torch.arange(drafts.shape[0], device=drafts.device)
    ratio = (p[idx, drafts] / q[idx, drafts]).clamp(max=1.0)
    n = (uniforms < ratio).long().cumprod(0).sum().view(1)
    past = torch.cat([q, q.new_zeros(1, q.shape[-1])])  # no draft after the block: the residual is p itself
    p_n, q_n = p.index_select(0, n)[0], past.index_select(0, n)[0]
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where(residual.sum() > 0, residual, p_n)
    return n, race(residual, residual_race).view(1)
