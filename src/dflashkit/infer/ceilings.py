"""What a drafter can accept at T > 0, per drafted slot, exact from the two distributions (no acceptance noise).

At every round of a decode at temperature T the drafter's block gives q_k for its slots k = 1..D; the target
verifies, in one pass on the reference engine, a tree that holds three things below the anchor (merged where
they share tokens): the argmax chain (a_k = argmax q_k), a marginal chain (m_k raced from q_k) and the tree of
AUTO_TREE_BUDGET nodes `--tree-budget auto` builds (`tree.build_tree`). Its logits give p_T at each node under the
ancestor mask, so for each slot k:

- argmax proposal: accepted with p_k(a_k) once slots 1..k-1 were (a one-hot q); the chain reaches slot k with
  w_k = prod_{j<k} p_j(a_j);
- marginal proposal: accepted with beta_k = sum_x min(p_k(x), q_k(x)) given the drafts before it, which the
  chain reaches with w_k = prod_{j<k} min(1, p_j(m_j) / q_j(m_j)) (an unbiased estimate of reaching k: m is
  drawn from q);
- E[max_x p_k(x)], the argmax chain's ceiling (no token accepts more), and p_k's mass on q_k's top-j tokens
  (j = 1..4: a tree's ceiling at slot k with j children), both where the argmax chain stands;
- the expected tokens of a round: 1 + sum_k E[w_{k+1}] for each chain, and for the tree sum over its nodes of
  the probability that sample-and-match walks into it (the product of p along its branch);
- the expected tokens of a recursive tree of the same budget (``tree{budget}_recursive``,
  `dflashkit.infer.recursive`): each round draws one candidate tree (children without replacement from q, from
  a generator of its own seeded with the sampling seed, so the other figures' draws are unchanged), whose
  branches join the verified tree; for those candidates the expected tokens are exact
  (`recursive.recursive_tree_tokens`); the mean over rounds estimates the expectation over the draws, one
  draw a round.

A slot's conditional acceptance is E[w_k x] / E[w_k] (slots reached more often weigh more: the served order).
The decode itself moves on by sample-and-match over that tree (every committed token a target draw), so the
rounds sit where a decode at T puts them. `choose_proposal` picks the proposal with more expected tokens;
`dflashkit bench` records these figures per set and temperature and serves each set by them (`choose_proposal`, and
`trees_pay` under `--tree-budget auto`); `recorded` reads them back for generate's and eval's
`--draft-sampling auto` and `--tree-budget auto`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from dflashkit.infer.engine import AUTO_TREE_BUDGET, make_engine
from dflashkit.infer.recursive import recursive_tree, recursive_tree_tokens
from dflashkit.infer.sampling import DraftSampling, Sampling, choose, new_generator, probabilities, race
from dflashkit.infer.tree import DraftTree, build_tree

TOP_K = 4  # tree children per slot reported
# What a tree round of AUTO_TREE_BUDGET (15) nodes costs in chain rounds on the graphs engine with Triton layers: measured
# +1.9% (benchmarks/decode_steps.py, greedy, block 16, one H100, 2026-12-07, commit 38baa5d) and +0.7-1.3% on real
# prompts (benchmarks/tree_vs_chain.py, same day); a sampled tree round, whose target draws at every node, is
# not timed apart: a margin of 3%. A sampled tree pays where its expected tokens a round exceed the chain's by
# more (`sampled_trees_pay` for a bench record, `trees_pay` for a set's ceilings measured in the same run).
TREE_ROUND_COST = 1.03
# What --draft-sampling auto takes with no recorded measurement, and why (one line).
DEFAULT_PROPOSAL: DraftSampling = "marginal"
DEFAULT_WHY = (
    "no bench record of this drafter at this temperature: the marginal race (on the embedded target at T=1 it "
    "accepted more than the argmax, tau 1.66-1.88 against 1.35-1.59: CPU, float32, 2026-12-07, issue 60)"
)


@dataclass
class SlotSums:
    """Sums over rounds, per slot (index k-1), of the weighted figures the module docstring names."""

    slots: int
    rounds: int = 0
    argmax_reach: list[float] = field(default_factory=list)
    argmax_accept: list[float] = field(default_factory=list)
    max_p: list[float] = field(default_factory=list)
    top_mass: list[list[float]] = field(default_factory=list)  # [j-1][k-1]: mass on q_k's top j
    marginal_reach: list[float] = field(default_factory=list)
    marginal_accept: list[float] = field(default_factory=list)
    tree_tokens: float = 0.0
    recursive_tokens: float = 0.0

    def __post_init__(self) -> None:
        for name in ("argmax_reach", "argmax_accept", "max_p", "marginal_reach", "marginal_accept"):
            if not getattr(self, name):
                setattr(self, name, [0.0] * self.slots)
        if not self.top_mass:
            self.top_mass = [[0.0] * self.slots for _ in range(TOP_K)]


def merge_branches(anchor: int, branches: Sequence[Sequence[int]]) -> tuple[DraftTree, list[list[int]]]:
    """One tree below ``anchor`` holding every branch (token lists from depth 1), shared prefixes merged;
    returns it and, per branch, its node ids from the root (the root, node 0, first)."""
    tokens, parents = [anchor], [-1]
    child: dict[tuple[int, int], int] = {}
    paths = []
    for branch in branches:
        node, path = 0, [0]
        for token in branch:
            if (node, token) not in child:
                child[(node, token)] = len(tokens)
                tokens.append(token)
                parents.append(node)
            node = child[(node, token)]
            path.append(node)
        paths.append(path)
    return DraftTree.of(tokens, parents), paths


def tree_branches(tree: DraftTree) -> list[list[int]]:
    """Every node's branch (its tokens from depth 1), for the valid nodes of a built tree."""
    tokens, parents = tree.tokens, tree.parents
    out: list[list[int]] = [[]]
    for i in range(1, len(tokens)):
        out.append(out[parents[i]] + [tokens[i]] if parents[i] >= 0 else [])
    return [b for i, b in enumerate(out) if i and parents[i] >= 0]


