"""Decode step costs of the static and graphs engines: what one autoregressive token and one speculative round cost, and so
the speculative speedup each acceptance length can give.

The static engine's steps have fixed shapes, so a round costs the same whatever is accepted: speedup(tau) =
tau x (seconds per autoregressive token) / (seconds per speculative round), exactly. This script measures both
on a random-weight target of the embedded target's shape (SmolLM2-135M: 30 layers, hidden 576, vocabulary 49152;
timing does not depend on the weights, so nothing has to be carried to the GPU) and a random drafter of
`configs/embedded-gpu.yaml`'s shape (2 layers, block 8, 5 target layers), compiled and warmed up as
`decode_speed.py` does. Per dtype it reports:

- the loops: autoregressive ms/token and speculative ms/round from `autoregressive_generate` and
  `speculative_generate` over `--tokens` new tokens (a random drafter is always rejected: one token per round);
- the engine calls alone, each synchronised: target [1, 1], target [1, B], draft [1, B] (ms, median);
- the break-even acceptance length (round / token) and the speedup at tau = 1.5, 2, 3, 4, B;
- the floor: the target's weight bytes over the measured copy bandwidth (what a step would cost were it
  bound by memory, not by kernel launches and the host).

    python benchmarks/decode_steps.py                  # GPU
    python benchmarks/decode_steps.py --smoke          # CPU, tiny random target, eager
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from fanout import TARGET_SHAPES, make_target  # noqa: E402  (the random target)
from report import write_report  # noqa: E402

SMOKE_SHAPE = "tiny"
TAUS = (1.5, 2.0, 3.0, 4.0)


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


def measure(target, drafter, engine_name: str, args, device) -> dict:
    import torch

    from dflashkit.infer.engine import ready_engine
    from dflashkit.infer.speculative import autoregressive_generate, speculative_generate

    B = drafter.config.block_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, target.vocab_size - 1, (args.prompt_len,), generator=g).tolist()
    capacity = args.prompt_len + args.tokens + B
    t0 = time.perf_counter()
    engine, warm = ready_engine(engine_name, target, drafter, capacity=capacity, compile=args.compile)
    layer_ids = drafter.config.target_layer_ids
    with torch.no_grad():
        # the warm start: building the engine (compile or capture every step shape) to the first token
        first = autoregressive_generate(target, prompt, 1, layer_ids=layer_ids, engine=engine)
        start_seconds = time.perf_counter() - t0 - first.seconds + first.prefill_seconds
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

        # the engine calls alone, at a fixed place: after the prompt, cropped back after each verify
        P = len(prompt)
        engine.prefill(torch.tensor([prompt], device=device))
        one = torch.tensor([[prompt[-1]]], device=device)
        block = torch.tensor([prompt[-B:]], device=device)

        def verify(ids):
            engine.verify(ids)
            engine.crop(P)

        calls = {
            "target [1, 1]": timed(lambda: verify(one), args.calls, device),
            f"target [1, {B}]": timed(lambda: verify(block), args.calls, device),
            f"draft [1, {B}]": timed(lambda: engine.draft(prompt[-1], P), args.calls, device),
        }
    return {
        "engine": engine_name,
        "warmup_seconds": warm,
        "start_seconds": start_seconds,
        "ms_per_ar_token": token_ms,
        "ms_per_spec_round": round_ms,
        "random_drafter_tau": sum(taus) / len(taus),
        "calls_ms": calls,
        "host_and_glue_ms": round_ms - calls[f"target [1, {B}]"] - calls[f"draft [1, {B}]"],
        "break_even_tau": round_ms / token_ms,
        "speedup_at_tau": {str(t): t * token_ms / round_ms for t in (*TAUS, float(B))},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16")
    ap.add_argument("--shape", default="smollm2-135m", choices=sorted(TARGET_SHAPES))
    ap.add_argument("--layers", type=int, default=2, help="drafter layers")
    ap.add_argument("--block", type=int, default=8)
    ap.add_argument("--target-layers", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256, help="new tokens per loop")
    ap.add_argument("--repeats", type=int, default=3, help="loops of each kind (median)")
    ap.add_argument("--calls", type=int, default=200, help="timed engine calls of each kind (median)")
    ap.add_argument("--engines", default="static,graphs", help="engines to measure, side by side")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()

    import torch

    from dflashkit.model.config import config_for_target, default_target_layer_ids
    from dflashkit.model.drafter import DFlashDrafter
    from dflashkit.runtime import fingerprint
    from dflashkit.target.hf import TargetModel

    device = torch.device("cpu" if args.smoke or not torch.cuda.is_available() else "cuda")
    args.compile = device.type == "cuda"
    if args.smoke:
        args.shape, args.tokens, args.repeats, args.calls, args.target_layers = SMOKE_SHAPE, 24, 1, 3, 2
    bandwidth = copy_bandwidth(device)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            folder = make_target(args.shape, Path(tmp) / dtype_name, dtype_name, device=device.type)
            target = TargetModel.load(folder, dtype=dtype, device=device)
            L = target.num_layers
            cfg = config_for_target(
                target.config,
                num_layers=args.layers,
                block_size=args.block,
                mask_token_id=target.vocab_size - 1,
                target_layer_ids=default_target_layer_ids(L, args.target_layers),
            )
            torch.manual_seed(0)
            drafter = DFlashDrafter(cfg).to(device=device, dtype=dtype).eval()
            weight_bytes = sum(p.numel() * p.element_size() for p in target.model.parameters())
            for engine_name in args.engines.split(","):
                row = {
                    "dtype": dtype_name,
                    "device": device.type,
                    "shape": args.shape,
                    "block_size": args.block,
                    "drafter_layers": args.layers,
                    "compiled": args.compile,
                    **measure(target, drafter, engine_name, args, device),
                    "target_weight_bytes": weight_bytes,
                    "memory_floor_ms": weight_bytes / bandwidth * 1e3 if bandwidth else None,
                }
                rows.append(row)
                print(
                    f"{dtype_name} {engine_name}: start {row['start_seconds']:.1f} s; warm-up "
                    + ", ".join(f"{k} {v:.1f} s" for k, v in row["warmup_seconds"].items())
                )
            del target, drafter
            if device.type == "cuda":
                torch.cuda.empty_cache()

    B = args.block
    print()
    print(
        f"{'dtype':9} {'engine':7} {'start s':>7} {'AR ms/tok':>9} {'round ms':>8} {'t[1,1]':>7} {f't[1,{B}]':>7} {'draft':>7} "
        f"{'glue':>6} {'break-even tau':>14} "
        + " ".join(f"{f'x@{t:g}':>6}" for t in (*TAUS, B))
        + f" {'floor ms':>8}"
    )
    for r in rows:
        c = r["calls_ms"]
        print(
            f"{r['dtype']:9} {r['engine']:7} {r['start_seconds']:7.1f} {r['ms_per_ar_token']:9.3f} {r['ms_per_spec_round']:8.3f} "
            f"{c['target [1, 1]']:7.3f} {c[f'target [1, {B}]']:7.3f} {c[f'draft [1, {B}]']:7.3f} "
            f"{r['host_and_glue_ms']:6.3f} {r['break_even_tau']:14.2f} "
            + " ".join(f"{v:5.2f}x" for v in r["speedup_at_tau"].values())
            + (f" {r['memory_floor_ms']:8.3f}" if r["memory_floor_ms"] else f" {'-':>8}")
        )
    fp = fingerprint.collect()
    write_report(
        "decode_steps.json",
        {
            "rows": rows,
            "copy_bytes_per_s": bandwidth,
            "torch": fp["torch"],
            "gpu": fp["gpu"],
            "time": time.time(),
        },
    )


if __name__ == "__main__":
    main()
