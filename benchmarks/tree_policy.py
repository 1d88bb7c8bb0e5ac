"""Which tree does a node budget buy best? Served tau of tree-building policies, replayed from one trace.

At T = 0 a round's accepted path depends on two things only: the drafter's distributions at the round's anchor
and the target's greedy continuation after it. Both are fixed by the prompt, whatever the earlier rounds
accepted (the drafter's context is the committed tokens' target features, and the committed tokens are the
target's greedy ones). So one trace that asks the drafter for its block at *every* position records all that any policy's rounds can meet, and any tree-building policy can be
replayed on it exactly, in milliseconds, without decoding again:

    trace    decode each prompt greedily (float32 by default), read the target's features of the reply in one
             pass, and ask the drafter for its block at every anchor, one context row at a time (the dynamic
             engine); keep each drafted slot's top tokens and probabilities, and the target's continuation (a
             drafted block past the end of the reply included, as the served walk sees it);
    replay   decode each trace with a policy: rounds from the first token, the tree the policy builds from the
             anchor's slots, the walk along the target's tokens, the same stopping rules as serving (EOS, the
             new-token limit), and print tau per policy.

Policies: ``chain`` (each slot's best token), ``product`` (the served build, ``tree.build_tree``: the budget's
best branches by the product of the drafter's probabilities; replayed through ``build_tree`` itself), and two
recalibrations fitted on traces (``--fit``), each the same best-first build on other scores. The product of a
branch's scores should be the chance the whole branch is accepted, the product of each node's chance of
matching the target given that its parent matched; then the budget's best branches maximise the expected
accepted nodes. The drafter's raw marginals are that chance only if it is calibrated, and a slot's marginal
after a branch that left an earlier slot's best token need not be. ``calibrated``: each node's score from a
table of matched rates by depth, by whether the parent's branch holds only best tokens (``on_main``), by best
token or not, and by the drafter's probability (binned). ``scaled``: the drafter's probability times one factor
per (depth, on_main, best or not), the group's matched rate over its mean probability (the order within a
group stays the drafter's). ``--summary`` prints those groups.

A trace keeps each slot's 16 best tokens: replays of budgets up to 16 are exact; a larger budget could want a
slot's 17th token, which the replay lacks (rarely: a slot's 17th token outscores a deeper branch only in a very
flat slot).

    python benchmarks/tree_policy.py trace --drafter benchmarks/drafters/embedded-gpu-more --set mtbench \\
        --max-prompts 48 --max-new-tokens 128 --out /tmp/trace-mtbench.pt
    python benchmarks/tree_policy.py replay /tmp/trace-mtbench.pt --fit /tmp/trace-gsm8k.pt --budgets 8,15,32 --summary
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

TOP = 16  # tokens kept per slot: a tree of up to 16 nodes never uses a slot's 17th token


# --------------------------------------------------------------------------------------------------
# trace


@torch.no_grad()
def trace_response(target, drafter, prompt: list[int], max_new: int, eos: set[int]) -> dict:
    """One response: the target's greedy tokens (``tokens[0]`` from the prefill, a drafted block past the reply's
    end included) and, at every anchor a round can start from, each slot's top tokens and probabilities
    [D, TOP]. The tokens come from a speculative decode (lossless: the target's greedy tokens), their target features
    from one pass over them, and the drafter reads them one row an anchor, as the dynamic engine would after
    rounds that each kept one token."""
    from dflashkit.infer.engine import make_engine
    from dflashkit.infer.round import Context
    from dflashkit.infer.speculative import speculative_generate

    D = drafter.config.block_size - 1
    tokens = speculative_generate(target, drafter, prompt, max_new + D + 1).tokens  # chain rounds
    end = next((i for i, t in enumerate(tokens[:max_new]) if t in eos), max_new - 1)  # the reply's last token
    P, layers = len(prompt), drafter.config.target_layer_ids
    ids = torch.tensor([prompt + tokens[: end + D + 1]])
    logits, features = target.forward_step(ids, target.new_cache(), layers)
    agree = (logits[0, P - 1 :].argmax(-1) == torch.tensor(tokens[: end + D + 2])).float().mean().item()
    engine = make_engine("dynamic", target, drafter, capacity=0)
    engine.prefill(ids[:, :P])  # the drafter's empty cache; the prompt's features are read below
    top_ids, top_probs = [], []
    for j in range(end):  # anchors 0 .. end-1: a round needs a committed token to start from
        context = (
            Context(features[:, :P], 0) if j == 0 else Context(features[:, P + j - 1 : P + j], P + j - 1)
        )
        p = torch.softmax(engine.draft(context, tokens[j]).float(), dim=-1)
        top_p, top_i = p.topk(TOP, dim=-1)
        top_ids.append(top_i.int())
        top_probs.append(top_p)
    empty = torch.zeros(0, D, TOP)
    return {
        "prompt_tokens": P,
        "tokens": tokens[: end + D + 2],
        "end": end,
        "one_pass_agreement": agree,
        "ids": torch.stack(top_ids) if top_ids else empty.int(),
        "probs": torch.stack(top_probs) if top_probs else empty,
    }


def trace(args: argparse.Namespace) -> None:
    from rich.progress import track

    from dflashkit.commands.infer import _eos_ids
    from dflashkit.infer import bench
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.target.hf import TargetModel
    from dflashkit.target.tokenizer import serving_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    target = TargetModel.load("embedded", dtype=dtype, device="cpu")
    drafter = load_drafter(args.drafter, target, dtype=dtype, device="cpu", verify=False).eval()
    tokenizer = serving_tokenizer(target.path)
    eos = set(_eos_ids(target, tokenizer))
    dec = bench.Decoder(target, drafter, tokenizer, list(eos), max_new_tokens=args.max_new_tokens)
    bset = bench.load_set(args.set, limit=args.max_prompts, max_turns=1, data_dir=args.data)
    out = []
    for conv in track(bset.conversations, description=f"tracing {bset.name}"):
        out.append(trace_response(target, drafter, dec.prompt_ids(conv, 0, []), args.max_new_tokens, eos))
    low = min(r["one_pass_agreement"] for r in out)
    print(f"one-pass greedy tokens agree with the decoded ones: lowest {low:.4f} of a response")
    torch.save(
        {
            "set": bset.name,
            "drafter": args.drafter,
            "dtype": args.dtype,
            "max_new_tokens": args.max_new_tokens,
            "eos": sorted(eos),
            "responses": out,
        },
        args.out,
    )
    print(f"{len(out)} responses, {sum(r['end'] + 1 for r in out)} tokens -> {args.out}")


# --------------------------------------------------------------------------------------------------
# replay

# a tree policy: (slot probabilities [D, TOP], budget) -> nodes as (parent node, depth, rank), root first
Policy = Callable[[torch.Tensor, int], list[tuple[int, int, int]]]


def chain_policy(probs: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    D = probs.shape[0]
    return [(-1, 0, 0)] + [(d - 1, d, 0) for d in range(1, D + 1)]


def product_policy(probs: torch.Tensor, budget: int) -> list[tuple[int, int, int]]:
    """The served build itself, on the slots' top tokens (token r of a slot is rank r)."""
    from dflashkit.infer.tree import build_tree

    tree = build_tree(0, probs, budget)
    nodes = zip(tree.parents, tree.depths, tree.tokens, strict=True)
    return [(p, d, r) for i, (p, d, r) in enumerate(nodes) if i == 0 or p >= 0]  # padding dropped


def best_first(score: Callable[[int, int, float, bool], float], probs: torch.Tensor, budget: int):
    """The budget's best nodes by the product of ``score(depth, rank, p, on_main)`` along each branch
    (``on_main``: the parent's branch holds only each slot's best token); scores at most 1, so a parent always
    scores at least its child and the best nodes form a tree."""
    D = probs.shape[0]
    p = probs.tolist()
    nodes = [(-1, 0, 0)]
    # (-score, order pushed, parent, depth, rank, on_main)
    frontier: list[tuple[float, int, int, int, int, bool]] = []
    order = iter(range(1 << 62))  # ties: the node pushed first (shallower, then better ranked)

    def push(parent: int, depth: int, value: float, on_main: bool) -> None:
        if depth > D:
            return
        for r in range(min(budget, len(p[depth - 1]))):
            s = value * score(depth, r, p[depth - 1][r], on_main)
            if s > 0:
                heapq.heappush(frontier, (-s, next(order), parent, depth, r, on_main))

    push(0, 1, 1.0, True)
    while frontier and len(nodes) < budget + 1:
        neg, _, parent, depth, r, on_main = heapq.heappop(frontier)
        nodes.append((parent, depth, r))
        push(len(nodes) - 1, depth + 1, -neg, on_main and r == 0)
    return nodes


def accepted_nodes(nodes: list[tuple[int, int, int]], slot_ids: torch.Tensor, future: Sequence[int]) -> int:
    """The drafted nodes serving's walk (``tree.accepted_path``) accepts: the target's choice after a node of
    depth d is ``future[d]`` wherever the walk can reach it (its branch is the target's tokens so far)."""
    from dflashkit.infer.tree import DraftTree, accepted_path

    tokens = [0] + [int(slot_ids[depth - 1, r]) for _, depth, r in nodes[1:]]
    tree = DraftTree.of(tokens, [parent for parent, _, _ in nodes])
    choices = [future[depth] if depth < len(future) else -1 for _, depth, _ in nodes]
    path, _ = accepted_path(tree, choices)
    return len(path) - 1


def replay_response(r: dict, policy: Policy, budget: int, max_new: int, eos: set[int]) -> list[int]:
    """The rounds of one response under ``policy``, as ``speculative_generate`` runs them: per round its tau."""
    tokens, taus = r["tokens"], []
    n = 1
    stopped = tokens[0] in eos
    while not stopped and n < max_new:
        j = n - 1  # the anchor
        acc = accepted_nodes(
            policy(r["probs"][j], budget), r["ids"][j], tokens[j + 1 : j + 1 + r["ids"].shape[1]]
        )
        taus.append(acc + 1)
        added = tokens[n : n + acc + 1][: max_new - n]
        stopped = any(t in eos for t in added)
        n += len(added)
    return taus


# calibration: a node's chance of matching the target given that its parent matched


def observed_nodes(traces: list[dict]):
    """Every node whose parent is on the target's path, at every anchor of ``traces``: (depth, on_main, rank,
    drafter probability, matched). A slot's top tokens all count under the target's branch while that branch's
    tokens are each within their slot's top tokens; ``on_main``: the branch so far holds only best tokens."""
    for tr in traces:
        for r in tr["responses"]:
            tokens, ids, probs = r["tokens"], r["ids"].tolist(), r["probs"].tolist()
            for j in range(len(ids)):
                on_main = True
                for d in range(1, len(ids[j]) + 1):
                    truth = tokens[j + d] if j + d < len(tokens) else None
                    for rank, (tok, p) in enumerate(zip(ids[j][d - 1], probs[j][d - 1], strict=True)):
                        yield d, on_main, rank, p, tok == truth
                    if truth not in ids[j][d - 1]:
                        break
                    on_main = on_main and ids[j][d - 1][0] == truth


def bin_of(p: float, bins: int) -> int:
    """The bin of -log2 p: ``bins`` a factor of 8, the last one from 2^-12 down."""
    return min(int(-math.log2(max(p, 1e-12)) * bins / 3), 4 * bins - 1)


def fit_calibration(traces: list[dict], bins: int) -> dict:
    """Counts of (matched, nodes) per (depth up to 8, on_main, best token or not, probability bin)."""
    counts: dict[tuple[int, bool, bool, int], list[int]] = {}
    for d, on_main, rank, p, matched in observed_nodes(traces):
        c = counts.setdefault((min(d, 8), on_main, rank == 0, bin_of(p, bins)), [0, 0])
        c[0] += matched
        c[1] += 1
    return {"bins": bins, "counts": counts}


def calibration_summary(traces: list[dict]) -> list[dict]:
    """Per (depth, on_main, best token or not): how often such a node matches the target, beside the
    drafter's mean probability for it."""
    sums: dict[tuple[int, bool, bool], list[float]] = {}
    for d, on_main, rank, p, matched in observed_nodes(traces):
        s = sums.setdefault((d, on_main, rank == 0), [0.0, 0.0, 0.0])
        s[0] += matched
        s[1] += p
        s[2] += 1
    return [
        {"depth": d, "on_main": m, "best": b, "nodes": int(n), "matched": hits / n, "drafter_p": ps / n}
        for (d, m, b), (hits, ps, n) in sorted(sums.items())
    ]


def calibrated_policy(table: dict, prior: float = 4.0) -> Policy:
    """Scores from the fitted table: (matches + prior * p) / (nodes + prior) per key, shrunk toward the drafter's
    probability where the table has few nodes."""
    counts, bins = table["counts"], table["bins"]

    def score(depth: int, rank: int, p: float, on_main: bool) -> float:
        m, n = counts.get((min(depth, 8), on_main, rank == 0, bin_of(p, bins)), (0, 0))
        return min((m + prior * p) / (n + prior), 1.0)

    return lambda probs, budget: best_first(score, probs, budget)


def scaled_policy(summary: list[dict], max_depth: int = 16) -> Policy:
    """The drafter's probabilities times one factor per (depth, on_main, best token or not): the group's
    matched rate over its mean probability (``calibration_summary``), so the order within a group stays the
    drafter's and only the groups' biases move."""
    factor = {
        (row["depth"], row["on_main"], row["best"]): row["matched"] / row["drafter_p"]
        for row in summary
        if row["drafter_p"] > 0 and row["nodes"] >= 50 and row["depth"] <= max_depth
    }

    def score(depth: int, rank: int, p: float, on_main: bool) -> float:
        return min(p * factor.get((depth, on_main, rank == 0), 1.0), 1.0)

    return lambda probs, budget: best_first(score, probs, budget)


def replay(args: argparse.Namespace) -> None:
    traces = [torch.load(t, weights_only=False) for t in args.traces]
    policies: dict[str, Policy] = {
        "chain": chain_policy,
        "product": product_policy,
        "product (best-first)": lambda pr, b: best_first(lambda d, r, p, m: p, pr, b),
    }
    summary = calibration_summary(traces) if args.summary else []
    if summary:
        for row in summary:
            print(
                f"depth {row['depth']:2d} {'main' if row['on_main'] else 'off ':4s} "
                f"{'best ' if row['best'] else 'other'} nodes {row['nodes']:6d} matched {row['matched']:.3f} "
                f"drafter p {row['drafter_p']:.3f}"
            )
    if args.fit:
        fit = [torch.load(t, weights_only=False) for t in args.fit]
        table = fit_calibration(fit, args.bins)
        for prior in args.priors:
            policies[f"calibrated (prior {prior:g})"] = calibrated_policy(table, prior)
        policies["scaled"] = scaled_policy(calibration_summary(fit))
    rows = []
    for tr in traces:
        eos, max_new = set(tr["eos"]), tr["max_new_tokens"]
        chain_tau = None
        runs = [(name, policy, budget) for budget in args.budgets for name, policy in policies.items()]
        for name, policy, budget in runs:
            if name == "chain" and chain_tau is not None:
                continue  # the chain has no budget
            taus = [t for r in tr["responses"] for t in replay_response(r, policy, budget, max_new, eos)]
            tau = sum(taus) / len(taus)
            chain_tau = tau if name == "chain" else chain_tau
            gain = tau / chain_tau - 1 if chain_tau else 0.0
            rows.append(
                {
                    "set": tr["set"],
                    "policy": name,
                    "budget": budget,
                    "rounds": len(taus),
                    "tau": tau,
                    "gain_over_chain": gain,
                }
            )
            label = name if name == "chain" else f"{name}, {budget} nodes"
            print(f"{tr['set']:10s} {label:36s} tau {tau:.3f}  {gain:+.1%}  ({len(taus)} rounds)", flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {
                    "budgets": args.budgets,
                    "traces": args.traces,
                    "fit": args.fit,
                    "rows": rows,
                    "summary": summary,
                },
                indent=1,
            )
            + "\n"
        )


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("trace")
    t.add_argument("--drafter", required=True)
    t.add_argument("--set", default="mtbench")
    t.add_argument("--data", help="dataset folder, for --set heldout")
    t.add_argument("--max-prompts", type=int, default=48)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--dtype", default="float32")
    t.add_argument("--threads", type=int, default=0)
    t.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("replay")
    r.add_argument("traces", nargs="+")
    r.add_argument("--fit", nargs="*", default=[], help="traces to fit the calibrated policy on")
    r.add_argument("--budgets", type=lambda v: [int(b) for b in v.split(",")], default=[15])
    r.add_argument("--bins", type=int, default=4)
    r.add_argument("--priors", type=float, nargs="*", default=[4.0])
    r.add_argument("--summary", action="store_true", help="print matched rates against the drafter's p")
    r.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    trace(args) if args.command == "trace" else replay(args)


if __name__ == "__main__":
    main()
