"""A greedy tree round's small steps around the target's tree step, measured side by side: the argmax of
logits rows, the tree's build from the drafted logits, and the round's tail (the next round's state) in
torch against the kernels of ``dflashkit.infer.tree_kernels``.

    python benchmarks/round_glue.py --out round_glue.json     # GPU: the table and its JSON
    python benchmarks/round_glue.py --smoke                   # CPU (Triton's interpreter): every variant once

A profile of the round (decode_steps.py --profile) showed these steps at ~0.08 ms of a 0.86 ms tree round:
torch's argmax over [16, 49,152] logits 0.013 ms, the build's two kernels 0.049, a dozen small copies. Each
variant is captured as a CUDA graph of --reps calls and replayed (the median of --replays, per call), as the
engine replays its round; every variant's output is checked against torch's first. Shapes are the embedded
target's (vocabulary 49,152, 576 x 5 context features) and its drafter's (block 8, trees of --nodes).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import

import torch

from dflashkit.infer import tree_kernels
from dflashkit.infer.graph_engine import finish_step
from dflashkit.infer.tree import build_tree, tree_candidates
from report import write_json


def timed(call: Callable[[], None], reps: int, replays: int, device: torch.device) -> float:
    """Milliseconds a call: ``reps`` calls captured as one CUDA graph, replayed ``replays`` times (median; as
    kernel_tiles.py times a step)."""
    if device.type != "cuda":  # the smoke run: every call already ran once, checked
        return float("nan")
    from kernel_tiles import replay_ms

    return replay_ms(call, replays, reps)


def argmax_rows(args, dev: torch.device) -> list[dict]:
    out = []
    gen = torch.Generator().manual_seed(0)
    for rows in args.rows:
        logits = (torch.randn(rows, args.vocab, generator=gen) * 3).to(dev)
        choice = torch.empty(rows, dtype=torch.long, device=dev)
        ref = logits.argmax(-1)
        row = {
            "rows": rows,
            "torch_ms": timed(lambda x=logits, y=choice: y.copy_(x.argmax(-1)), args.reps, args.replays, dev),
        }
        for chunk in args.chunks:
            choice.fill_(-1)
            tree_kernels.argmax(logits, choice, chunk=chunk)
            if not torch.equal(choice, ref):
                raise SystemExit(f"argmax of chunks of {chunk}: not torch's argmax")
            row[f"chunks{chunk}_ms"] = timed(
                lambda c=chunk, x=logits, y=choice: tree_kernels.argmax(x, y, chunk=c),
                args.reps,
                args.replays,
                dev,
            )
        out.append(row)
        print(
            f"argmax [{rows}, {args.vocab}]: "
            + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k != "rows")
        )
    return out


def build_rows(args, dev: torch.device) -> list[dict]:
    depth = args.block - 1
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(depth, args.vocab, generator=gen) * 4).to(dev)
    candidates = tree_candidates(depth, args.vocab, args.nodes, dev)
    anchor = torch.tensor([5], device=dev)
    nodes = torch.empty(3, args.nodes + 1, dtype=torch.long, device=dev)
    ref = build_tree(anchor, torch.softmax(logits, dim=-1), args.nodes, candidates).nodes
    row: dict = {"nodes": args.nodes, "candidates": candidates.shape[1]}
    for chunk in args.build_chunks:  # the logits a program of the chunks' top-k reads
        nodes.fill_(-1)
        tree_kernels.build_from_logits(anchor, logits, candidates, nodes, chunk=chunk)
        if not torch.equal(nodes, ref):
            raise SystemExit(f"the build from logits in chunks of {chunk}: not build_tree's nodes")
        name = "kernels_ms" if chunk == tree_kernels.LOGITS_CHUNK else f"kernels_chunks{chunk}_ms"
        row[name] = timed(
            lambda c=chunk: tree_kernels.build_from_logits(anchor, logits, candidates, nodes, chunk=c),
            args.reps, args.replays, dev,
        )  # fmt: skip
    # the top-k of every chunk alone (the build's first launch), in the default's chunks
    vocab, chunk = args.vocab, min(tree_kernels.LOGITS_CHUNK, tree_kernels._block(args.vocab))
    chunks, k = -(-vocab // chunk), min(tree_kernels._block(args.nodes), chunk)
    keys = torch.empty(depth, chunks, k, dtype=torch.long, device=dev)
    maxes = torch.empty(depth, chunks, device=dev)
    sums = torch.empty(depth, chunks, device=dev)

    def top() -> None:
        tree_kernels.top_kernel[(depth, chunks)](
            logits, keys, maxes, sums, V=vocab, CHUNK=chunk, CHUNKS=chunks, K=k, num_warps=4
        )

    row["top_kernel_ms"] = timed(top, args.reps, args.replays, dev)
    # the torch build (softmax, top-k, the build's torch ops), for scale
    row["torch_build_ms"] = timed(
        lambda: nodes.copy_(build_tree(anchor, torch.softmax(logits, dim=-1), args.nodes, candidates).nodes),
        args.reps, args.replays, dev,
    )  # fmt: skip
    print("build from logits: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items() if k.endswith("_ms")))
    return [row]


def finish_rows(args, dev: torch.device) -> list[dict]:
    """The round's tail after the walk and the keep: torch's ops (``graph_engine.finish_step``) against
    ``tree_kernels.finish``."""
    n, b, width = args.nodes + 1, args.block, args.width
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(args.block - 1, args.vocab, generator=gen) * 4).to(dev)
    nodes = build_tree(5, torch.softmax(logits, dim=-1), args.nodes).nodes
    choices = nodes[0].roll(-1)  # a path down the first nodes
    start = torch.tensor([100], device=dev)
    walked = torch.empty(2 * n + 1, dtype=torch.long, device=dev)
    moves = torch.empty(2, n, dtype=torch.long, device=dev)
    tree_kernels.walk(nodes, choices, start, walked, moves)
    tree_rows = torch.randn(1, n, width, generator=gen).to(dev, torch.bfloat16)
    state = [
        torch.full((1, b, width), -1, dtype=torch.bfloat16, device=dev),
        torch.full((b + 1,), -1, dtype=torch.long, device=dev),
        torch.full((1,), -1, dtype=torch.long, device=dev),
        torch.zeros(1, dtype=torch.long, device=dev),
        torch.full((1, b), -1, dtype=torch.long, device=dev),
    ]
    first = [t.clone() for t in state]
    rows, round_out, row_start, block_start, block = state

    def in_torch() -> None:
        finish_step(
            walked, moves, start, nodes, tree_rows[0], rows[0], round_out, row_start, block_start, block[0]
        )

    def by_kernel() -> None:
        tree_kernels.finish(
            walked, moves, start, nodes, tree_rows[0], rows[0], round_out, row_start, block_start, block[0]
        )

    in_torch()
    ref = [t.clone() for t in state]
    for t, was in zip(state, first, strict=True):
        t.copy_(was)
    by_kernel()
    wrong = [
        name
        for name, a, r in zip(
            ["rows", "round_out", "row_start", "block_start", "block"], state, ref, strict=True
        )
        if not torch.equal(a, r)
    ]
    if wrong:
        raise SystemExit(f"the finish kernel: not the torch tail's {', '.join(wrong)}")
    row = {
        "torch_ms": timed(in_torch, args.reps, args.replays, dev),
        "kernel_ms": timed(by_kernel, args.reps, args.replays, dev),
    }
    print("round tail: " + ", ".join(f"{k} {v:.4f}" for k, v in row.items()))
    return [row]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, small shapes, untimed")
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--block", type=int, default=8)
    p.add_argument(
        "--nodes", type=int, default=15, help="drafted nodes of the tree (its width less the root)"
    )
    p.add_argument("--width", type=int, default=5 * 576, help="context features a node")
    p.add_argument("--rows", type=lambda s: [int(x) for x in s.split(",")], default=[1, 7, 8, 16])
    p.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096])
    p.add_argument(
        "--build-chunks",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[tree_kernels.LOGITS_CHUNK],
        help="the build's top-k chunks to time (the logits a program of its first launch reads)",
    )
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.smoke:
        args.vocab, args.width, args.rows, args.chunks = 3000, 300, [1, 3], [1024]
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    result = {
        "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        "torch": torch.__version__,
        "argmax": argmax_rows(args, dev),
        "build": build_rows(args, dev),
        "finish": finish_rows(args, dev),
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
