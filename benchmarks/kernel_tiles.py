"""The decoder kernels' tiles, measured: each kernel's device time per step under several ``Tiles``, and the
whole target step captured as a CUDA graph, beside the "graphs-layers" engine's step (one compiled decoder
layer for all) on the same random target of the embedded target's shape.

    python benchmarks/kernel_tiles.py                  # GPU: the table; --out for its JSON
    python benchmarks/kernel_tiles.py --smoke          # CPU (Triton's interpreter), a tiny target, 2 variants

For each variant and step shape (one token, a block of 8, a token tree of --tree-nodes nodes past its root,
as a tree round verifies it) over a cache of --context positions:
- ``step ms``: the step captured as one CUDA graph, replayed (median of --calls);
- ``kernel ms``: each kernel's device time per step under the torch profiler (the step uncaptured), so the
  best tile of each kernel can be read off, and what the kernels sum to against the replay (the launches'
  gaps).
Timing does not depend on the weights: random ones, nothing to carry.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

if "--smoke" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton's first import

import torch

from dflashkit.infer.tree import ancestors, build_tree
from dflashkit.target.kernels import KERNELS, Tiles, decode_by_kernels
from dflashkit.target.slot_decoder import DecoderWeights, SlotCache
from report import write_json

VARIANTS = {
    "default": Tiles(),
    "warps2": Tiles(warps=2),
    "warps8": Tiles(warps=8),
    "products8k": Tiles(products=8192),
    "columns8": Tiles(qkv_columns=8, up_columns=8, residual_columns=8),
    "columns2": Tiles(qkv_columns=2, up_columns=2, residual_columns=2),
    "splits4": Tiles(splits=4),
    "splits16": Tiles(splits=16),
    "block32": Tiles(block_columns=32),
    "inner64": Tiles(block_inner=64),
    "inner128": Tiles(block_inner=128),
    "inner512": Tiles(block_inner=512),
    "inner256": Tiles(block_inner=256),  # (the default before 2026-12-06)
    "inner1024": Tiles(block_inner=1024),
    "ksplit1": Tiles(residual_splits=1),
    "ksplit2": Tiles(residual_splits=2),
    "ksplit8": Tiles(residual_splits=8),
    "inner512-ksplit2": Tiles(block_inner=512, residual_splits=2),
    # split-K in a block's qkv and up kernels: 4 shares each by default (measured 2026-12-05); 60 and 96
    # programs of 16 columns without
    "qusplit1": Tiles(qkv_splits=1, up_splits=1),
    "qsplit4": Tiles(qkv_splits=4, up_splits=1),
    "usplit4": Tiles(qkv_splits=1, up_splits=4),
    "qusplit2": Tiles(qkv_splits=2, up_splits=2),
    "qusplit8": Tiles(qkv_splits=8, up_splits=8),
    "qsplit8": Tiles(qkv_splits=8),  # (a drafter's qkv: one head a program, 15 column tiles)
    "fusedmerge": Tiles(merge_in_attention=True),  # no merge kernel: the attention's last split merges
    # fewer attention programs along the positions for a drafter's short context (measured: slower)
    "splits2": Tiles(splits=2),
    "splits2-fusedmerge": Tiles(splits=2, merge_in_attention=True),
    # a tree's matmul step (more than 16 rows; 256 by default, as 16 rows')
    "treeinner128": Tiles(tree_inner=128),
    "treeinner512": Tiles(tree_inner=512),
    # an attention program's rows (64 by default): a tree of 16 rows (48 query rows a group, padded to 64) in two
    # or four programs a head group; a block of 8 (24 rows) unchanged at 32, in two at 16
    "arows32": Tiles(attention_rows=32),
    "arows16": Tiles(attention_rows=16),
    # a block's and a tree's matmul kernels in 2, 1 or 8 warps a program (tl.dot's 16 x 16 tile is two m16n8
    # products: 4 warps repeat half of it), alone and with 32 columns a program (block32: 4 warps)
    "bwarps2": Tiles(block_warps=2),
    "bwarps1": Tiles(block_warps=1),
    "bwarps8": Tiles(block_warps=8),
    "bwarps2-block32": Tiles(block_warps=2, block_columns=32),
    "bwarps2-inner128": Tiles(block_warps=2, block_inner=128),  # bwarps2's output projection spills at 256
    # 16, 32 (the default since 2026-12-06) or 64 columns a block's program, with the split-K shares around it
    "block16": Tiles(block_columns=16),
    "block64": Tiles(block_columns=64),
    "block32-inner128": Tiles(block_columns=32, block_inner=128),
    "block32-inner512": Tiles(block_columns=32, block_inner=512),
    "block32-qusplit8": Tiles(block_columns=32, qkv_splits=8, up_splits=8),
    "block32-ksplit8": Tiles(block_columns=32, residual_splits=8),
    "block32-split8": Tiles(block_columns=32, qkv_splits=8, up_splits=8, residual_splits=8),
    "block64-split8": Tiles(block_columns=64, qkv_splits=8, up_splits=8, residual_splits=8),
    # a tree of more than 16 rows in 32 columns a program (16 by default: 32 spills at 32 rows)
    "treecolumns32": Tiles(tree_columns=32),
    "treecolumns32-inner128": Tiles(tree_columns=32, tree_inner=128),
    # a tree's rows past 16 in tiles of 16 rows, each a program of its own with a block's columns and inner step
    # (at 32 rows in one tile the gate/up program holds 255 registers a thread: two programs a multiprocessor);
    # the default since the forty-first session, and treerows0 the tile of all rows before it
    "treerows16": Tiles(tree_rows=16),
    "treerows0": Tiles(tree_rows=0),
    "treerows16-inner256": Tiles(tree_rows=16, block_inner=256),
    # (a block's or a tree's matmuls as the token's matrix-vector products, variants mv8-mv32: measured 2.5-12x
    # slower than tl.dot, thirty-first session, and taken out: benchmarks/NOTES.md)
    # each kernel launched after the one before it has ended (the default launches it while that one runs,
    # its first weight tile read: programmatic dependent launch, measured 2026-12-05)
    "serial": Tiles(pdl=False),
    # split-K 8 for the projections back to the residual: their kernel time at 16 rows -0.015 ms a step, the
    # captured tree step +0.06 ms (2026-12-06, one H100, twice): with and without dependent launch
    "ksplit8-serial": Tiles(residual_splits=8, pdl=False),
    # the same with only the residual kernels launched plainly (every other kernel by dependent launch)
    "rserial": Tiles(residual_pdl=False),
    "ksplit8-rserial": Tiles(residual_splits=8, residual_pdl=False),
}


def random_model(smoke: bool, device: str, dtype: torch.dtype):
    """A random Llama of the embedded target's shape (``smoke``: a tiny one)."""
    import transformers

    shape = (
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=320, max_position_embeddings=512)
        if smoke
        else dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                  num_key_value_heads=3, vocab_size=49152, max_position_embeddings=8192)
    )  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        return transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig(tie_word_embeddings=True, **shape), dtype=dtype
        )