def round_figures(
    q: Tensor, p: Tensor, argmax_path: list[int], marginal: Tensor, marginal_path: list[int]
) -> dict:
    """One round's per-slot figures from the drafter's q [D, V] and the target's p [n, V] at the merged tree's
    nodes: the argmax chain's and the marginal chain's nodes from the root (D + 1 each), the marginal drafts."""
    D = q.shape[0]
    a = q.argmax(-1)
    at_a = p[argmax_path[:D]]  # p_k where the argmax chain stands before slot k
    p_a = at_a.gather(1, a[:, None])[:, 0]
    top = q.topk(min(TOP_K, q.shape[-1]), dim=-1).indices
    mass = at_a.gather(1, top).cumsum(-1)
    mass = torch.cat([mass, mass[:, -1:].expand(D, TOP_K - mass.shape[1])], dim=1)  # [D, TOP_K]
    at_m = p[marginal_path[:D]]
    beta = torch.minimum(at_m, q).sum(-1)
    ratio = (at_m.gather(1, marginal[:, None])[:, 0] / q.gather(1, marginal[:, None])[:, 0]).clamp(max=1.0)
    ones = torch.ones(1, dtype=p.dtype)
    return {
        "argmax_reach": torch.cat([ones, p_a[:-1]]).cumprod(0),
        "argmax_accept": p_a,
        "max_p": at_a.max(-1).values,
        "top_mass": mass,
        "marginal_reach": torch.cat([ones, ratio[:-1]]).cumprod(0),
        "marginal_accept": beta,
    }


def tree_tokens(tree: DraftTree, p: Tensor, node_of: dict[tuple[int, ...], int]) -> float:
    """Expected tokens of a sample-and-match round over ``tree`` (a built tree; p: the target's distribution at
    each node of the merged tree, ``node_of`` its node per branch): 1 + the probability of walking into each
    node, the product of p along its branch."""
    total = 1.0
    for branch in tree_branches(tree):
        reach, node = 1.0, 0
        for i, token in enumerate(branch):
            reach *= float(p[node, token])
            node = node_of[tuple(branch[: i + 1])]
        total += reach
    return total


