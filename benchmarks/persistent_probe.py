"""What one launch a step could buy: the matmul phases of a decoder step as one persistent kernel, against the
same phases launched one by one.

A one-token step of the embedded target is 30 layers of six kernels (``dflashkit.target.kernels``): 180
launches, ~2.5 us each on an H100, where the step's weights could be read in ~0.07 ms. A persistent kernel runs
the whole step in one launch, its programs (one per multiprocessor) meeting at a grid barrier between phases
instead of at a kernel boundary. Before building that engine, this probe measures the part that decides
whether it pays: the four matmul phases of each of the target's layers (the fused query/key/value projection,
the output projection with the residual add, the gate/up projection, SwiGLU and the down projection with the
residual add; attention left out), with the target's shapes, for one token and for 16 rows (a tree of 15 and
its root):

- ``launches``: one Triton launch a phase (120 a step), captured as one CUDA graph, as the engine replays its
  steps;
- ``persistent``: one launch a step, the same phase code in every program, a grid barrier (an atomic counter)
  between phases.

Both run the same per-phase code, so their outputs are equal to the bit (checked); both against a torch
reference. The floor: the weights' bytes over the measured copy bandwidth. On the CPU the kernels run in
Triton's interpreter with one program (a grid barrier needs every program resident at once, which the
interpreter, running programs one after another, cannot give): ``--smoke`` checks the numbers only.

    python benchmarks/persistent_probe.py                      # GPU: the table and persistent_probe.json
    python benchmarks/persistent_probe.py --smoke               # CPU: two small layers, numbers checked
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

HIDDEN, QKV, INTERMEDIATE, LAYERS = 576, 960, 1536, 30  # the embedded target (SmolLM2-135M)
ROWS = 16  # tl.dot's least rows: one token is padded to them (its weights' reads are what cost)


def _triton():
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton
    import triton.language as tl

    return triton, tl


triton, tl = _triton()


@triton.jit
def _phase(
    x_ptr,
    w_ptr,
    out_ptr,
    m,
    pid,
    PROGRAMS: tl.constexpr,
    X_STRIDE: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[:m, cols] (+)= a[:m, :K] @ w[:K, cols] for this program's column blocks (every PROGRAMS-th), where a is
    x (row stride X_STRIDE) or, with SWIGLU, silu(x[:, :K]) * x[:, K:2K]; RESIDUAL adds into out (each program
    reads and writes only its own columns)."""
    rows = tl.arange(0, 16)
    live = rows[:, None] < m
    for j in range(0, tl.cdiv(N // BLOCK_N, PROGRAMS)):
        cb = pid + j * PROGRAMS
        cols = cb * BLOCK_N + tl.arange(0, BLOCK_N)
        live_cols = cols[None, :] < N
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            at = x_ptr + rows[:, None] * X_STRIDE + ks[None, :]
            if SWIGLU:
                g = tl.load(at, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
                u = tl.load(at + K, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
                a = (g * tl.sigmoid(g) * u).to(w_ptr.dtype.element_ty)
            else:
                a = tl.load(at, mask=live, other=0.0, cache_modifier=".cg")
            w = tl.load(w_ptr + ks[:, None] * N + cols[None, :], mask=live_cols, other=0.0)
            acc += tl.dot(a, w)
        where = out_ptr + rows[:, None] * N + cols[None, :]
        if RESIDUAL:
            acc += tl.load(where, mask=live & live_cols, other=0.0, cache_modifier=".cg").to(tl.float32)
        tl.store(where, acc.to(out_ptr.dtype.element_ty), mask=live & live_cols)


@triton.jit
def _grid_sync(counter_ptr, target):
    """Every program waits here until the counter reaches ``target`` (each adds one on arrival): the writes
    before it are seen by every program after it (release on arrival, acquire while waiting)."""
    tl.debug_barrier()
    tl.atomic_add(counter_ptr, 1, sem="release", scope="gpu")
    seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    while seen < target:
        seen = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _phase_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    m,
    X_STRIDE: tl.constexpr,
    K: tl.constexpr,
    N: tl.constexpr,
    SWIGLU: tl.constexpr,
    RESIDUAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    _phase(
        x_ptr, w_ptr, out_ptr, m, tl.program_id(0), N // BLOCK_N,
        X_STRIDE, K, N, SWIGLU, RESIDUAL, BLOCK_N, BLOCK_K,
    )  # fmt: skip


@triton.jit
def _step_kernel(
    h_ptr,
    t1_ptr,
    t2_ptr,
    wqkv_ptr,
    wo_ptr,
    wgu_ptr,
    wd_ptr,
    counter_ptr,
    m,
    PROGRAMS: tl.constexpr,
    LAYERS_: tl.constexpr,
    H: tl.constexpr,
    Q: tl.constexpr,
    INTER: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """The whole step: every layer's four phases, a grid barrier after each."""
    pid, nprog = tl.program_id(0), PROGRAMS
    done = 0
    for layer in range(LAYERS_):
        _phase(
            h_ptr, wqkv_ptr + layer * H * Q, t1_ptr, m, pid, nprog, H, H, Q, False, False, BLOCK_N, BLOCK_K
        )
        done += nprog
        _grid_sync(counter_ptr, done)
        _phase(t1_ptr, wo_ptr + layer * H * H, h_ptr, m, pid, nprog, Q, H, H, False, True, BLOCK_N, BLOCK_K)
        done += nprog
        _grid_sync(counter_ptr, done)
        _phase(
            h_ptr,
            wgu_ptr + layer * H * 2 * INTER,
            t2_ptr,
            m,
            pid,
            nprog,
            H,
            H,
            2 * INTER,
            False,
            False,
            BLOCK_N,
            BLOCK_K,
        )
        done += nprog
        _grid_sync(counter_ptr, done)
        _phase(
            t2_ptr,
            wd_ptr + layer * INTER * H,
            h_ptr,
            m,
            pid,
            nprog,
            2 * INTER,
            INTER,
            H,
            True,
            True,
            BLOCK_N,
            BLOCK_K,
        )
        done += nprog
        _grid_sync(counter_ptr, done)


@triton.jit
def _tick_kernel(x_ptr, GDC: tl.constexpr):
    """A phase of no work: each program adds one to its own counter (after the kernel before, with GDC)."""
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    tl.store(x_ptr + pid, tl.load(x_ptr + pid) + 1)


@triton.jit
def _ticks_kernel(x_ptr, counter_ptr, PHASES: tl.constexpr, PROGRAMS: tl.constexpr):
    """PHASES phases of no work in one launch, a grid barrier after each."""
    pid = tl.program_id(0)
    done = 0
    for _ in range(PHASES):
        tl.store(x_ptr + pid, tl.load(x_ptr + pid, cache_modifier=".cg") + 1)
        done += PROGRAMS
        _grid_sync(counter_ptr, done)


def one_by_one(device: torch.device, programs: int) -> None:
    """Refuse a grid barrier of several programs where they run one after another (Triton's interpreter on
    the CPU): the first would wait forever for the others."""
    if device.type != "cuda" and programs > 1:
        raise ValueError(
            f"{programs} programs on the CPU: the interpreter runs them in turn; a barrier needs one"
        )


def boundaries(phases: int, programs: int, device: torch.device, calls: int = 0) -> dict:
    """What a phase boundary costs: ``phases`` phases of no work as one launch each (a CUDA graph; with and
    without dependent launch on a GPU that has it) and as one persistent launch with grid barriers. Each
    program's counter must read ``phases`` after a step (checked); with ``calls`` (GPU) the median ms of a step
    and the us a boundary."""
    one_by_one(device, programs)
    x = torch.zeros(programs, device=device, dtype=torch.int32)
    counter = torch.zeros(1, device=device, dtype=torch.int32)
    pdl = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9

    def launches(gdc: bool) -> None:
        x.zero_()
        for _ in range(phases):
            _tick_kernel[(programs,)](x, GDC=gdc, **({"launch_pdl": True} if gdc else {}))

    def persistent() -> None:
        x.zero_()
        counter.zero_()
        _ticks_kernel[(programs,)](x, counter, phases, programs)

    ways = {"launches": lambda: launches(False), "persistent": persistent}
    if pdl:
        ways["launches, dependent"] = lambda: launches(True)
    out: dict = {"phases": phases, "programs": programs}
    for name, fn in ways.items():
        fn()
        if not bool((x == phases).all()):
            raise AssertionError(f"{name}: the counters read {x.tolist()[:4]}..., not {phases}")
        if calls:
            from kernel_tiles import replay_ms  # the figures compare with kernel_tiles'

            ms = replay_ms(fn, calls)
            out[name] = {"ms": ms, "us_a_boundary": ms * 1e3 / phases}
    return out


class Step:
    """The weights (stored [K, N], the layers stacked) and the activations of one step of ``m`` rows."""

    def __init__(self, layers: int, device: torch.device, dtype: torch.dtype, seed: int = 0) -> None:
        g = torch.Generator(device="cpu").manual_seed(seed)

        def weight(k: int, n: int) -> torch.Tensor:
            return (torch.randn(layers, k, n, generator=g) * (0.5 / k**0.5)).to(device, dtype)

        self.layers, self.device, self.dtype = layers, device, dtype
        self.wqkv, self.wo = weight(HIDDEN, QKV), weight(HIDDEN, HIDDEN)
        self.wgu, self.wd = weight(HIDDEN, 2 * INTERMEDIATE), weight(INTERMEDIATE, HIDDEN)
        self.h0 = torch.randn(ROWS, HIDDEN, generator=g).to(device, dtype)
        self.h = torch.empty(ROWS, HIDDEN, device=device, dtype=dtype)
        self.t1 = torch.zeros(ROWS, QKV, device=device, dtype=dtype)
        self.t2 = torch.zeros(ROWS, 2 * INTERMEDIATE, device=device, dtype=dtype)
        self.counter = torch.zeros(1, device=device, dtype=torch.int32)

    def weight_bytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in (self.wqkv, self.wo, self.wgu, self.wd))

    def reference(self, m: int) -> torch.Tensor:
        """The step in torch, float32 accumulation, rounded where the kernels round (each phase's output)."""
        h = self.h0[:m].clone()
        for i in range(self.layers):
            t1 = (h.float() @ self.wqkv[i].float()).to(self.dtype)
            h = (h.float() + t1[:, :HIDDEN].float() @ self.wo[i].float()).to(self.dtype)
            t2 = (h.float() @ self.wgu[i].float()).to(self.dtype)
            g, u = t2[:, :INTERMEDIATE].float(), t2[:, INTERMEDIATE:].float()
            a = (torch.nn.functional.silu(g) * u).to(self.dtype)
            h = (h.float() + a.float() @ self.wd[i].float()).to(self.dtype)
        return h

    def phases(self, i: int) -> list[tuple]:
        """Layer ``i``'s phases as the persistent kernel runs them: (input, weight, output, input row stride,
        inner size, output columns, SwiGLU on the input, residual add)."""
        return [
            (self.h, self.wqkv[i], self.t1, HIDDEN, HIDDEN, QKV, False, False),
            (self.t1, self.wo[i], self.h, QKV, HIDDEN, HIDDEN, False, True),
            (self.h, self.wgu[i], self.t2, HIDDEN, HIDDEN, 2 * INTERMEDIATE, False, False),
            (self.t2, self.wd[i], self.h, 2 * INTERMEDIATE, INTERMEDIATE, HIDDEN, True, True),
        ]

    def launches(self, m: int, block_n: int, block_k: int) -> None:
        """One launch a phase (a grid of every column block)."""
        self.h.copy_(self.h0)
        for i in range(self.layers):
            for x, w, out, xs, k, n, swiglu, res in self.phases(i):
                _phase_kernel[(n // block_n,)](x, w, out, m, xs, k, n, swiglu, res, block_n, block_k)

    def persistent(self, m: int, programs: int, block_n: int, block_k: int) -> None:
        """One launch a step: ``programs`` programs (all resident at once: at most one per multiprocessor)."""
        one_by_one(self.device, programs)
        self.h.copy_(self.h0)
        self.counter.zero_()
        _step_kernel[(programs,)](
            self.h, self.t1, self.t2, self.wqkv, self.wo, self.wgu, self.wd, self.counter, m, programs,
            self.layers, HIDDEN, QKV, INTERMEDIATE, block_n, block_k,
        )  # fmt: skip


def check(step: Step, m: int, programs: int, block_n: int, block_k: int) -> dict:
    """Both ways give the same numbers to the bit, and the reference's within bf16's rounding."""
    step.launches(m, block_n, block_k)
    by_launches = step.h[:m].clone()
    step.persistent(m, programs, block_n, block_k)
    by_persistent = step.h[:m].clone()
    ref = step.reference(m).float()
    err = ((by_launches.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
    return {"equal_to_the_bit": bool(torch.equal(by_launches, by_persistent)), "relative_error": err}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=LAYERS)
    ap.add_argument("--rows", default="1,16", help="rows a step (1: a token; 16: a tree of 15 and its root)")
    ap.add_argument(
        "--programs", default="sms", help="persistent programs: 'sms' (one per multiprocessor) or N,..."
    )
    ap.add_argument("--block-n", default="16", help="output columns per program and phase (each at least 16)")
    ap.add_argument("--block-k", default="64", help="inner-dimension step (each at least 16)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument(
        "--phases", type=int, default=180, help="phases of no work for the boundaries' cost (180: a step)"
    )
    ap.add_argument("--boundaries-only", action="store_true", help="only what a phase boundary costs")
    ap.add_argument("--out", default="persistent_probe.json")
    ap.add_argument("--smoke", action="store_true", help="CPU: two layers, one program, the numbers checked")
    args = ap.parse_args()

    sizes = {"block-n": (HIDDEN, QKV, 2 * INTERMEDIATE), "block-k": (HIDDEN, INTERMEDIATE)}
    for flag, values in (("block-n", args.block_n), ("block-k", args.block_k)):
        for v in (int(x) for x in values.split(",")):
            if v < 16 or v & (v - 1) or any(size % v for size in sizes[flag]):
                sys.exit(
                    f"--{flag} {v}: each a power of 2, at least 16, dividing {sizes[flag]} (the phases mask no edge)"
                )
    if args.smoke or not torch.cuda.is_available():
        print(f"boundaries (one program): {boundaries(5, 1, torch.device('cpu'))}")
        step = Step(2, torch.device("cpu"), torch.float32)
        for m in (1, 3):
            result = check(step, m, 1, 16, 64)
            print(f"rows {m}: {result}")
            assert result["equal_to_the_bit"] and result["relative_error"] < 1e-4, result
        print("smoke: launches and persistent equal, both at the reference (float32, interpreter)")
        return

    device = torch.device("cuda")
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    programs = [sms if p == "sms" else int(p) for p in args.programs.split(",")]
    if max(programs) > sms:
        sys.exit(f"--programs: at most {sms} here (every program resident at once, one per multiprocessor)")
    costs = [boundaries(args.phases, p, device, args.calls) for p in programs]
    for c in costs:
        print(f"{args.phases} phases of no work, {c['programs']} programs: "
              + "; ".join(f"{k} {v['ms']:.3f} ms ({v['us_a_boundary']:.2f} us a boundary)"
                          for k, v in c.items() if isinstance(v, dict)))  # fmt: skip
    if args.boundaries_only:
        Path(args.out).write_text(
            json.dumps({"command": " ".join(sys.argv), "boundaries": costs}, indent=2) + "\n"
        )
        print(f"wrote {args.out}")
        return
    step = Step(args.layers, device, torch.bfloat16)
    from decode_steps import copy_bandwidth
    from kernel_tiles import replay_ms

    bandwidth = copy_bandwidth(device)
    floor_ms = step.weight_bytes() / bandwidth * 1e3
    rows_out = []
    print(
        f"{torch.cuda.get_device_name(device)}: {sms} multiprocessors; {args.layers} layers, weights "
        f"{step.weight_bytes() / 1e6:.0f} MB, copy {bandwidth / 1e12:.2f} TB/s: floor {floor_ms:.3f} ms a step"
    )
    print(
        f"{'rows':>4} {'block n':>7} {'block k':>7} {'launches ms':>11} {'programs':>8} {'persistent ms':>13} "
        f"{'ratio':>6} {'x floor':>7}  check"
    )
    for m in (int(r) for r in args.rows.split(",")):
        for bn in (int(b) for b in args.block_n.split(",")):
            for bk in (int(b) for b in args.block_k.split(",")):
                launch_ms = replay_ms(lambda m=m, bn=bn, bk=bk: step.launches(m, bn, bk), args.calls)
                for p in programs:
                    result = check(step, m, p, bn, bk)
                    persist_ms = replay_ms(
                        lambda m=m, p=p, bn=bn, bk=bk: step.persistent(m, p, bn, bk), args.calls
                    )
                    row = {
                        "rows": m, "block_n": bn, "block_k": bk, "programs": p, "launches_ms": launch_ms,
                        "persistent_ms": persist_ms, "persistent_vs_launches": persist_ms / launch_ms,
                        "persistent_vs_floor": persist_ms / floor_ms, **result,
                    }  # fmt: skip
                    rows_out.append(row)
                    print(
                        f"{m:>4} {bn:>7} {bk:>7} {launch_ms:>11.3f} {p:>8} {persist_ms:>13.3f} "
                        f"{persist_ms / launch_ms:>6.2f} {persist_ms / floor_ms:>7.1f}  "
                        f"bit-equal {result['equal_to_the_bit']}, error {result['relative_error']:.1e}"
                    )
    report = {
        "device": torch.cuda.get_device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layers": args.layers,
        "weight_bytes": step.weight_bytes(),
        "copy_bytes_per_s": bandwidth,
        "floor_ms": floor_ms,
        "command": " ".join(sys.argv),
        "boundaries": costs,
        "rows": rows_out,
    }
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
