"""How a matmul's cost grows with its rows on this CPU: the embedded target's projections and head at M = 1
(an autoregressive token), 8 (a block of B=8), 9 and 65 (trees of 8 and 64 nodes), in bf16 and float32.

On a CPU whose matmuls are bound by the weights' memory traffic, verifying 8 tokens costs about what one
costs, and speculation pays; where they are bound by arithmetic (bf16 without native bf16 instructions is
converted on the fly), a block costs several tokens. In bf16, where oneDNN runs bf16 natively, each matmul is
also timed through its weight packed once (``slot_decoder.pack_weight``: what the graphs engine and the
generator do there) beside ``F.linear``, which lays the weight out again on every call. Each call reads
another copy of the weight (``--stream-mb`` of copies in all), as a decode step streams every weight once
instead of re-reading one that sits in the cache. Prints a table and writes cpu_matmul.json to --out.

    python benchmarks/cpu_matmul.py --out /tmp/cpu-matmul
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time
from pathlib import Path

# (in, out) of the embedded target's (SmolLM2-135M) matmuls: fused QKV, output, fused gate/up, down, head
SHAPES = {
    "qkv": (576, 960),
    "o": (576, 576),
    "gate_up": (576, 3072),
    "down": (1536, 576),
    "head": (576, 49152),
}
ROWS = (1, 8, 9, 65)


def cpu_flags() -> list[str]:
    try:
        words = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return []
    return sorted({w for w in words if w.startswith(("avx512", "amx", "avx2"))})


def median_ms(fn, n: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--calls", type=int, default=30)
    ap.add_argument(
        "--stream-mb", type=float, default=256.0, help="MB of weight copies each shape cycles through"
    )
    args = ap.parse_args()
    import torch

    from dflashkit.target.slot_decoder import cpu_packing_pays, linear, pack_weight

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        packs = [False, True] if cpu_packing_pays(torch.device("cpu"), dtype) else [False]
        for name, (k, n) in SHAPES.items():
            copies = max(1, int(args.stream_mb * 2**20 // (n * k * dtype.itemsize)))
            ws = [torch.randn(n, k, dtype=dtype) for _ in range(copies)]
            for packed in packs:
                ps = [pack_weight(w) for w in ws] if packed else [None] * copies
                ms = {}
                for m in ROWS:
                    x = torch.randn(m, k, dtype=dtype)
                    pairs = itertools.cycle(list(zip(ws, ps, strict=True)))

                    def call(x=x, pairs=pairs) -> None:
                        w, p = next(pairs)
                        linear(x, w, packed=p)

                    ms[str(m)] = median_ms(call, max(5, args.calls // (10 if n > 10000 else 1)))
                rows.append(
                    {
                        "dtype": str(dtype).removeprefix("torch."),
                        "matmul": name,
                        "weight": "packed" if packed else "F.linear",
                        "in": k,
                        "out": n,
                        "copies": copies,
                        "ms": ms,
                        "gb_per_s_at_1": n * k * dtype.itemsize / ms["1"] / 1e6,
                    }
                )
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, flags: {' '.join(cpu_flags())}")
    head = " ".join(f"{f'M={m} ms':>9}" for m in ROWS)
    print(f"{'dtype':9} {'matmul':8} {'weight':9} {head} {'M=8 / M=1':>10} {'GB/s (M=1)':>11}")
    for r in rows:
        ms = r["ms"]
        print(
            f"{r['dtype']:9} {r['matmul']:8} {r['weight']:9} "
            + " ".join(f"{ms[str(m)]:9.3f}" for m in ROWS)
            + f" {ms['8'] / ms['1']:9.2f}x {r['gb_per_s_at_1']:11.1f}"
        )
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        report = {
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "cpu_flags": cpu_flags(),
            "rows": rows,
        }
        (out / "cpu_matmul.json").write_text(json.dumps(report, indent=1))
        print(f"wrote {out / 'cpu_matmul.json'}")


if __name__ == "__main__":
    main()