def tree_nodes(vocab: int, nodes: int, device: str) -> torch.Tensor:
    """[3, nodes + 1] (token, depth, parent): the tree a round would build from a drafter's 7 slots of
    fairly confident guesses (random), as the engine's tree step takes it."""
    probs = torch.softmax(torch.randn(7, vocab, generator=torch.Generator().manual_seed(0)) * 4, dim=-1)
    return build_tree(5, probs, nodes).nodes.to(device)


def step_fn(w, cache, m: int, context: int, tiles: Tiles, tree: torch.Tensor | None = None):
    """A target step of m new tokens (or of the ``tree``'s nodes) after ``context`` cached positions, over
    fixed buffers."""
    dev = w.device
    start = torch.tensor([context], device=dev)
    if tree is not None:
        ids, m = tree[:1], tree.shape[1]
        shape = dict(positions=start + tree[1], seen=ancestors(tree[2]))
    else:
        ids, shape = torch.randint(5, w.vocab_size - 1, (1, m), device=dev), {}
    out = torch.empty(m, w.vocab_size, dtype=torch.float32, device=dev)
    return lambda: decode_by_kernels(w, cache, ids, start, out, tiles=tiles, **shape)


def replay_ms(fn, calls: int, reps: int = 1) -> float:
    """Median ms of the step captured as one CUDA graph (the first call compiles, the second warms), over
    ``calls`` replays; ``reps``: the graph holds that many calls in a row and a call's ms is a replay's share
    (for steps of a few microseconds, whose replay would be mostly the events' own time)."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            fn()
    times = []
    for _ in range(calls):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / reps)
    return statistics.median(times)


def kernel_ms(fn, calls: int) -> dict[str, float]:
    """Device ms per step of each decoder kernel (and "rest": the embedding and the head), the step
    uncaptured under the torch profiler (``decode_steps.profile_calls``)."""
    from decode_steps import profile_calls

    by: dict[str, float] = {}
    for k in profile_calls(fn, calls)["top_kernels"]:
        name = next((n for n in KERNELS if k["name"].startswith(f"{n}_kernel")), "rest")
        by[name] = by.get(name, 0.0) + k["ms_per_step"]
    return by


def layers_engine_ms(
    w_folder: Path, capacity: int, context: int, calls: int, tree: torch.Tensor
) -> dict[str, float]:
    """The "graphs-layers" engine's target steps [1, 1] and [1, 8] and its tree step over ``tree``, captured
    as it captures them."""
    from dflashkit.infer.graph_engine import GraphEngine
    from dflashkit.target.hf import TargetModel

    target = TargetModel.load(w_folder, dtype=torch.bfloat16, device="cuda", lazy=True)
    nodes = tree.shape[1] - 1
    engine = GraphEngine(
        target, None, capacity=capacity, layer_ids=[1, 15, 28], compile="layers", tree_budget=nodes
    )
    # an engine without a drafter has the one-token step only: give it the [1, 8] step's buffers (no features
    # kept: the kernels' step above keeps none either)
    engine.block_size = 8
    engine._ids[8] = torch.zeros(1, 8, dtype=torch.long, device="cuda")
    engine._logits[8] = torch.zeros(8, engine.w.vocab_size, device="cuda")
    engine._start.fill_(context)
    engine._tree_inputs.copy_(tree)
    ms = {str(t): replay_ms(lambda t=t: engine._target_step(t), calls) for t in (1, 8)}
    ms["tree"] = replay_ms(engine._tree_step, calls)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--context", type=int, default=400, help="cached positions before the step (400)")
    p.add_argument("--capacity", type=int, default=1024, help="the cache's positions (bench's: 1024)")
    p.add_argument("--calls", type=int, default=200)
    p.add_argument("--tree-nodes", type=int, default=32, help="a tree step's nodes past its root (32)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS")
    p.add_argument("--smoke", action="store_true", help="CPU, Triton's interpreter, a tiny target")
    p.add_argument("--no-layers", action="store_true", help="skip graphs-layers' steps on the same shapes")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args()
    names = args.variants.split(",")
    if args.smoke:  # the kernels run, shapes and launches checked; no timings
        w = DecoderWeights.from_hf(random_model(True, "cpu", torch.float32))
        cache = SlotCache(w, slots=1, capacity=64)
        tree = tree_nodes(w.vocab_size, 8, "cpu")
        for name in names[:2]:
            for m in (1, 8):
                step_fn(w, cache, m, 20, VARIANTS[name])()
            step_fn(w, cache, 0, 20, VARIANTS[name], tree)()
        print(f"smoke: {len(names[:2])} variants x 3 step shapes ran in Triton's interpreter")
        return
    model = random_model(False, "cuda", torch.bfloat16)
    w = DecoderWeights.from_hf(model)
    cache = SlotCache(w, slots=1, capacity=args.capacity)
    cache.keys.normal_()
    cache.values.normal_()
    tree = tree_nodes(w.vocab_size, args.tree_nodes, "cuda")
    rows = []
    steps = {}
    for name in names:  # every variant's captured steps timed first: a profile slows every later launch
        tiles = VARIANTS[name]
        row: dict = {"variant": name, "tiles": asdict(tiles)}
        t0 = time.perf_counter()
        for m in (1, 8, "tree"):
            fn = (
                step_fn(w, cache, 0, args.context, tiles, tree)
                if m == "tree"
                else step_fn(w, cache, m, args.context, tiles)
            )
            row[f"step_ms_{m}"] = replay_ms(fn, args.calls)
            steps[name, m] = fn
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        # said as soon as measured: a command cut by its time limit keeps these
        print(
            f"timed {name}: [1,1] {row['step_ms_1']:.3f} ms  [1,8] {row['step_ms_8']:.3f} ms  "
            f"tree [1,{tree.shape[1]}] {row['step_ms_tree']:.3f} ms  ({row['seconds']:.0f} s)",
            flush=True,
        )
    # the graphs-layers engine's steps on the same shapes (the same random target, from a folder), before
    # any profile too
    import tempfile

    layers: dict | None = None
    if not args.no_layers:
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(Path(tmp) / "target")
            layers = layers_engine_ms(Path(tmp) / "target", args.capacity, args.context, args.calls, tree)
    for row in rows:  # then each kernel's device time, under the profiler
        for m in (1, 8, "tree"):
            row[f"kernel_ms_{m}"] = kernel_ms(steps[row["variant"], m], 20)
        k1 = row["kernel_ms_1"]
        print(
            f"{row['variant']:12s} [1,1] {row['step_ms_1']:.3f} ms (kernels {sum(k1.values()):.3f}: "
            + " ".join(f"{k} {v:.3f}" for k, v in k1.items())
            + f")  [1,8] {row['step_ms_8']:.3f} ms  tree [1,{tree.shape[1]}] {row['step_ms_tree']:.3f} ms"
            + f"  ({row['seconds']:.0f} s)",
            flush=True,
        )
    # each kernel's best tile, from the profiles (the table's lower bound for a mixed Tiles)
    best = {}
    for m in (1, 8, "tree"):
        for k in KERNELS:
            r = min(rows, key=lambda r: r[f"kernel_ms_{m}"].get(k, 1e9))
            if k in r[f"kernel_ms_{m}"]:  # (no merge kernel in a fusedmerge variant)
                best[f"{k} [1,{m}]"] = (r["variant"], r[f"kernel_ms_{m}"][k])
    print("best tile per kernel: " + "; ".join(f"{k}: {v[0]} {v[1]:.4f} ms" for k, v in best.items()))
    if layers is not None:
        print(
            f"graphs-layers   [1,1] {layers['1']:.3f} ms  [1,8] {layers['8']:.3f} ms  tree [1,{tree.shape[1]}] "
            f"{layers['tree']:.3f} ms (the same shapes, side by side)"
        )
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "context": args.context,
        "capacity": args.capacity,
        "tree_nodes": args.tree_nodes,
        "variants": rows,
        "best_per_kernel": best,
        "graphs_layers_ms": layers,
    }
    write_json(args.out, result)


if __name__ == "__main__":
    main()