@torch.no_grad()
def measure(
    target: Any,
    drafter: Any,
    prompts: Sequence[Sequence[int]],
    s: Sampling,
    max_new_tokens: int,
    eos_ids: Sequence[int] = (),
    budget: int = AUTO_TREE_BUDGET,
    slots: int | None = None,
) -> dict[str, Any]:
    """The ceilings of ``drafter`` at ``s``'s temperature and top-p over ``prompts`` (the module docstring),
    decoded on the reference engine for up to ``max_new_tokens`` each: the figures `summary` reports.
    ``slots``: measure the first drafted slots only (chains and tree that deep; fewer nodes a verify pass):
    the expected tokens are then those of a block of ``slots`` + 1."""
    D = drafter.config.block_size - 1 if slots is None else min(slots, drafter.config.block_size - 1)
    sums = SlotSums(D)
    dec = make_engine("reference", target, drafter)
    gen = new_generator(s, target.device)
    eos = set(eos_ids)
    candidates = torch.Generator(device=target.device).manual_seed(s.seed if s.seed is not None else 0)
    for prompt in prompts:
        logits, context = dec.prefill(torch.tensor([list(prompt)], device=target.device))
        new = [int(choose(logits, s, gen))]
        while len(new) < max_new_tokens and new[-1] not in eos:
            anchor = new[-1]
            q = probabilities(dec.draft(context, anchor)[:D], s)
            marginal = race(q, torch.empty_like(q).exponential_(generator=gen))
            built = build_tree(anchor, q, budget)
            drawn, children = recursive_tree(anchor, q, budget, candidates)
            recursive = tree_branches(drawn)
            branches = [q.argmax(-1).tolist(), marginal.tolist(), *tree_branches(built), *recursive]
            tree, paths = merge_branches(anchor, branches)
            verified = dec.verify_tree(tree.to(target.device))
            p = probabilities(verified.logits, s).cpu()
            node_of = {
                tuple(b[: i + 1]): path[i + 1]
                for b, path in zip(branches, paths, strict=True)
                for i in range(len(b))
            }
            fig = round_figures(q.cpu(), p, paths[0], marginal.cpu(), paths[1])
            _add(sums, fig)
            sums.tree_tokens += tree_tokens(built, p, node_of)
            rows = [0] + [node_of[tuple(b)] for b in recursive]
            sums.recursive_tokens += recursive_tree_tokens(drawn, children, p[rows], q.cpu())
            path, committed = dec.walk(tree.to(target.device), choose(verified.logits, s, gen))
            context = dec.keep(verified, path)
            new.extend(committed)
    return summary(sums, s, len(prompts), budget)


def _add(sums: SlotSums, fig: dict[str, Tensor]) -> None:
    sums.rounds += 1
    for k in range(sums.slots):
        wa, wm = float(fig["argmax_reach"][k]), float(fig["marginal_reach"][k])
        sums.argmax_reach[k] += wa
        sums.argmax_accept[k] += wa * float(fig["argmax_accept"][k])
        sums.max_p[k] += wa * float(fig["max_p"][k])
        for j in range(TOP_K):
            sums.top_mass[j][k] += wa * float(fig["top_mass"][k, j])
        sums.marginal_reach[k] += wm
        sums.marginal_accept[k] += wm * float(fig["marginal_accept"][k])


def summary(sums: SlotSums, s: Sampling, prompts: int, budget: int) -> dict[str, Any]:
    """The recorded figures: per slot, the conditional acceptance of each proposal, E[max p_T] and the mass
    on the top-j children; the expected tokens a round of each chain and of the tree; the proposal chosen."""

    def per_slot(values: list[float], reach: list[float]) -> list[float]:
        return [v / r if r > 0 else 0.0 for v, r in zip(values, reach, strict=True)]

    n = max(sums.rounds, 1)
    chains = {
        "argmax": 1 + sum(sums.argmax_accept) / n,
        "marginal": 1 + sum(sums.marginal_accept) / n,
    }
    out = {
        "temperature": s.temperature,
        "top_p": s.top_p,
        "prompts": prompts,
        "rounds": sums.rounds,
        "slots": sums.slots,
        "max_p": per_slot(sums.max_p, sums.argmax_reach),
        "argmax_acceptance": per_slot(sums.argmax_accept, sums.argmax_reach),
        "marginal_acceptance": per_slot(sums.marginal_accept, sums.marginal_reach),
        "top_k_mass": {str(j + 1): per_slot(sums.top_mass[j], sums.argmax_reach) for j in range(TOP_K)},
        "expected_tokens": {
            **chains,
            f"tree{budget}": sums.tree_tokens / n,
            f"tree{budget}_recursive": sums.recursive_tokens / n,
        },
        "tree_budget": budget,
    }
    out["draft_sampling"] = choose_proposal(out)
    return out


def choose_proposal(figures: dict[str, Any]) -> DraftSampling:
    """The proposal whose chain expects more tokens a round (ties: the marginal race)."""
    tokens = figures["expected_tokens"]
    return "argmax" if tokens["argmax"] > tokens["marginal"] else "marginal"


