"""Decode step costs of the decode engines: what one autoregressive token and one speculative round cost, and so
the speculative speedup each acceptance length can give; and which layers the graphs engine runs faster here.

The graphs engine's steps have fixed shapes, so a round costs the same whatever is accepted: speedup(tau) =
tau x (seconds per autoregressive token) / (seconds per speculative round), exactly. This script measures both
on a random-weight target of the embedded target's shape (SmolLM2-135M: 30 layers, hidden 576, vocabulary 49152;
timing does not depend on the weights, so nothing has to be carried to the GPU) and a random drafter of
the served drafter's shape (3 layers, block 16 since 2026-12-06: `--layers`, `--block`; 5 target layers),
captured and warmed up as the serving commands do. Per dtype it reports:

- the loops: autoregressive ms/token and speculative ms/round from `autoregressive_generate` and
  `speculative_generate` over `--tokens` new tokens (a random drafter is always rejected: one token per round);
- the engine calls alone, each synchronised: target [1, 1], target [1, B], draft [1, B] (ms, median);
- with `--tree-budgets 8,64`: a tree round of each budget on the graphs engine, against the chain's round;
- the break-even acceptance length (round / token) and the speedup at tau = 1.5, 2, 3, 4, B;
- the floor: the target's weight bytes over the measured copy bandwidth (what a step would cost were it
  bound by memory, not by kernel launches and the host);
- with `--profile N` (the graphs engine): the one-token target step run N times uncaptured under the torch
  profiler: kernels per step, their summed device time per step (against the captured step's time: what
  is left is the gaps between kernels) and the kernels that take the most of it.

Engines (``--engines``, side by side): ``graphs`` (its layers by torch, each step one CUDA graph),
``graphs:triton`` (its layers through our Triton kernels) and ``reference`` (eager). Start seconds:
``start_seconds`` is building the engine to the first token in this process; for Triton layers
``warm_start_seconds`` is a second, fresh process (its own empty Triton cache folder) that loads only the
kernel cache file the first one wrote, from its spawn to its first token (interpreter, imports and target
load included; ``warm_start_engine_seconds``: the engine to the first token alone). Torch layers compile
nothing, so their warm start is their start. When both layers were measured, the faster round of the first
dtype is recorded for this device and target shape (``engine.record_layers``), which ``--layers auto`` then
takes (``--no-record-layers``: not).

The report (``$OUT/decode_steps.json``) holds the rows and the issue's summary beside them for the engine
with the fastest autoregressive token of the first dtype: ``round_cost_ar_tokens`` (a round's cost in AR
tokens), ``ar_tok_s``, ``warm_start_s``; ``tree_tau_gain`` and ``cpu_round_cost_ar_tokens`` come from other
measurements: kept from ``benchmarks/results/decode_steps.json`` when it has them, else null.
``--decode-8b-json PATH`` merges issue 64's figures of the engine with the fastest chain round (and every
engine's under "rows") into PATH: the qwen3-8b shape at its top level, qwen3-4b and qwen3-0.6b under "4b" and
"0.6b", another shape under its name.

    python benchmarks/decode_steps.py                  # GPU
    python benchmarks/decode_steps.py --smoke          # CPU, tiny random target, eager
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import TARGET_SHAPES, make_target  # noqa: E402  (the random target)
from report import print_result, run_child, write_report  # noqa: E402

SMOKE_SHAPE = "tiny"
TAUS = (1.5, 2.0, 3.0, 4.0)
RESULTS = Path(__file__).resolve().parent / "results" / "decode_steps.json"
# summary keys other measurements fill (cpu_round.py, tree_vs_chain.py; warm_start.py --update-results writes
# warm_start_s and its block, for the summary's engine)
CARRIED = ("tree_tau_gain", "tree", "cpu_round_cost_ar_tokens", "cpu_round")


def engine_spec(label: str) -> tuple[str, str]:
    """An ``--engines`` label -> (engine, layers): "reference", "graphs" (torch layers), "graphs:triton"."""
    engine, _, layers = label.partition(":")
    if engine not in ("reference", "graphs") or layers not in ("", "torch", "triton"):
        raise SystemExit(
            f"--engines: unknown {label!r}; choose reference, graphs, graphs:torch or graphs:triton"
        )
    return engine, layers or "torch"


def is_graphs(label: str) -> bool:
    return engine_spec(label)[0] == "graphs"


def timed(fn, n: int, device) -> float:
    """Median milliseconds of `fn()` over n calls, each synchronised."""
    import torch

    times = []
    for _ in range(n):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def copy_bandwidth(device) -> float | None:
    """Bytes/s of a large device-to-device copy (the memory floor's denominator); None on the CPU."""
    import torch

    if device.type != "cuda":
        return None
    x = torch.empty(2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    ms = timed(lambda: y.copy_(x), 20, device)
    return 2 * x.numel() / (ms / 1e3)  # read + write


def engine_capacity(args, drafter) -> int:
    """One capacity for every engine of a run (chain, trees, profiles): the steps' shapes include it, so the
    tree and profile engines run the chain engine's step shapes (with Triton layers: its compiled kernels)."""
    from dflashkit.infer.engine import AUTO_TREE_BUDGET

    start = AUTO_TREE_BUDGET if args.start_tree_budget == "auto" else int(args.start_tree_budget)
    widest = max([drafter.config.block_size, *(n + 1 for n in [*args.tree_budgets, start])])
    return args.prompt_len + max(args.tokens, args.calls, args.profile + 8) + widest


def start_tree_budget(engine_name: str, drafter, args) -> int:
    """The tree steps the measured engine builds at its start: --start-tree-budget N, or (auto) the budget
    that `eval` and `bench` serve greedy rounds with on this engine (``resolve_tree_budget``)."""
    from dflashkit.infer.engine import resolve_tree_budget

    requested = None if args.start_tree_budget == "auto" else int(args.start_tree_budget)
    return resolve_tree_budget(requested, *engine_spec(engine_name), drafter.config.block_size, 0.0)


def build_engine(engine_name: str, target, drafter, args, capacity: int, cache: Path | None):
    """The engine and its warm-up (seconds per step shape), with the tree steps of ``start_tree_budget``: a
    start is what a serving command's costs. Triton layers load and write their kernels' binaries in ``cache``."""
    from dflashkit.infer.engine import make_engine
    from dflashkit.infer.graph_engine import GraphEngine, WarmUp

    engine, layers = engine_spec(engine_name)
    if engine == "reference":
        return make_engine("reference", target, drafter), WarmUp()
    graphs = GraphEngine(
        target,
        drafter,
        capacity=capacity,
        graphs=args.compile,
        layers=layers,  # type: ignore[arg-type]
        kernel_cache=cache if layers == "triton" else None,
        tree_budget=start_tree_budget(engine_name, drafter, args) or None,
    )
    return graphs, graphs.warm_up()


def the_prompt(target, args) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(100, target.vocab_size - 1, (args.prompt_len,), generator=g).tolist()


def first_token(target, drafter, engine_name: str, args, cache: Path | None):
    """Build the engine and decode one token: (engine, warm-up, seconds from building to the first token)."""
    from dflashkit.infer.speculative import autoregressive_generate

    prompt = the_prompt(target, args)
    capacity = engine_capacity(args, drafter)
    t0 = time.perf_counter()
    engine, warm = build_engine(engine_name, target, drafter, args, capacity, cache)
    first = autoregressive_generate(
        target, prompt, 1, layer_ids=drafter.config.target_layer_ids, engine=engine
    )
    return engine, warm, time.perf_counter() - t0 - first.seconds + first.prefill_seconds


def cache_report(warm) -> dict:
    """How the kernel cache served a warm-up of Triton layers: the entries it unpacked, and its notes."""
    return {"kernels_loaded": warm.kernels_loaded, "kernel_cache_notes": list(warm.notes)}


def measure(target, drafter, engine_name: str, args, device, cache: Path | None, later: list) -> dict:
    """An engine's start, steps and rounds timed; its profiles appended to ``later``, to run after every
    engine's timings: the torch profiler, once run, leaves every later launch of the process slower (measured
    2026-12-05: a captured step +0.1 ms over its kernels' sum after a profile, equal to it before)."""
    import torch

    from dflashkit.infer.speculative import autoregressive_generate, speculative_generate

    B = drafter.config.block_size
    prompt = the_prompt(target, args)
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        # the start: building the engine (capture every step shape; Triton: compile its kernels) to the first token
        engine, warm, start_seconds = first_token(target, drafter, engine_name, args, cache)
        # the loops, as decode_speed.py times them (prefill excluded); first a short warm-up of each
        autoregressive_generate(target, prompt, 8, layer_ids=layer_ids, engine=engine)
        speculative_generate(target, drafter, prompt, 8, engine=engine)
        ar = [autoregressive_generate(target, prompt, args.tokens, layer_ids=layer_ids, engine=engine)]
        sp = [speculative_generate(target, drafter, prompt, args.tokens, engine=engine)]
        for _ in range(args.repeats - 1):
            ar.append(
                autoregressive_generate(target, prompt, args.tokens, layer_ids=layer_ids, engine=engine)
            )
            sp.append(speculative_generate(target, drafter, prompt, args.tokens, engine=engine))
        token_ms = statistics.median((a.seconds - a.prefill_seconds) * 1e3 / (len(a.tokens) - 1) for a in ar)
        round_ms = statistics.median(
            (s.seconds - s.prefill_seconds) * 1e3 / len(s.accept_lengths) for s in sp
        )
        taus = [t for s in sp for t in s.accept_lengths]
        # the graphs engine: the same round as separate draft, verify and keep calls, side by side
        separate_ms = None
        if getattr(engine, "fused_rounds", False):
            engine.fused_rounds = False
            speculative_generate(target, drafter, prompt, 8, engine=engine)
            runs = [
                speculative_generate(target, drafter, prompt, args.tokens, engine=engine)
                for _ in range(args.repeats)
            ]
            engine.fused_rounds = True
            separate_ms = statistics.median(
                (s.seconds - s.prefill_seconds) * 1e3 / len(s.accept_lengths) for s in runs
            )

        # the engine calls alone, from the end of the prompt: each verify keeps one token (a rejected round;
        # a one-token verify is an autoregressive step, which keeps its token without keep(): the graphs
        # engine computes no features for it), so the cache grows by one per call (a static step's cost does
        # not depend on where it writes)
        def verify(ids):
            verified = engine.verify(ids)
            if ids.shape[1] > 1:
                engine.keep(verified, [0])

        def after_prompt():
            return engine.prefill(torch.tensor([prompt], device=device))[1]

        one = torch.tensor([[prompt[-1]]], device=device)
        block = torch.tensor([prompt[-B:]], device=device)
        calls = {}
        after_prompt()
        calls["target [1, 1]"] = timed(lambda: verify(one), args.calls, device)
        after_prompt()
        calls[f"target [1, {B}]"] = timed(lambda: verify(block), args.calls, device)
        context = after_prompt()
        calls[f"draft [1, {B}]"] = timed(lambda: engine.draft(context, prompt[-1]), args.calls, device)
        trees = tree_rounds(target, drafter, engine_name, args, prompt, round_ms, token_ms, later)
    row = {
        "engine": engine_name,
        "warmup_seconds": dict(warm),
        "start_seconds": start_seconds,
        "start_tree_budget": start_tree_budget(engine_name, drafter, args),
        **cache_report(warm),
        "ms_per_ar_token": token_ms,
        "ms_per_spec_round": round_ms,  # the engine's default round (the graphs engine: one step)
        **({"ms_per_spec_round_separate_calls": separate_ms} if separate_ms is not None else {}),
        "random_drafter_tau": sum(taus) / len(taus),
        "calls_ms": calls,
        "host_and_glue_ms": round_ms - calls[f"target [1, {B}]"] - calls[f"draft [1, {B}]"],
        "break_even_tau": round_ms / token_ms,
        "speedup_at_tau": {str(t): t * token_ms / round_ms for t in (*TAUS, float(B))},
        **({"tree_rounds": trees} if trees else {}),
    }

    def profile() -> None:
        try:
            if out := step_profile(target, drafter, engine_name, args, prompt):
                row["one_token_profile"] = out
        except Exception as e:  # a profiler that fails must not cost the run's other figures
            print(f"profile of {engine_name} failed: {type(e).__name__}: {e}")

    later.append(profile)
    return row


def step_profile(target, drafter, engine_name: str, args, prompt) -> dict:
    """The one-token target step, the draft step and the block step of a graphs engine, uncaptured (the same
    kernels a captured step replays), ``--profile`` times each under the torch profiler: kernels per step,
    their device time per step and the ten kernels that take the most of it."""
    import torch

    if not args.profile or not is_graphs(engine_name) or target.device.type != "cuda":
        return {}
    engine = uncaptured_engine(target, drafter, engine_name, args)
    one = torch.tensor([[prompt[-1]]], device=target.device)
    with torch.no_grad():
        engine.prefill(torch.tensor([prompt], device=target.device))
        out = profile_calls(lambda: engine.verify(one), args.profile)
        print_profile(f"{engine_name} one-token step", out)
        # the draft step too: after the target step, the rest of a round (NOTES: what stands between the
        # round and 1.15 AR tokens)
        context = engine.prefill(torch.tensor([prompt], device=target.device))[1]
        draft = profile_calls(lambda: engine.draft(context, prompt[-1]), args.profile)
        print_profile(f"{engine_name} draft step", draft)
        # the block step, which a chain round waits on (each keeps its first token: the cache grows by one)
        B = engine.block_size
        block = torch.tensor([prompt[-B:]], device=target.device)
        engine.prefill(torch.tensor([prompt], device=target.device))
        verify = profile_calls(lambda: engine.keep(engine.verify(block), [0]), args.profile)
        print_profile(f"{engine_name} block step [1, {B}]", verify)
        # the greedy round as one step, as a chain round replays it: what it runs beyond the draft and block
        # steps is the round's "glue" (0.141 ms on the H200 on 2026-12-04, and on the device: a
        # loop that kept the next round in flight while reading this one gained nothing; RESULTS)
        logits, _ = engine.prefill(torch.tensor([prompt], device=target.device))
        anchor = [int(logits.argmax(-1))]
        rounds = profile_calls(lambda: engine.greedy_round(anchor.pop() if anchor else None), args.profile)
        print_profile(f"{engine_name} greedy round [1, {B}]", rounds)
    return {**out, "draft_step": draft, "block_step": verify, "round_step": rounds}


def uncaptured_engine(target, drafter, engine_name: str, args, tree_budget: int | None = None):
    """A graphs engine whose steps run uncaptured (so the profiler sees each kernel), warmed up, at the run's
    shared capacity and with the measured engine's layers."""
    from dflashkit.infer.graph_engine import GraphEngine

    engine = GraphEngine(
        target,
        drafter,
        capacity=engine_capacity(args, drafter),
        graphs=False,
        fixed_shapes=True,
        layers=engine_spec(engine_name)[1],  # type: ignore[arg-type]
        tree_budget=tree_budget,
    )
    engine.warm_up()
    return engine


def profile_calls(call, n: int, most: int = 10) -> dict:
    """``call`` run n times (after 3 unprofiled) under the torch profiler: kernels per call, their device time
    per call (ms) and the ``most`` kernels that take the most of it."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.time_range.elapsed_us())
    total_us = sum(sum(v) for v in by_name.values())
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:most]
    return {
        "calls": n,
        "kernels_per_step": len(kernels) / n,
        "kernel_ms_per_step": total_us / 1e3 / n,
        "top_kernels": [
            {"name": name[:90], "calls_per_step": len(v) / n, "ms_per_step": sum(v) / 1e3 / n}
            for name, v in top
        ],
    }


def print_profile(label: str, out: dict) -> None:
    print(
        f"{label}, uncaptured: {out['kernels_per_step']:.0f} kernels, "
        f"{out['kernel_ms_per_step']:.3f} ms of kernel time a step; the most:"
    )
    for k in out["top_kernels"]:
        print(f"  {k['ms_per_step']:.4f} ms  x{k['calls_per_step']:.0f}  {k['name']}")


def tree_rounds(
    target,
    drafter,
    engine_name: str,
    args,
    prompt,
    chain_ms: float,
    token_ms: float,
    later: list,
) -> dict:
    """A tree round of each budget (``--tree-budgets``) on this graphs engine, timed as the chain's
    round beside it: ms per round, in AR tokens, and against the chain. The random drafter's trees are
    rejected at the first node, so the keep step moves no rows (a trained drafter's rounds add that copy)."""
    import torch

    from dflashkit.infer.graph_engine import GraphEngine
    from dflashkit.infer.speculative import speculative_generate

    if not args.tree_budgets or not is_graphs(engine_name):
        return {}
    out = {}

    def tree_engine(n: int) -> GraphEngine:
        engine = GraphEngine(
            target,
            drafter,
            capacity=engine_capacity(args, drafter),
            graphs=args.compile,
            layers=engine_spec(engine_name)[1],  # type: ignore[arg-type]
            tree_budget=n,
        )
        engine.warm_up()
        with torch.no_grad():  # first-call costs out of the figures
            speculative_generate(target, drafter, prompt, 8, engine=engine, tree_budget=n)
        return engine

    def ms_per_round(engine: GraphEngine, n: int) -> float:
        """Median ms a round over ``--repeats`` generations of ``--tokens``."""
        with torch.no_grad():
            runs = [
                speculative_generate(target, drafter, prompt, args.tokens, engine=engine, tree_budget=n)
                for _ in range(args.repeats)
            ]
        return statistics.median((r.seconds - r.prefill_seconds) * 1e3 / len(r.accept_lengths) for r in runs)

    for n in args.tree_budgets:
        engine = tree_engine(n)
        ms = ms_per_round(engine, n)
        # the same rounds as separate build, verify, walk and keep calls (the fused round: one step)
        engine.fused_rounds = False
        separate_ms = ms_per_round(engine, n)
        engine.fused_rounds = True
        calls = tree_calls(engine, prompt, n, args, target.device)
        out[str(n)] = {
            "ms_per_round": ms,
            "round_cost_ar_tokens": ms / token_ms,
            "vs_chain": ms / chain_ms - 1,
            "ms_per_round_separate_calls": separate_ms,
            "calls_ms": calls,
        }
        if args.profile and n == args.tree_budgets[0] and target.device.type == "cuda":

            def profile(into: dict = out[str(n)], n: int = n) -> None:
                try:
                    into["tree_step_profile"] = tree_step_profile(
                        target, drafter, engine_name, args, prompt, n
                    )
                except Exception as e:  # a profiler that fails must not cost the run's other figures
                    print(f"profile of the tree step failed: {type(e).__name__}: {e}")

            later.append(profile)  # after every engine's timings (``measure``)
        print(
            f"tree of {n} nodes: {ms:.3f} ms a round, {ms / token_ms:.2f} AR tokens, {ms / chain_ms - 1:+.1%} "
            f"vs chain (separate calls {separate_ms:.3f} ms); calls (ms): "
            + ", ".join(f"{k} {v:.3f}" for k, v in calls.items())
        )
        del engine
    return out


def tree_step_profile(target, drafter, engine_name: str, args, prompt, n: int) -> dict:
    """The tree step [1, n+1] (and its keep of the root) of a graphs engine, uncaptured, under the profiler;
    then the whole greedy rounds, the chain's and the tree's (every kernel of a round as its one step runs
    them, the twenty kernels that take the most: where a tree round's extra time goes)."""
    import torch

    engine = uncaptured_engine(target, drafter, engine_name, args, tree_budget=n)
    with torch.no_grad():
        context = engine.prefill(torch.tensor([prompt], device=target.device))[1]
        probs = torch.softmax(engine.draft(context, prompt[-1]).float(), dim=-1)
        tree = engine.build_tree(prompt[-1], probs, n)
        out = profile_calls(lambda: engine.keep(engine.verify_tree(tree), [0]), args.profile)
        print_profile(f"{engine_name} tree step [1, {n + 1}]", out)
        engine.draft(context, prompt[-1])  # the rounds' state: the context rows, anchor and block start
        rows_at, block_at = int(engine._row_start.item()), int(engine._block_start.item())
        for name, step in (("chain", engine._round_step), ("tree", engine._tree_round_step)):

            def round_at_the_same_place(step=step) -> None:  # two fills (in the profile) keep the cache's end
                engine._row_start.fill_(rows_at)
                engine._block_start.fill_(block_at)
                step()

            out[f"{name}_round"] = profile_calls(round_at_the_same_place, args.profile, most=20)
            print_profile(f"{engine_name} greedy {name} round (tree of {n + 1} nodes)", out[f"{name}_round"])
    return out


def tree_calls(engine, prompt, n: int, args, device) -> dict:
    """A tree round's calls alone, each synchronised (ms, median): the drafted slots' probabilities, the
    build, the tree step (each verify keeps its root: the cache grows by one per call), the walk, the keep,
    and with the kernels the build from the drafted logits that their greedy round runs instead of the
    first two."""
    import torch

    from dflashkit.infer import graph_engine

    with torch.no_grad():
        context = engine.prefill(torch.tensor([prompt], device=device))[1]
        logits = engine.draft(context, prompt[-1])
        probs = torch.softmax(logits.float(), dim=-1)
        tree = engine.build_tree(prompt[-1], probs, n)

        def verify():
            engine.keep(engine.verify_tree(tree), [0])

        calls = {
            "probabilities": timed(lambda: torch.softmax(logits.float(), dim=-1), args.calls, device),
            "build": timed(lambda: engine.build_tree(prompt[-1], probs, n), args.calls, device),
            f"tree step [1, {n + 1}]": timed(verify, args.calls, device),
        }
        verified = engine.verify_tree(tree)
        choices = verified.logits.argmax(dim=-1)
        calls["walk"] = timed(lambda: engine.walk(tree, choices), args.calls, device)
        engine.keep(verified, [0])
        # the keep step alone (every layer's rows of the tree moved at once), as the fused round runs it
        calls["keep"] = timed(lambda: engine.steps.run(("keep",), engine._keep_step), args.calls, device)
        if engine._build_fn is graph_engine.kernel_build_step:
            # the kernels' greedy round builds from the logits (no softmax, no torch top-k), as one replay;
            # last: it overwrites the tree the calls above read
            def from_logits() -> None:
                graph_engine.kernel_logits_build_step(
                    engine._anchor, logits, engine._tree_candidates, engine._tree_inputs
                )

            try:  # a timing that fails must not cost the run's other figures
                calls["build from logits"] = timed(
                    lambda: engine.steps.run(("build from logits", n), from_logits), args.calls, device
                )
            except Exception as e:
                print(f"the build from logits alone failed: {type(e).__name__}: {e}")
    return calls


def main() -> None:
    args = parser().parse_args()
    _main(args)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    ap.add_argument("--layers", type=int, default=3, help="drafter layers (the served drafter's: 3)")
    ap.add_argument(
        "--block",
        type=int,
        default=16,
        help="drafter block size (the served drafter's: 16; 8 before 2026-12-06)",
    )
    ap.add_argument("--target-layers", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per loop")
    ap.add_argument("--repeats", type=int, default=3, help="loops of each kind (median)")
    ap.add_argument("--calls", type=int, default=200, help="timed engine calls of each kind (median)")
    ap.add_argument(
        "--engines",
        default="graphs,graphs:triton",
        help="engines to measure, side by side: graphs (torch layers), graphs:triton, reference",
    )
    ap.add_argument(
        "--tree-budgets",
        type=lambda v: [int(x) for x in v.split(",") if x],
        default=[],
        help="also time tree rounds of these node budgets on the graphs engine, e.g. 8,16,32,64",
    )
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile N uncaptured one-token steps of each graphs engine (kernels, device time; GPU)",
    )
    ap.add_argument(
        "--start-tree-budget",
        default="auto",
        metavar="N|auto",
        help="the tree steps the measured engine builds at its start (and its warm start): auto (the default) "
        "those `eval` and `bench` serve greedy rounds with on that engine (trees of 15 with Triton "
        "layers), 0 the chain's steps alone",
    )
    ap.add_argument(
        "--start-profile",
        type=int,
        default=0,
        metavar="N",
        help="the warm start's N slowest functions (cProfile of the second process's engine build)",
    )
    ap.add_argument(
        "--decode-8b-json",
        type=Path,
        metavar="PATH",
        help="merge this shape's decode figures (issue 64) into PATH: qwen3-8b at its top level, qwen3-4b "
        'and qwen3-0.6b under "4b" and "0.6b", another shape under its name; the other shapes\' kept',
    )
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-warm-start", action="store_true", help="skip the second process (Triton layers)")
    ap.add_argument(
        "--no-record-layers",
        action="store_true",
        help="do not record the faster layers for --layers auto (by default recorded when both were measured)",
    )
    # the warm-start child (internal): a fresh process that loads the kernel cache file
    ap.add_argument("--warm-start-child", metavar="CACHE", help=argparse.SUPPRESS)
    ap.add_argument("--warm-start-engine", default="graphs:triton", help=argparse.SUPPRESS)
    ap.add_argument("--target-folder", help=argparse.SUPPRESS)
    ap.add_argument("--spawned-at", type=float, help=argparse.SUPPRESS)
    return ap


def _main(args: argparse.Namespace) -> None:
    if args.warm_start_child:
        print_result(warm_start_child(args))
        return
    # cold starts: a fresh Triton cache folder for this run (an earlier run's kernels would hide the compile)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="decode-steps-triton-")

    import torch

    from dflashkit.runtime import fingerprint

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.compile = device.type == "cuda"
    if args.smoke:
        args.shape, args.tokens, args.repeats, args.calls, args.target_layers = SMOKE_SHAPE, 24, 1, 3, 2
    engines = args.engines.split(",")
    for name in engines:
        engine_spec(name)  # an unknown label: said before anything runs
    if device.type != "cuda":
        for name in [e for e in engines if engine_spec(e)[1] == "triton"]:
            print(f"the CPU: {name} left out (Triton's interpreter runs its kernels minutes a round)")
            engines.remove(name)
    bandwidth = copy_bandwidth(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype_name in args.dtypes.split(","):
            folder = make_target(args.shape, Path(tmp) / dtype_name, dtype_name, device=device.type)
            target, drafter = load_models(folder, dtype_name, args, device)
            weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
            compiled_here = False  # once Triton compiled in this process, a later engine's start is not cold
            later: list = []  # the profiles, after every engine's timings (``measure``)
            measured_rows = []
            for engine_name in engines:
                cache = Path(tmp) / f"{dtype_name}-{engine_name.replace(':', '-')}.cache.triton"
                measured = measure(target, drafter, engine_name, args, device, cache, later)
                row = {
                    "dtype": dtype_name,
                    "device": device.type,
                    "shape": args.shape,
                    "block_size": args.block,
                    "drafter_layers": args.layers,
                    "captured": args.compile,
                    "layers": engine_spec(engine_name)[1] if is_graphs(engine_name) else None,
                    "steps_compiled": engine_spec(engine_name)[1] == "triton",
                    **measured,
                    "target_weight_bytes": weight_bytes,
                    "memory_floor_ms": weight_bytes / bandwidth * 1e3 if bandwidth else None,
                }
                row.update(warm_start(engine_name, row, folder, dtype_name, cache, args))
                row["start_is_cold"] = not (compiled_here and row["steps_compiled"])
                compiled_here = compiled_here or bool(row["steps_compiled"])
                rows.append(row)
                measured_rows.append((row, measured))
                print(
                    f"{dtype_name} {engine_name}: start {row['start_seconds']:.1f} s; warm-up "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in row["warmup_seconds"].items())
                )
            for call in later:  # the profiles, now that every engine is timed
                call()
            for row, measured in measured_rows:
                row.update(measured)  # the one-token profiles
            if dtype_name == args.dtypes.split(",")[0] and not args.no_record_layers:
                record_faster_layers(target, rows)
            del target, drafter
            if device.type == "cuda":
                torch.cuda.empty_cache()

    B = args.block
    print()
    print(
        f"{'dtype':9} {'engine':15} {'start s':>7} {'warm s':>6} {'AR ms/tok':>9} {'round ms':>8} {'t[1,1]':>7} {f't[1,{B}]':>7} {'draft':>7} "
        f"{'glue':>6} {'sep. ms':>7} {'break-even tau':>14} "
        + " ".join(f"{f'x@{t:g}':>6}" for t in (*TAUS, B))
        + f" {'floor ms':>8}"
    )
    for r in rows:
        c = r["calls_ms"]
        print(
            f"{r['dtype']:9} {r['engine']:15} {fmt(r['start_seconds'] if r['start_is_cold'] else None, 7, 1)} "
            f"{fmt(r['warm_start_seconds'], 6, 1)} "
            f"{r['ms_per_ar_token']:9.3f} {r['ms_per_spec_round']:8.3f} "
            f"{c['target [1, 1]']:7.3f} {c[f'target [1, {B}]']:7.3f} {c[f'draft [1, {B}]']:7.3f} "
            f"{r['host_and_glue_ms']:6.3f} {fmt(r.get('ms_per_spec_round_separate_calls'), 7, 3)} "
            f"{r['break_even_tau']:14.2f} "
            + " ".join(f"{v:5.2f}x" for v in r["speedup_at_tau"].values())
            + (f" {r['memory_floor_ms']:8.3f}" if r["memory_floor_ms"] else f" {'-':>8}")
        )
    if not all(r["start_is_cold"] for r in rows):
        print(
            "start s '-': compiled after another engine in this process (Triton's kernels shared); run it alone"
        )
    fp = fingerprint.collect()
    summary = issue_summary(rows, args.dtypes.split(",")[0], previous_results())
    print("summary:", json.dumps({k: v for k, v in summary.items() if not isinstance(v, dict)}))  # the keys
    write_report(
        "decode_steps.json",
        {
            "rows": rows,
            **summary,
            "copy_bytes_per_s": bandwidth,
            "torch": fp["torch"],
            "gpu": fp["gpu"],
            "time": time.time(),
        },
    )
    if args.decode_8b_json:
        device_name = fp["gpu"]["names"][0] if fp["gpu"]["names"] else device.type
        figures = decode_figures(rows, args.dtypes.split(",")[0], device_name)
        merge_decode_figures(args.decode_8b_json, args.shape, figures)
        print(f"merged {args.shape} into {args.decode_8b_json}: {json.dumps(figures['rows'])}")


# where --decode-8b-json keeps a shape's figures: the 8B shape at the top level (issue 64's "Done when")
DECODE_8B_KEYS = {"qwen3-8b": None, "qwen3-4b": "4b", "qwen3-0.6b": "0.6b"}


def row_figures(row: dict, device_name: str) -> dict:
    """Issue 64's decode figures of one measured row: AR ms/token, the memory floor, the chain round and the
    tree-15 round (null when not measured) and the draft step in AR tokens, and the layers' backend."""
    ar = row["ms_per_ar_token"]
    tree15 = row.get("tree_rounds", {}).get("15")
    return {
        "device": device_name,
        "ar_ms": ar,
        "floor_ms": row["memory_floor_ms"],
        "round_cost_ar_tokens": row["ms_per_spec_round"] / ar,
        "tree15_round_cost_ar_tokens": tree15["round_cost_ar_tokens"] if tree15 else None,
        "draft_step_ar_tokens": row["calls_ms"][f"draft [1, {row['block_size']}]"] / ar,
        "backend": "triton" if row.get("layers") == "triton" else "torch",
    }


def decode_figures(rows: list[dict], dtype: str, device_name: str) -> dict:
    """The figures of the engine with the fastest chain round in ``dtype``, and every engine's under "rows"."""
    mine = [r for r in rows if r["dtype"] == dtype]
    if not mine:
        raise SystemExit(f"--decode-8b-json: no row measured in {dtype}")
    best = min(mine, key=lambda r: r["ms_per_spec_round"])
    r0 = mine[0]
    return {
        **row_figures(best, device_name),
        "engine": best["engine"],
        "dtype": dtype,
        "block_size": r0["block_size"],
        "drafter_layers": r0["drafter_layers"],
        "date": time.strftime("%Y-%m-%d"),
        "rows": {r["engine"]: row_figures(r, device_name) for r in mine},
    }


def merge_decode_figures(path: Path, shape: str, figures: dict) -> dict:
    """Write ``figures`` into the JSON at ``path`` where ``DECODE_8B_KEYS`` says (another shape: under its
    name), keeping what the file holds for the other shapes."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        data = {}
    key = DECODE_8B_KEYS.get(shape, shape)
    if key is None:  # the top level: replaced, except the other shapes' entries
        others = set(DECODE_8B_KEYS.values()) - {None}
        kept = {k: v for k, v in data.items() if k in others or k in TARGET_SHAPES}
        data = {**figures, **kept}
    else:
        data[key] = figures
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def record_faster_layers(target, rows: list[dict]) -> None:
    """Both layers of the graphs engine measured in this dtype: the faster round recorded for this device and
    target shape (``engine.record_layers``), which ``--layers auto`` takes from now on."""
    from dflashkit.infer.engine import LAYERS, layers_record_path, record_layers

    dtype = str(target.dtype).removeprefix("torch.")
    rounds = {r["layers"]: r["ms_per_spec_round"] for r in rows if r["dtype"] == dtype and r.get("layers")}
    if set(rounds) != set(LAYERS):
        return
    commit = (
        os.popen("git -C " + str(Path(__file__).resolve().parent) + " rev-parse --short HEAD").read().strip()
    )
    record = record_layers(target, rounds, date=time.strftime("%Y-%m-%d"), commit=commit or None)
    print(f"recorded for --layers auto: {record['layers']} ({layers_record_path()})")


def fmt(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def load_models(
    folder: Path, dtype_name: str, args, device, seconds: dict[str, float] | None = None, lazy: bool = True
):
    """The random target saved in ``folder`` and a random drafter of the configured shape (``seconds``:
    filled with the wall time of each: "target" and "drafter"). ``lazy``: the target as the serving commands
    load it (its weights file alone; the transformers model only if a step needs it)."""
    import time

    import torch

    from dflashkit.model.config import config_for_target, default_target_layer_ids
    from dflashkit.model.drafter import DFlashDrafter
    from dflashkit.target.hf import TargetModel

    dtype = getattr(torch, dtype_name)
    t0 = time.perf_counter()
    target = TargetModel.load(folder, dtype=dtype, device=device, lazy=lazy)
    t1 = time.perf_counter()
    cfg = config_for_target(
        target.config,
        num_layers=args.layers,
        block_size=args.block,
        mask_token_id=target.vocab_size - 1,
        target_layer_ids=default_target_layer_ids(target.num_layers, args.target_layers),
    )
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
    if seconds is not None:
        seconds.update(target=t1 - t0, drafter=time.perf_counter() - t1)
    return target, drafter


def warm_start(engine_name: str, row: dict, folder: Path, dtype_name: str, cache: Path, args) -> dict:
    """The warm start of an engine: for Triton layers a second process, with an empty Triton cache folder of
    its own, that loads the kernel cache file this one wrote; an engine that compiles nothing starts the same
    every time."""
    if engine_spec(engine_name)[1] != "triton":
        return {"warm_start_seconds": row["start_seconds"]}
    if args.no_warm_start or not cache.is_file():
        return {"warm_start_seconds": None}
    cmd = warm_start_command(engine_name, folder, dtype_name, cache, args)
    # a fresh machine's Triton folder, so that what serves the child is the kernel cache file alone
    fresh = tempfile.mkdtemp(prefix="decode-steps-warm-")
    env = {**os.environ, "TRITON_CACHE_DIR": os.path.join(fresh, "triton")}
    out = run_child([*cmd, "--spawned-at", repr(time.time())], env, 540)
    profile = out.pop("start_profile", None)
    print(f"{dtype_name} {engine_name} warm start (second process): {json.dumps(out)}")
    for key, lines in (profile or {}).items():
        print(f"warm start's engine build, the most {key} time:")
        print("\n".join(f"  {line}" for line in lines))
    return {
        "warm_start_seconds": out.get("process_to_first_token_seconds"),
        "warm_start_engine_seconds": out.get("engine_to_first_token_seconds"),
        "warm_start": out,
    }


def warm_start_command(engine_name: str, folder: Path, dtype_name: str, cache: Path, args) -> list[str]:
    """The warm-start child's command line: the same models and step shapes as this process's."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--warm-start-child", str(cache)]
    cmd += ["--warm-start-engine", engine_name]
    cmd += ["--target-folder", str(folder), "--dtypes", dtype_name, "--shape", args.shape]
    cmd += [
        "--layers",
        str(args.layers),
        "--block",
        str(args.block),
        "--target-layers",
        str(args.target_layers),
    ]
    cmd += ["--prompt-len", str(args.prompt_len), "--tokens", str(args.tokens), "--calls", str(args.calls)]
    # what else enters the steps' shapes (``engine_capacity``: the tree budgets widen the cache): without
    # them the child built other steps than the file holds (measured 2026-12-05: the kernels' variants
    # compiled again, 19.2 s)
    cmd += ["--tree-budgets", ",".join(map(str, args.tree_budgets)), "--profile", str(args.profile)]
    cmd += ["--start-profile", str(args.start_profile)] if args.start_profile else []
    cmd += ["--start-tree-budget", str(args.start_tree_budget)]
    return cmd


def warm_start_child(args) -> dict:
    """In a fresh process: load the models, build the graphs engine with Triton layers around the kernel cache
    file, decode one token. Seconds from the parent's spawn and from building the engine to that token, and where
    the rest went: the interpreter and imports, the models' load; with ``--start-profile N`` the N functions
    of the engine's build that took the longest (cumulative and own time, cProfile)."""
    entered = time.time()
    import torch

    imported = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args.compile = device.type == "cuda"
    target, drafter = load_models(Path(args.target_folder), args.dtypes, args, device)
    loaded = time.time()
    profiler = cProfile.Profile() if args.start_profile else None
    with torch.no_grad():
        if profiler is not None:
            profiler.enable()
        _, warm, engine_seconds = first_token(
            target, drafter, args.warm_start_engine, args, Path(args.warm_start_child)
        )
        if profiler is not None:
            profiler.disable()
    out = {
        "process_to_first_token_seconds": time.time() - args.spawned_at,
        "engine_to_first_token_seconds": engine_seconds,
        "start_parts_seconds": {
            "interpreter and the script's imports": entered - args.spawned_at,
            "import torch": imported - entered,
            "models": loaded - imported,
            "engine to first token": engine_seconds,
        },
        "warmup_seconds": dict(warm),
        **cache_report(warm),
    }
    if profiler is not None:
        out["start_profile"] = profile_top(profiler, args.start_profile)
    return out


def profile_top(profiler: cProfile.Profile, n: int) -> dict[str, list[str]]:
    """The ``n`` functions with the most cumulative and the most own time, one line each."""
    stats = pstats.Stats(profiler)
    top: dict[str, list[str]] = {}
    for key in ("cumulative", "tottime"):
        rows = sorted(
            stats.stats.items(), key=lambda kv: kv[1][3 if key == "cumulative" else 2], reverse=True
        )
        top[key] = [
            f"{v[3]:7.2f} s cum {v[2]:7.2f} s own {v[1]:6d} calls  {Path(f).name}:{line} {name}"
            for (f, line, name), v in rows[:n]
        ]
    return top


def previous_results() -> dict:
    """The committed results (for the summary values other measurements fill); {} when unreadable."""
    try:
        return json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        return {}


def issue_summary(rows: list[dict], dtype: str, previous: dict) -> dict:
    """The issue's keyed figures for the engine with the fastest autoregressive token in ``dtype``; the keys
    this run does not measure are kept from the previous results, else null (never made up)."""
    mine = [r for r in rows if r["dtype"] == dtype]
    summary: dict = {k: previous.get(k) for k in CARRIED}
    if not mine:
        return {
            "summary_engine": None,
            "round_cost_ar_tokens": None,
            "ar_tok_s": None,
            "warm_start_s": None,
            **summary,
        }
    best = min(mine, key=lambda r: r["ms_per_ar_token"])
    return {
        "summary_engine": best["engine"],
        "summary_dtype": dtype,
        "round_cost_ar_tokens": best["ms_per_spec_round"] / best["ms_per_ar_token"],
        "ar_tok_s": 1e3 / best["ms_per_ar_token"],
        "warm_start_s": best.get("warm_start_seconds"),
        **summary,
    }


if __name__ == "__main__":
    main()
