"""The decoder kernels' register use under several ``Tiles``, on a machine without a GPU.

A tile that makes a kernel spill registers is slow whatever else it does (the twenty-third session's broadcast
blocks: 3.0-3.4 ms a block step). This records the matmul and attention kernels' launches of one embedded-shaped
layer (a token, a block of 8, 16 and 32 rows) in Triton's interpreter, compiles each for sm_90 as the GPU would
launch it (no operand upcast, dependent launch on), and reads the registers and spill bytes from ``ptxas -v``
(the ptxas that ships with Triton): a check of a variant before it costs device time. Each program's compile
time and PTX size come with it: ``--context`` compiles a drafter's context write instead (the qkv kernel's key
and value columns, with a DFlash drafter's head norms) for a prompt's row counts, in ``--dtype``.

    python benchmarks/kernel_registers.py --variants default,qusplit1         # the variants of kernel_tiles.py
    python benchmarks/kernel_registers.py --context --rows 32,64,128 --dtype float32
    python benchmarks/kernel_registers.py --head-norm --rows 8,16                 # a drafter's block step
    python benchmarks/kernel_registers.py --smoke                             # a tiny layer, one variant
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

from report import write_json

ROOT = Path(__file__).resolve().parent.parent


def record(
    variants: list[str],
    rows: tuple[int, ...],
    smoke: bool,
    dtype: str = "bfloat16",
    head_norm: bool = False,
    context: bool = False,
) -> dict[str, list[dict]]:
    """Each (variant, rows) step's kernel launches, recorded in the interpreter (this process). ``head_norm``:
    Qwen3-shaped layers (per-head query and key norms: a DFlash drafter's); ``context``: a drafter's context
    write of that many rows instead of a step."""
    import torch
    import transformers

    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "benchmarks")]
    from dflashkit.target import kernels
    from dflashkit.target.slot_decoder import DecoderWeights, SlotCache
    from kernel_tiles import VARIANTS
    from test_kernels_compile import Recorder

    shape = (
        dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
        if smoke
        else dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3)
    )
    head_norm = head_norm or context
    make = transformers.Qwen3Config if head_norm else transformers.LlamaConfig
    extra = dict(head_dim=shape["hidden_size"] // shape["num_attention_heads"]) if head_norm else {}
    cfg = make(
        num_hidden_layers=1,
        vocab_size=512,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        **shape,
        **extra,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, dtype))
    w = DecoderWeights.from_hf(model)
    original = kernels._compiled
    real = original()
    out: dict[str, list[dict]] = {}
    try:
        for name in variants:
            for m in rows:
                records: list[dict] = []
                fakes = {
                    k: Recorder("dflashkit.target.kernel_source", f"{k}_kernel", getattr(real, k), records)
                    for k in kernels.KERNELS
                }
                kernels._compiled = lambda fakes=fakes: SimpleNamespace(**fakes)  # type: ignore[assignment]
                cache = SlotCache(w, slots=1, capacity=256 if smoke else 1024)
                ids, start = torch.zeros(1, m, dtype=torch.long), torch.tensor([100 if smoke else 400])
                tiles = replace(VARIANTS[name], pdl=False)  # the interpreter runs no dependent launch
                if context:
                    x = torch.randn(m, w.embed.shape[1], dtype=w.dtype)
                    kv = kernels.key_value_weights(w)
                    kernels.write_keys_values(w, kv, cache, x, w.layers[0].input_norm, start, tiles=tiles)
                else:
                    kernels.decode_by_kernels(w, cache, ids, start, torch.empty(m, w.vocab_size), tiles=tiles)
                out[f"{name} [1,{m}]"] = records
    finally:
        kernels._compiled = original
    return out


def registers(ptx: str, ptxas: Path) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) of a kernel's PTX for sm_90a, by ``ptxas -v``."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run(
            [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "k.o")],
            capture_output=True,
            text=True,
        )
    regs = re.search(r"Used (\d+) registers", run.stderr)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", run.stderr)
    if regs is None or spill is None:
        raise RuntimeError(f"ptxas -v said nothing of registers: {run.stderr[-500:]}")
    return int(regs.group(1)), int(spill.group(1)), int(spill.group(2))


def compile_all(launches: dict[str, list[dict]]) -> list[dict]:
    """Every recorded launch compiled for sm_90 (this process must have the interpreter off)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sys.path.insert(0, str(ROOT / "tests"))
    from test_kernels_compile import as_launched

    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    target = GPUTarget("cuda", 90, 32)
    rows, done = [], {}
    for label, records in launches.items():
        for r in records:
            fn = getattr(importlib.import_module(r["module"]), r["name"])
            sig, consts, options = as_launched(fn, r, gdc=True)  # dependent launch on
            key = json.dumps([r["name"], consts, options], sort_keys=True, default=str)  # warps matter
            if key not in done:
                began = time.perf_counter()
                kernel = triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
                seconds = time.perf_counter() - began
                done[key] = (*registers(kernel.asm["ptx"], ptxas), seconds, len(kernel.asm["ptx"]) // 1024)
            regs, stores, loads, seconds, ptx_kib = done[key]
            tile = {k: consts[k] for k in ("DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K") if k in consts}
            tile["warps"] = options.get("num_warps", 4)
            rows.append(
                dict(
                    step=label,
                    kernel=r["name"],
                    registers=regs,
                    spill_stores=stores,
                    spill_loads=loads,
                    compile_s=round(seconds, 1),
                    ptx_kib=ptx_kib,
                    **tile,
                )
            )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="default", help="comma-separated kernel_tiles VARIANTS")
    p.add_argument("--rows", default="1,8,16,32", help="the steps' rows")
    p.add_argument("--smoke", action="store_true", help="a tiny layer, the first variant, 1 and 8 rows")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument(
        "--head-norm", action="store_true", help="a drafter's layers (per-head query and key norms)"
    )
    p.add_argument("--context", action="store_true", help="a drafter's context write of --rows rows")
    p.add_argument("--out", type=Path, help="write the rows as JSON here")
    p.add_argument("--compile-from", type=Path, help=argparse.SUPPRESS)  # the child: compile these launches
    args = p.parse_args()
    if args.compile_from:
        print(json.dumps(compile_all(json.loads(args.compile_from.read_text()))))
        return
    variants = args.variants.split(",")[:1] if args.smoke else args.variants.split(",")
    rows = (1, 8) if args.smoke else tuple(int(r) for r in args.rows.split(","))
    os.environ["TRITON_INTERPRET"] = "1"  # before Triton's first import: the launches run on the CPU
    launches = record(variants, rows, args.smoke, args.dtype, args.head_norm, args.context)
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "launches.json"
        file.write_text(json.dumps(launches))
        env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(Path(tmp) / "triton")}
        run = subprocess.run(
            [sys.executable, __file__, "--compile-from", str(file)], capture_output=True, text=True, env=env
        )
    if run.returncode:
        sys.exit(f"compiling for sm_90 failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"{'step':18s} {'kernel':17s} {'regs':>4s} {'spills':>9s} {'compile':>8s} {'PTX':>8s}  tile")
    for r in result:
        tile = " ".join(
            f"{k}={r[k]}" for k in ("DOT", "BLOCK_M", "BLOCK_N", "BLOCK_K", "SPLIT_K", "warps") if k in r
        )
        spills = f"{r['spill_stores']}/{r['spill_loads']}"
        ptx = f"{r['ptx_kib']} KiB"
        print(
            f"{r['step']:18s} {r['kernel']:17s} {r['registers']:4d} {spills:>9s} {r['compile_s']:7.1f}s"
            f" {ptx:>8s}  {tile}"
        )
    write_json(args.out, result)


if __name__ == "__main__":
    main()
