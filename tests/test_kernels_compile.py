"""Every kernel launch of the graphs engine's Triton layers compiles for a Hopper GPU (sm_90), with and without
programmatic dependent launch, on a machine without a GPU.

Triton's interpreter (the CPU tests) runs a kernel's Python and never meets what Triton's compiler refuses (a
loop-carried variable that changes type, a block size that is not a power of 2): such a refusal cost the
first GPU run of 2026-12-05 a test. So the engine's launches are recorded here from its warm-up in
the interpreter (every step it replays: one token, a block, the draft step, a tree's step, build and walk), in
float32 and bf16, and compiled in a child process with the interpreter off, through the ptxas that ships with
Triton, for an H200's target: as the GPU launches them (no operand upcast, bf16's tl.dot precision) and, where
a kernel takes it, with programmatic dependent launch on."""

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from dflashkit.infer.kernels.decoder import KERNELS, interpreting  # noqa: E402
from dflashkit.infer.kernels.tree import KERNELS as TREE_KERNELS  # noqa: E402

PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")

# the child: each recorded launch compiled for sm_90 (and again with GDC on where the kernel takes it)
CHILD = r"""
import importlib, json, sys
sys.path.insert(0, sys.argv[2])  # the tests' folder
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from test_kernels_compile import as_launched

target = GPUTarget("cuda", 90, 32)
failures, compiled, seen = [], 0, set()
for r in json.load(open(sys.argv[1])):
    fn = getattr(importlib.import_module(r["module"]), r["name"])
    variants = [False, True] if any(p.name == "GDC" for p in fn.params) else [None]
    for gdc in variants:
        sig, consts, options = as_launched(fn, r, gdc)
        key = json.dumps([r["name"], sig, consts, options], sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            triton.compile(ASTSource(fn, sig, consts), target=target, options=options)
            compiled += 1
        except Exception as e:
            failures.append(f"{r['name']} {consts}: {type(e).__name__}: {str(e)[-600:]}")
print(json.dumps({"compiled": compiled, "failures": failures}))
"""


def as_launched(fn, r: dict, gdc: bool | None) -> tuple[dict, dict, dict]:
    """A launch ``Recorder`` recorded, of the jit function fn, as a GPU launches it: its signature (constants
    marked), its constants and its options. The operands are not upcast and tl.dot's precision is the dtype's;
    ``gdc`` True or False (where the kernel takes GDC): dependent launch on or off; None: as recorded."""
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    model_dtype = "bf16" if "bf16" in r["pointers"].values() else "fp32"
    sig, consts, options = {}, {}, dict(r["options"])
    for name, value in r["values"].items():
        if name in constexpr:
            consts[name] = value
        elif name in r["pointers"]:
            sig[name] = "*" + r["pointers"][name]
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
    if "UPCAST" in consts:  # the GPU's own operands: no upcast, tl.dot's precision as the dtype's
        consts["UPCAST"] = False
        consts["PRECISION"] = "ieee" if model_dtype == "fp32" else "tf32"
    if gdc is not None and "GDC" in constexpr:
        consts["GDC"] = gdc
        options.pop("launch_pdl", None)
        if gdc:
            options["launch_pdl"] = True
    sig.update({k: "constexpr" for k in consts})
    return sig, consts, options


DTYPES = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int8: "i8",
}


class Recorder:
    """Stands in for a kernel: records each launch's arguments by name, then launches the real one."""

    def __init__(self, module: str, name: str, fn, records: list):
        self.module, self.name, self.fn, self.records = module, name, fn, records

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
            bound = inspect.signature(self.fn.fn).bind_partial(*args, **kwargs)
            values, pointers = {}, {}
            for name, value in bound.arguments.items():
                if isinstance(value, torch.Tensor):
                    pointers[name] = DTYPES[value.dtype]
                    values[name] = None
                else:
                    values[name] = value
            record = dict(
                module=self.module, name=self.name, values=values, pointers=pointers, options=options
            )
            self.records.append(record)
            return self.fn[grid](*args, **kwargs, **options)

        return launch


