"""Training step of a Qwen3-8B-shaped drafter at the paper's shapes: ms/step, TFLOP/s, fraction of the measured
bf16 matmul peak, peak memory; our flex path vs our sdpa-dense path (same run, same shapes), then larger anchor
counts on the flex path until one does not fit.

Drafter: hidden 4096, 32/8 heads, head_dim 128, intermediate 12288, 5 layers, vocabulary 151936, B=16, 5 target
layers fused (fc 20480 -> 4096); random weights, random target features, random token ids. A step is the trainer's
own `block_step` (anchors, masks, drafter forward under bf16 autocast with fp32 parameters, chunked frozen-head
cross-entropy with position decay) + backward + grad clipping + AdamW.

FLOPs are counted from the shapes (see `step_flops`): matmuls of the drafter forward x3 (forward + backward), the
attention over the keys each query may see x3 (flex skips masked tiles; the dense path computes all of them, but we
count only the useful ones for both), and the frozen lm_head forward + input gradient only (x2).

    python benchmarks/train_step.py                  # GPU
    python benchmarks/train_step.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_report  # noqa: E402

PAPER = dict(
    hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=12288, layers=5, vocab=151936, block=16, n_target=5
)
SMOKE = dict(hidden=64, heads=4, kv_heads=2, head_dim=16, inter=128, layers=2, vocab=512, block=4, n_target=2)


def step_flops(s: dict, context: int, anchors: int, visible_keys: float) -> dict[str, float]:
    """FLOPs of one training step (multiply-add = 2)."""
    H, D, hq, hkv, inter, L, V, B = (
        s[k] for k in ("hidden", "head_dim", "heads", "kv_heads", "inter", "layers", "vocab", "block")
    )
    q = anchors * B  # query tokens
    kv = context + q  # rows that get K/V projections
    fc = 2 * context * (s["n_target"] * H) * H
    per_layer = (
        2 * q * H * hq * D  # q_proj
        + 2 * kv * H * hkv * D * 2  # k_proj, v_proj
        + 2 * q * hq * D * H  # o_proj
        + 3 * 2 * q * H * inter  # gate, up, down
        + 2 * 2 * q * hq * D * visible_keys  # QK^T and PV over the visible keys
    )
    drafter = fc + L * per_layer
    head = 2 * q * H * V
    return {"drafter_fwd": drafter, "head_fwd": head, "total": 3 * drafter + 2 * head}


def measured_peak_tflops(device: str) -> float:
    import torch

    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        a @ b
        e1.record()
        torch.cuda.synchronize()
        t.append(e0.elapsed_time(e1) / 1e3)
    t.sort()
    return 2 * 8192**3 / t[len(t) // 2] / 1e12


def run_case(s: dict, context: int, anchors: int, backend: str, steps: int, device: str) -> dict:
    import torch

    from dflashkit.config import load_config
    from dflashkit.model.config import make_config
    from dflashkit.model.drafter import DFlashDrafter
    from dflashkit.train import trainer

    torch.manual_seed(0)
    dc = make_config(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["inter"],
        vocab_size=s["vocab"], block_size=s["block"], target_layer_ids=list(range(s["n_target"])),
        num_target_layers=max(36, s["n_target"]), mask_token_id=s["vocab"] - 1, rope_theta=1e6,
    )  # fmt: skip
    drafter = DFlashDrafter(dc).to(device)
    cfg = load_config(
        None,
        [f"train.num_anchors={anchors}", f"train.max_len={context}", "train.gamma=7", "train.chunk_blocks=64",
         "train.autocast=" + ("bf16" if device != "cpu" else "off")],
    )  # fmt: skip

    class FrozenTarget:  # the two frozen pieces a step needs from the target
        def __init__(self):
            self.emb = torch.randn(s["vocab"], s["hidden"], device=device, dtype=torch.bfloat16) * 0.02
            self.head = torch.randn(s["vocab"], s["hidden"], device=device, dtype=torch.bfloat16) * 0.02

        def embed(self, ids):
            return self.emb[ids]

        def lm_head_weight(self):
            return self.head

    target = FrozenTarget()
    T = context
    g = torch.Generator(device="cpu").manual_seed(0)
    rows = trainer.Rows(
        input_ids=torch.randint(0, s["vocab"] - 1, (1, T), generator=g).to(device),
        loss_mask=torch.ones(1, T, dtype=torch.bool, device=device),
        doc_ids=torch.zeros(1, T, dtype=torch.long, device=device),
        position_ids=torch.arange(T, device=device)[None],
    )
    feats = torch.randn(1, T, s["n_target"] * s["hidden"], generator=g).to(device, torch.bfloat16)
    argmax = torch.randint(0, s["vocab"], (1, T), generator=g).to(device)
    params = [p for p in drafter.parameters()]
    opt = torch.optim.AdamW(params, lr=6e-4, fused=device != "cpu")
    ac = trainer.autocast_context(cfg, torch.device(device))

    def step():
        opt.zero_grad(set_to_none=True)
        out = trainer.block_step(drafter, target, rows, feats, argmax, cfg, backend, g, ac)
        out.loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return out

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    t0 = time.perf_counter()
    out = step()  # compiles flex (forward + backward) on the first call
    sync()
    first = time.perf_counter() - t0
    step()
    sync()
    if device != "cpu":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = step()
        sync()
        times.append(time.perf_counter() - t0)
    times.sort()
    med = times[len(times) // 2]
    layout = out.layout
    # keys each query may see: its context strictly before its anchor + its own block
    visible = float(layout.anchors.float().mean()) + s["block"]
    flops = step_flops(s, context, anchors, visible)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else float("nan")
    return {
        "backend": backend, "context": context, "anchors": anchors, "query_tokens": anchors * s["block"],
        "ms_per_step": med * 1e3, "first_step_s": first, "tflop_per_step": flops["total"] / 1e12,
        "tflops": flops["total"] / med / 1e12, "query_tokens_per_s": anchors * s["block"] / med,
        "peak_gib": peak, "loss": float(out.loss.loss.detach()),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--anchors", default="512", help="anchor counts for the flex/sdpa comparison")
    ap.add_argument("--scale-anchors", default="1024,2048,4096,6144,8192", help="larger counts, flex only")
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()

    import torch

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    s = SMOKE if args.smoke else PAPER
    context = 256 if args.smoke else args.context
    os.environ.setdefault("DFLASHKIT_DENSE_BUDGET_GIB", "100")  # let the dense comparison run where it fits
    peak = measured_peak_tflops(device) if device == "cuda" else float("nan")
    rows = []
    t_start = time.perf_counter()
    cases = [(a, b) for a in map(int, args.anchors.split(",")) for b in ("flex", "sdpa")]
    cases += [(a, "flex") for a in map(int, args.scale_anchors.split(","))] if not args.smoke else []
    if args.smoke:  # the CPU has no flex backward
        cases = [(16, "sdpa"), (16, "eager")]
    for anchors, backend in cases:
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"backend": backend, "anchors": anchors, "error": "skipped: time budget"})
            continue
        try:
            r = run_case(s, context, anchors, backend, 3 if args.smoke else args.steps, device)
            r["fraction_of_peak"] = r["tflops"] / peak if peak == peak else float("nan")
        except torch.OutOfMemoryError:
            r = {"backend": backend, "anchors": anchors, "error": "out of memory"}
        except Exception as e:  # noqa: BLE001 - a benchmark row records what failed
            r = {"backend": backend, "anchors": anchors, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        rows.append(r)
        print(json.dumps(r), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()

    print(f"\nmeasured bf16 matmul peak: {peak:.0f} TFLOP/s ({device})")
    print(
        f"{'backend':7} {'anchors':>7} {'ms/step':>8} {'TFLOP/s':>8} {'of peak':>8} {'peak GiB':>9} {'1st step s':>10}  note"
    )
    for r in rows:
        if "error" in r:
            print(
                f"{r['backend']:7} {r['anchors']:7d} {'-':>8} {'-':>8} {'-':>8} {'-':>9} {'-':>10}  {r['error']}"
            )
            continue
        print(
            f"{r['backend']:7} {r['anchors']:7d} {r['ms_per_step']:8.1f} {r['tflops']:8.0f} {r['fraction_of_peak']:8.1%} "
            f"{r['peak_gib']:9.2f} {r['first_step_s']:10.1f}  {r['tflop_per_step']:.1f} TFLOP/step, floor "
            f"{r['tflop_per_step'] / peak * 1e3 if peak == peak else float('nan'):.0f} ms"
        )
    write_report("train_step.json", {"peak_tflops": peak, "rows": rows})


if __name__ == "__main__":
    main()
