"""Peak memory of attention and of DFlash block-mask construction: our compiled flex path vs the dense paths.

1. One causal attention layer at S=16384 (16 heads, head_dim 128, bf16): our compiled entry vs
   flex_attention without compile (the dense math path torch falls back to silently), and what our
   pre-flight check says about a dense sdpa path.
2. The DFlash block mask at S=3072/N=512/B=16 and S=16384/N=1024/B=16: our tile-level build from the
   anchors vs create_block_mask (dense [Q, KV] evaluation) and torch.compile(create_block_mask).
3. DFlash attention at the paper's shape (context 3072, 512 anchors, B=16, 32/8 heads, head_dim 128, bf16):
   our compiled flex forward (+backward on GPU) against the size of its dense score matrix.

Peak memory is measured per call above the level before it (CUDA allocator peak on GPU; VmHWM on the CPU).
Prints a table and writes JSON to $OUT/attention_memory.json if $OUT is set.

    python benchmarks/attention_memory.py            # GPU
    python benchmarks/attention_memory.py --smoke    # CPU, small shapes
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

# Run from a checkout without installing: make src/ importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.dense_budget import DenseBudgetError, preflight_dense
from dflashkit.attention.flex import flex_attention_entry
from dflashkit.attention.masks import BlockLayout, dflash_mask_mod
from dflashkit.attention.memory import peak_memory
from dflashkit.attention.warm_up import AttentionShape, example_inputs
from report import write_report  # noqa: E402

GIB = 2**30


def causal_block_mask(n: int, device: str, tile: int = 128) -> BlockMask:
    """Causal BlockMask from tile indices: the diagonal tiles are partial, the ones below it full."""
    t = -(-n // tile)
    rows = torch.arange(t, device=device)
    partial = (rows[:, None] == rows[None, :])[None, None].to(torch.int32)
    full = (rows[:, None] > rows[None, :])[None, None].to(torch.int32)

    def ordered(x):
        return x.sum(-1, dtype=torch.int32), torch.argsort(x, dim=-1, descending=True, stable=True).to(
            torch.int32
        )

    def causal(b, h, q, kv):
        return q >= kv

    return BlockMask.from_kv_blocks(
        *ordered(partial), *ordered(full), BLOCK_SIZE=tile, mask_mod=causal, seq_lengths=(n, n)
    )


def dflash_layout(S: int, N: int, B: int, device: str, seed: int = 0) -> BlockLayout:
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, S - B, (1, N), generator=g).sort(dim=1).values
    return BlockLayout(
        anchors.to(device),
        torch.ones(1, N, dtype=torch.bool, device=device),
        torch.zeros(1, S, dtype=torch.long, device=device),
        B,
    )


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(fn, device: str, repeats: int = 3) -> tuple[float | None, float]:
    """(peak GiB of one call, median seconds over `repeats` calls), after one untimed call (compiles)."""
    fn()
    sync(device)
    _, peak = peak_memory(fn, device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return (None if peak is None else peak / GIB), statistics.median(times)


def device_memory_gib(device: str) -> float | None:
    if device.startswith("cuda"):
        return torch.cuda.get_device_properties(torch.device(device)).total_memory / GIB
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, small shapes")
    args = ap.parse_args()
    smoke = args.smoke
    device = "cpu" if smoke or not torch.cuda.is_available() else "cuda:0"
    on_gpu = device.startswith("cuda")
    dtype = torch.float32 if smoke else torch.bfloat16
    rows: list[dict] = []

    def row(section: str, what: str, peak: float | None, seconds: float | None, note: str = "") -> None:
        rows.append({"section": section, "what": what, "peak_gib": peak, "seconds": seconds, "note": note})
        p = "-" if peak is None else f"{peak:.3f}"
        s = "-" if seconds is None else f"{seconds * 1e3:.1f} ms"
        print(f"  {what:<58} peak {p:>9} GiB  {s:>11}  {note}", flush=True)

    # 1. One causal layer.
    S, H, D = (2048, 4, 32) if smoke else (16384, 16, 128)
    section = f"causal layer S={S} H={H} D={D} {str(dtype).removeprefix('torch.')}"
    print(section)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, H, S, D, generator=g).to(device, dtype) for _ in range(3))
    bm = causal_block_mask(S, device)
    dense_est = H * S * S * 4 / GIB
    peak, sec = measure(lambda: flex_attention_entry(q, k, v, bm), device)
    row(section, "flex, compiled (dflashkit entry), forward", peak, sec)
    if on_gpu:
        qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

        def fwd_bwd():
            flex_attention_entry(qg, kg, vg, bm).sum().backward()

        peak, sec = measure(fwd_bwd, device)
        row(section, "flex, compiled (dflashkit entry), forward+backward", peak, sec)
        del qg, kg, vg
    total = device_memory_gib(device)
    if total is not None and dense_est * 3.5 > total:
        row(section, "flex without compile (dense fall-back), forward", None, None, "skipped: too large here")
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                peak, sec = measure(lambda: flex_attention(q, k, v, block_mask=bm), device, repeats=1)
                row(section, "flex without compile (dense fall-back), forward", peak, sec)
            except torch.OutOfMemoryError:
                row(section, "flex without compile (dense fall-back), forward", None, None, "out of memory")
        if on_gpu:
            torch.cuda.empty_cache()
    try:
        preflight_dense(1, H, S, S, what="sdpa attention")
        note = f"allowed by pre-flight ({dense_est:.2f} GiB of scores)"
    except DenseBudgetError as e:
        note = "refused by pre-flight: " + str(e).split(" score matrix ")[1].split(";")[0]
    row(section, "sdpa with a dense mask (dflashkit backend)", None, None, note)
    del q, k, v

    # 2. DFlash block mask construction.
    mask_shapes = [(512, 32), (1024, 64)] if smoke else [(3072, 512), (16384, 1024)]
    compiled_cbm = torch.compile(create_block_mask)
    for S, N in mask_shapes:
        B = 16
        layout = dflash_layout(S, N, B, device)
        section = f"DFlash block mask S={S} N={N} B={B} (Q={N * B}, KV={S + N * B})"
        print(section)
        mm = dflash_mask_mod(layout)
        peak, sec = measure(lambda layout=layout: flex_block_mask(layout), device)
        row(section, "tile-level from anchors (dflashkit)", peak, sec)
        args_ = (1, None, layout.q_len, layout.kv_len)
        try:
            peak, sec = measure(
                lambda mm=mm, a=args_: create_block_mask(mm, *a, device=device), device, repeats=1
            )
            row(section, "create_block_mask (dense evaluation)", peak, sec)
        except torch.OutOfMemoryError:
            row(section, "create_block_mask (dense evaluation)", None, None, "out of memory")
        try:
            peak, sec = measure(lambda mm=mm, a=args_: compiled_cbm(mm, *a, device=device), device)
            ref = compiled_cbm(mm, *args_, device=device)
            same = all(
                torch.equal(getattr(flex_block_mask(layout), n), getattr(ref, n))
                for n in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")
            )
            row(
                section,
                "torch.compile(create_block_mask)",
                peak,
                sec,
                "same tiles as ours" if same else "TILES DIFFER",
            )
        except Exception as e:  # a torch compile failure is a result here, not a crash
            row(
                section,
                "torch.compile(create_block_mask)",
                None,
                None,
                f"failed: {type(e).__name__}: {str(e).splitlines()[0][:90]}",
            )
        if on_gpu:
            torch.cuda.empty_cache()

    # 3. DFlash attention at the paper's shape.
    shape = (
        AttentionShape(1, 4, 2, 32, 512, 32, 16, dtype=dtype)
        if smoke
        else AttentionShape(1, 32, 8, 128, 3072, 512, 16, dtype=dtype)
    )
    section = (
        f"DFlash attention context {shape.context_len}, {shape.num_blocks} anchors, B={shape.block_size}, "
        f"{shape.q_heads}/{shape.kv_heads} heads, D={shape.head_dim}"
    )
    print(section)
    layout = dflash_layout(shape.context_len, shape.num_blocks, shape.block_size, device)
    bm = flex_block_mask(layout)
    q, k, v = example_inputs(shape, device)
    peak, sec = measure(lambda: flex_attention_entry(q, k, v, bm), device)
    dense_est = shape.q_heads * shape.q_len * shape.kv_len * 4 / GIB
    row(
        section,
        "flex, compiled (dflashkit entry), forward",
        peak,
        sec,
        f"dense scores would be {dense_est:.1f} GiB",
    )
    if on_gpu:
        qg, kg, vg = example_inputs(shape, device, requires_grad=True)

        def dflash_fwd_bwd():
            flex_attention_entry(qg, kg, vg, bm).float().square().mean().backward()

        peak, sec = measure(dflash_fwd_bwd, device)
        row(section, "flex, compiled (dflashkit entry), forward+backward", peak, sec)

    report = {
        "device": torch.cuda.get_device_name(0) if on_gpu else "cpu",
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "smoke": smoke,
        "rows": rows,
    }
    print()
    print(f"{'section / what':<100} {'peak GiB':>9} {'time':>11}")
    last = None
    for r in rows:
        if r["section"] != last:
            print(r["section"])
            last = r["section"]
        p = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.3f}"
        s = "-" if r["seconds"] is None else f"{r['seconds'] * 1e3:.1f} ms"
        print(f"  {r['what']:<98} {p:>9} {s:>11}  {r['note']}")
    write_report("attention_memory.json", report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