def record_engine_launches(tmp_path, monkeypatch) -> list[dict]:
    """The launches of a kernels engine's warm-up with a tree budget, in float32 and bf16 (the interpreter)."""
    from dflashkit.infer.graph_engine import GraphEngine
    from dflashkit.infer.kernels import decoder as kernels
    from dflashkit.infer.kernels import tree as tree_kernels
    from dflashkit.target.hf import TargetModel
    from dflashkit.target.slot_decoder import SlotCache
    from test_graph_engine import tiny_pair

    records: list[dict] = []
    real = kernels._compiled()
    source = "dflashkit.infer.kernels.decoder_source"
    recorders = {k: Recorder(source, f"{k}_kernel", getattr(real, k), records) for k in KERNELS}
    monkeypatch.setattr(kernels, "_compiled", lambda: SimpleNamespace(**recorders))
    for name in tree_kernels.KERNELS:
        fn = getattr(tree_kernels, name)
        monkeypatch.setattr(tree_kernels, name, Recorder("dflashkit.infer.kernels.tree", name, fn, records))
    tiny, drafter, _ = tiny_pair(tmp_path)
    for dtype in (torch.float32, torch.bfloat16):
        target = tiny if dtype == torch.float32 else TargetModel.load(tmp_path / "target", dtype=dtype)
        engine = GraphEngine(
            target, drafter.to(dtype), capacity=64, graphs=False, layers="triton", tree_budget=6
        )
        engine.warm_up()
        # kernel_tiles' variants off by default: split-K in the qkv and up kernels of 2 shares (the default's
        # 4), for a block; the attention's splits merged by the last, for a token and a block; attention
        # programs of 16 rows
        w = engine.w
        variants = kernels.Tiles(qkv_splits=2, up_splits=2, merge_in_attention=True, attention_rows=16)
        row_tiles = kernels.Tiles(tree_rows=16)  # a step of 24 rows in programs of 16 (a program axis)
        for m, tiles in ((1, variants), (8, variants), (24, row_tiles)):
            ids, start = torch.zeros(1, m, dtype=torch.long), torch.zeros(1, dtype=torch.long)
            cache = SlotCache(w, slots=1, capacity=64)
            kernels.decode_by_kernels(w, cache, ids, start, torch.empty(m, w.vocab_size), tiles=tiles)
    return records


@pytest.mark.skipif(not interpreting(), reason="a GPU machine compiles the kernels when it runs them")
@pytest.mark.skipif(not PTXAS.is_file(), reason="this Triton has no NVIDIA backend (ptxas)")
def test_every_engine_launch_compiles_for_hopper(tmp_path, monkeypatch):
    records = record_engine_launches(tmp_path, monkeypatch)
    names = {r["name"] for r in records}
    assert {f"{k}_kernel" for k in KERNELS} | set(TREE_KERNELS) <= names
    assert {r["values"].get("DOT") for r in records if r["name"] == "qkv_kernel"} == {False, True}
    assert {r["values"].get("MERGE") for r in records if r["name"] == "attention_kernel"} == {False, True}
    assert {r["name"] for r in records if r["values"].get("SPLIT_K", 1) > 1} == {
        "qkv_kernel",
        "up_kernel",
        "residual_kernel",
    }
    assert any(r["values"].get("TREE") for r in records if r["name"] == "attention_kernel")
    assert {r["name"] for r in records if r["values"].get("ROW_TILES", 1) > 1} == {
        "qkv_kernel",
        "up_kernel",
        "residual_kernel",
    }
    file = tmp_path / "launches.json"
    file.write_text(json.dumps(records))
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    run = subprocess.run(
        [sys.executable, "-c", CHILD, str(file), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert not out["failures"], "\n".join(out["failures"])
    # every kernel of a layer compiled with GDC off and on, for one token and a block, in both dtypes
    assert out["compiled"] >= 2 * 2 * 2 * len(KERNELS)
