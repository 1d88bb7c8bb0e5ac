"""How a matmul's cost grows with its rows on this CPU: the embedded target's projections and head at M = 1
(an autoregressive token), 8 (a block of B=8), 9 and 65 (trees of 8 and 64 nodes), in bf16 and float32.

On a CPU whose matmuls are bound by the weights' memory traffic, verifying 8 tokens costs about what one
costs, and speculation pays; where they are bound by arithmetic (bf16 without native bf16 instructions is
converted on the fly), a block costs several tokens. Prints a table and writes cpu_matmul.json to --out.

    python benchmarks/cpu_matmul.py --out /tmp/cpu-matmul
"""

from __future__ import annotations

import argparse
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
    args = ap.parse_args()
    import torch
    import torch.nn.functional as F

    rows = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, (k, n) in SHAPES.items():
            w = torch.randn(n, k, dtype=dtype)
            ms = {}
            for m in ROWS:
                x = torch.randn(m, k, dtype=dtype)
                ms[str(m)] = median_ms(
                    lambda x=x, w=w: F.linear(x, w), max(5, args.calls // (10 if n > 10000 else 1))
                )
            rows.append(
                {"dtype": str(dtype).removeprefix("torch."), "matmul": name, "in": k, "out": n, "ms": ms}
            )
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, flags: {' '.join(cpu_flags())}")
    print(f"{'dtype':9} {'matmul':8} " + " ".join(f"{f'M={m} ms':>9}" for m in ROWS) + f" {'M=8 / M=1':>10}")
    for r in rows:
        ms = r["ms"]
        print(
            f"{r['dtype']:9} {r['matmul']:8} "
            + " ".join(f"{ms[str(m)]:9.3f}" for m in ROWS)
            + f" {ms['8'] / ms['1']:9.2f}x"
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