def recorded(drafter_dir: Path, temperature: float, top_p: float) -> dict[str, Any] | None:
    """The ceilings `dflashkit bench` recorded for this drafter (its weights) at this temperature and top-p in
    its default folder (``<drafter>/../bench``), pooled over sets by rounds; None when there are none."""
    from dflashkit.infer.bench import SETS_DIR, drafter_identity, temperature_key

    folder = Path(drafter_dir).parent / "bench" / SETS_DIR
    if not folder.is_dir():
        return None
    identity, key = drafter_identity(Path(drafter_dir)), temperature_key(temperature)
    found = []
    for path in sorted(folder.glob("*.json")):
        try:
            result = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        settings = result.get("settings", {})
        if settings.get("drafter_weights") != identity or settings.get("top_p", 1.0) != top_p:
            continue
        fig = result.get("temperatures", {}).get(key, {}).get("ceilings")
        if fig and fig.get("rounds"):
            found.append((path.stem, fig))
    if not found:
        return None
    rounds = sum(f["rounds"] for _, f in found)
    tokens: dict[str, float] = {}
    for _, f in found:
        for name, value in f["expected_tokens"].items():
            tokens[name] = tokens.get(name, 0.0) + value * f["rounds"] / rounds
    pooled = {"sets": [name for name, _ in found], "rounds": rounds, "expected_tokens": tokens}
    pooled["draft_sampling"] = choose_proposal(pooled)
    pooled["tree_budget"] = found[0][1].get("tree_budget", AUTO_TREE_BUDGET)
    return pooled


def resolve_draft_sampling(
    requested: str, drafter_dir: Path | None, temperature: float, top_p: float
) -> tuple[DraftSampling, str]:
    """--draft-sampling: "marginal" or "argmax" as given; "auto" the proposal the drafter's bench record at this
    temperature expects more tokens from, else DEFAULT_PROPOSAL. Returns it and one line saying why."""
    if requested in ("marginal", "argmax"):
        return requested, "as given"  # type: ignore[return-value]
    if temperature <= 0:
        return DEFAULT_PROPOSAL, "greedy: no proposal to choose"
    record = recorded(drafter_dir, temperature, top_p) if drafter_dir is not None else None
    if record is None:
        return DEFAULT_PROPOSAL, DEFAULT_WHY
    tokens = record["expected_tokens"]
    return record["draft_sampling"], (
        f"bench's record ({', '.join(record['sets'])}, {record['rounds']} rounds): expected tokens a round "
        f"{tokens['argmax']:.2f} argmax, {tokens['marginal']:.2f} marginal"
    )


def sampled_trees_pay(record: dict[str, Any] | None) -> tuple[bool, str]:
    """Whether a recorded measurement says trees of its budget beat the chain at T > 0: the tree's expected
    tokens a round above the better chain's by more than TREE_ROUND_COST. One line saying why."""
    if record is None:
        return False, "no bench record at this temperature: the chain"
    tokens = record["expected_tokens"]
    tree = tokens.get(f"tree{record['tree_budget']}")
    chain = max(tokens["argmax"], tokens["marginal"])
    if tree is None:
        return False, "the bench record holds no tree: the chain"
    pays = tree > chain * TREE_ROUND_COST
    return pays, (
        f"bench's record: a tree of {record['tree_budget']} expects {tree:.2f} tokens a round, the chain "
        f"{chain:.2f}; a tree round costs {TREE_ROUND_COST:.3f} chain rounds: "
        + ("trees" if pays else "the chain")
    )


def trees_pay(figures: dict[str, Any], proposal: str) -> tuple[bool, dict[str, Any]]:
    """Whether a set's ceilings (`measure`, at one temperature) expect trees of their budget to beat the chain
    of ``proposal``: the tree's expected tokens a round above the chain's by more than TREE_ROUND_COST. Returns
    it and why, as recorded beside the figures: both expected tokens and the round cost."""
    tokens = figures["expected_tokens"]
    name = f"tree{figures['tree_budget']}"
    tree, chain = tokens.get(name), tokens[proposal]
    pays = tree is not None and tree > chain * TREE_ROUND_COST
    why = {
        "expected_tokens": {name: tree, "chain": chain},
        "chain": proposal,
        "tree_round_cost": TREE_ROUND_COST,
    }
    return pays, why
