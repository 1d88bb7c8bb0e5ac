"""Training step of a Qwen3-8B-shaped drafter at the paper's shapes: ms/step, TFLOP/s, fraction of the measured
bf16 matmul peak, peak memory; our flex path vs our sdpa-dense path vs the `speculators` DFlash model (same run,
same shapes), then larger anchor counts on the flex path until one does not fit.

Drafter: hidden 4096, 32/8 heads, head_dim 128, intermediate 12288, 5 layers, vocabulary 151936, B=16, 5 target
layers fused (fc 20480 -> 4096); random weights, random target features, random token ids. A step is the trainer's
own `block_step` (anchors, masks, drafter forward under bf16 autocast with fp32 parameters, chunked frozen-head
cross-entropy with position decay) + backward + grad clipping + AdamW.

FLOPs are counted from the shapes (see `step_flops`): matmuls of the drafter forward x3 (forward + backward), the
attention over the keys each query may see x3 (flex skips masked tiles; the dense path computes all of them, but we
count only the useful ones for both), and the frozen lm_head forward + input gradient only (x2).

The `speculators` rows (`--peers speculators`, on by default) build PyPI `speculators`' `DFlashDraftModel` at the
same shapes (fp32 parameters, full attention on every layer through its default `simple_flex_attention`, one packed
row of `--context` tokens, `max_anchors` = anchors) and time the step the way its own trainer
(`speculators/train/trainer.py`, `Trainer.train_epoch`) runs it: `model(**batch, **train_call_kwargs)` under
`torch.autocast(device, bf16)` (the model's `forward` is `torch.compile`d by speculators itself when CUDA is there),
`zero_grad`, `loss.backward()`, `clip_grad_norm_(model.parameters(), 1.0)`, and its own `build_optimizers` (AdamW).
`train_call_kwargs` come from `DFlashDraftModel.get_trainer_kwargs` with `loss_fn=ce`,
`loss_implementation=eager` (its default fused Triton loss fails under the compiled forward on torch 2.11) and
`fixed-exp-decay` gamma 7, our loss weighting (its DFlash default is D-PACE). Its LR scheduler step and per-step
metric logging are left out. Its step also computes the frozen verifier logits for the labels (`verifier_lm_head`
over the context, 2 x context x 4096 x 151936 = 3.8 TFLOP at the paper's shapes), and it keeps the embedding,
`lm_head` and `verifier_lm_head` as frozen fp32 parameters (3 x 2.5 GB), which count in its peak memory; the FLOP
count is the same as ours (`step_flops`, anchors drawn by its own `select_anchors`), so the verifier logits are not
counted. On the CPU (`--smoke`) it runs with `draft_attn_impl=sdpa`, its own fall-back, since flex attention has no
CPU backward. Without `speculators` installed its row records the import error and the rest runs. The GPU machine
gets it as wheels: see benchmarks/README.md.

    python benchmarks/train_step.py                  # GPU
    python benchmarks/train_step.py --smoke          # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
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


def time_steps(step, steps: int, device: str):
    """First step (cold compile) in s, median of `steps` timed steps in s, and the last step's output; the peak
    memory counter is reset after a second, untimed step."""
    import torch

    sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
    t0 = time.perf_counter()
    out = step()
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
    return first, times[len(times) // 2], out


KERNEL_KINDS = (  # (kind, substrings of CUDA kernel names), first match wins
    ("flex attention", ("flex", "attention", "fmha")),
    ("matmul", ("gemm", "cutlass", "nvjet", "sm90_", "sm100_", "matmul", "cublas")),
    ("fused by compile (triton)", ("triton",)),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("eager pointwise/reduce", ("elementwise", "vectorized", "reduce", "softmax", "cat", "index", "copy")),
)


def profile_steps(step, device: str, n: int = 3) -> dict:
    """CUDA kernel time of `n` steps by kind and the top kernels, per step (torch profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            step()
        torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us and e.key not in ("ProfilerStep*",):
            kernels[e.key] = kernels.get(e.key, 0.0) + us / 1e3 / n
    by_kind: dict[str, float] = {}
    for name, ms in kernels.items():
        low = name.lower()
        kind = next((k for k, subs in KERNEL_KINDS if any(x in low for x in subs)), "other")
        by_kind[kind] = by_kind.get(kind, 0.0) + ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:12]
    return {
        "gpu_ms_per_step": sum(kernels.values()),
        "by_kind_ms": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "top_kernels_ms": [(name[:90], ms) for name, ms in top],
    }


def run_case(
    s: dict, context: int, anchors: int, backend: str, steps: int, device: str, profile: bool = False
) -> dict:
    """One of our paths: "flex" (the trainer's default on a GPU: flex attention, each layer and loss chunk a
    compiled region), "flex-eager" (flex attention alone compiled, train.compile=off), "sdpa" (dense mask)."""
    import torch

    from dflashkit.config import load_config
    from dflashkit.data.rows import Rows
    from dflashkit.model.config import make_config
    from dflashkit.model.drafter import DFlashDrafter
    from dflashkit.runtime.devices import autocast_context, use_compiled_regions
    from dflashkit.train.step import block_step

    torch.manual_seed(0)
    config = make_config(
        hidden_size=s["hidden"], num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"], intermediate_size=s["inter"],
        vocab_size=s["vocab"], block_size=s["block"], target_layer_ids=list(range(s["n_target"])),
        num_target_layers=max(36, s["n_target"]), mask_token_id=s["vocab"] - 1, rope_theta=1e6,
    )  # fmt: skip
    drafter = DFlashDrafter(config).to(device)
    attn = "flex" if backend.startswith("flex") else backend
    cfg = load_config(
        None,
        [f"train.num_anchors={anchors}", f"train.max_len={context}", "train.gamma=7", "train.chunk_blocks=64",
         "train.autocast=" + ("bf16" if device != "cpu" else "off"),
         "train.compile=" + ("off" if backend == "flex-eager" else "auto")],
    )  # fmt: skip
    drafter.compiled_regions = use_compiled_regions(cfg, attn)

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
    rows = Rows(
        input_ids=torch.randint(0, s["vocab"] - 1, (1, T), generator=g).to(device),
        loss_mask=torch.ones(1, T, dtype=torch.bool, device=device),
        doc_ids=torch.zeros(1, T, dtype=torch.long, device=device),
        position_ids=torch.arange(T, device=device)[None],
    )
    feats = torch.randn(1, T, s["n_target"] * s["hidden"], generator=g).to(device, torch.bfloat16)
    argmax = torch.randint(0, s["vocab"], (1, T), generator=g).to(device)
    params = [p for p in drafter.parameters()]
    opt = torch.optim.AdamW(params, lr=6e-4, fused=device != "cpu")
    autocast = autocast_context(cfg, torch.device(device))

    def step():
        opt.zero_grad(set_to_none=True)
        out = block_step(drafter, target, rows, feats, argmax, cfg, attn, g, autocast)
        out.loss.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        return out

    first, med, out = time_steps(step, steps, device)  # compiles flex (forward + backward) on the first call
    layout = out.layout
    # keys each query may see: its context strictly before its anchor + its own block
    visible = float(layout.anchors.float().mean()) + s["block"]
    flops = step_flops(s, context, anchors, visible)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else float("nan")
    prof = profile_steps(step, device) if profile and device == "cuda" else None
    return {
        "backend": backend, "compiled_regions": drafter.compiled_regions, "profile": prof,
        "context": context, "anchors": anchors, "query_tokens": anchors * s["block"],
        "ms_per_step": med * 1e3, "first_step_s": first, "tflop_per_step": flops["total"] / 1e12,
        "tflops": flops["total"] / med / 1e12, "query_tokens_per_s": anchors * s["block"] / med,
        "peak_gib": peak, "loss": float(out.loss.loss.detach()),
    }  # fmt: skip


def run_speculators_case(s: dict, context: int, anchors: int, steps: int, device: str) -> dict:
    """The same step through PyPI `speculators`' DFlash model, called the way its trainer calls it."""
    import torch

    try:
        from speculators import SpeculatorModel, SpeculatorsConfig, VerifierConfig
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from speculators.models.dflash.utils import select_anchors
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from speculators.train.optimizers import build_optimizers
        from speculators.train.trainer import TrainerConfig
        from transformers import Qwen3Config
    except ImportError as e:
        return {
            "backend": "speculators",
            "anchors": anchors,
            "error": f"not installed: {type(e).__name__}: {e}",
        }

    # flex attention has no CPU backward; on the CPU use speculators' own dense fall-back
    attn = "simple_flex_attention" if device != "cpu" else "sdpa"
    torch.manual_seed(0)
    L = s["layers"]
    layer_config = Qwen3Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=L,
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        hidden_act="silu", max_position_embeddings=40960, rms_norm_eps=1e-6, tie_word_embeddings=False,
        use_sliding_window=False, layer_types=["full_attention"] * L,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    )  # fmt: skip
    layer_config._attn_implementation = attn  # what its trainer's --draft-attn-impl sets
    config = DFlashSpeculatorConfig(
        transformer_layer_config=layer_config, draft_vocab_size=s["vocab"], block_size=s["block"],
        aux_hidden_state_layer_ids=list(range(s["n_target"])), mask_token_id=s["vocab"] - 1,
        sample_from_anchor=False,
        speculators_config=SpeculatorsConfig(
            algorithm="dflash", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=s["block"] - 1)],
            verifier=VerifierConfig(name_or_path=None, architectures=["Qwen3ForCausalLM"]),
        ),
    )  # fmt: skip
    model = DFlashDraftModel(config)
    with torch.no_grad():  # the verifier's weights (loaded from the verifier in a real run): random here
        model.embed_tokens.weight.normal_(0, 0.02)
        model.lm_head.weight.normal_(0, 0.02)
        model.verifier_lm_head.weight.copy_(model.lm_head.weight)
    SpeculatorModel.verify_training_compatible(model)
    model.to(device)  # fp32 master weights, as its trainer keeps them
    model.train()
    trainer_config = TrainerConfig(lr=6e-4, num_epochs=1, save_path="unused")
    optimizers = build_optimizers(model, trainer_config)
    train_call_kwargs, _ = DFlashDraftModel.get_trainer_kwargs(
        loss_fn="ce", loss_implementation="eager", dflash_decay_gamma=7.0, max_anchors=anchors,
        per_position_loss_weight="fixed-exp-decay",
    )  # fmt: skip

    T = context
    g = torch.Generator(device="cpu").manual_seed(0)
    batch = {  # what its CollateFn yields for one packed document of T tokens, moved to the device
        "hidden_states": torch.randn(1, T, s["n_target"] * s["hidden"], generator=g).to(
            device, torch.bfloat16
        ),
        "input_ids": torch.randint(0, s["vocab"] - 1, (1, T), generator=g).to(device),
        "verifier_last_hidden_states": torch.randn(1, T, s["hidden"], generator=g).to(device, torch.bfloat16),
        "loss_mask": torch.ones(1, T, dtype=torch.bool, device=device),
        "position_ids": torch.arange(T, device=device)[None],
        "document_ids": torch.zeros(1, T, dtype=torch.long, device=device),
        "error_records": 0,
    }
    params = list(model.parameters())

    def step():  # Trainer.train_epoch, one batch
        with torch.autocast(device, dtype=torch.bfloat16):
            _draft_tokens, loss, _metrics = model(**batch, **train_call_kwargs)
        for opt in optimizers:
            opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for opt in optimizers:
            opt.step()
        return loss

    first, med, loss = time_steps(step, steps, device)  # the first call compiles its forward and block mask
    anchor_positions, _ = select_anchors(batch["loss_mask"], anchors, s["block"])
    visible = float(anchor_positions.float().mean()) + s["block"]
    flops = step_flops(s, context, anchors, visible)
    q = anchors * s["block"]
    verifier_logits = 2 * min(q, context) * s["hidden"] * s["vocab"]  # under no_grad; not in the FLOP count
    peak = torch.cuda.max_memory_allocated() / 2**30 if device != "cpu" else float("nan")
    version = importlib.metadata.version("speculators")
    return {
        "backend": "speculators", "version": version, "attn": attn, "context": context,
        "anchors": anchors, "query_tokens": q, "ms_per_step": med * 1e3, "first_step_s": first,
        "tflop_per_step": flops["total"] / 1e12, "tflops": flops["total"] / med / 1e12,
        "query_tokens_per_s": q / med, "peak_gib": peak, "loss": float(loss.detach()),
        "uncounted_verifier_logits_tflop": verifier_logits / 1e12,
    }  # fmt: skip


def ratios(rows: list[dict], device_name: str = "") -> list[dict]:
    """Ours over speculators at each anchor count both ran: ms/step and peak GiB (below 1: ours is faster/smaller).
    Each row also carries the keys `benchmarks/results/train_step.json` is read by: ours_ms, speculators_ms,
    ratio, fraction_of_peak (ours), peak_gib (ours), device."""
    peer = {r["anchors"]: r for r in rows if r["backend"] == "speculators" and "error" not in r}
    out = []
    for r in rows:
        p = peer.get(r.get("anchors"))
        if p is None or "error" in r or r["backend"] == "speculators":
            continue
        out.append({
            "ours": r["backend"], "anchors": r["anchors"], "ms_per_step": r["ms_per_step"],
            "speculators_ms_per_step": p["ms_per_step"], "ms_ratio": r["ms_per_step"] / p["ms_per_step"],
            "peak_gib": r["peak_gib"], "speculators_peak_gib": p["peak_gib"],
            "peak_ratio": r["peak_gib"] / p["peak_gib"] if p["peak_gib"] else float("nan"),
            "ours_ms": r["ms_per_step"], "speculators_ms": p["ms_per_step"],
            "ratio": r["ms_per_step"] / p["ms_per_step"], "fraction_of_peak": r.get("fraction_of_peak"),
            "device": device_name,
        })  # fmt: skip
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=3072)
    ap.add_argument("--anchors", default="512", help="anchor counts for the flex/sdpa/peers comparison")
    ap.add_argument("--scale-anchors", default="1024,2048,4096,6144,8192", help="larger counts, flex only")
    ap.add_argument("--peers", default="speculators", help="other implementations at --anchors ('' for none)")
    ap.add_argument("--ours", default="flex,flex-eager,sdpa", help="our paths at --anchors")
    ap.add_argument("--profile", action="store_true", help="profile 3 steps of the first flex case")
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()

    import torch

    def counts(text: str) -> list[int]:
        return [int(a) for a in text.split(",") if a.strip()]

    device = "cpu" if args.smoke or not torch.cuda.is_available() else "cuda"
    s = SMOKE if args.smoke else PAPER
    context = 256 if args.smoke else args.context
    os.environ.setdefault("DFLASHKIT_DENSE_BUDGET_GIB", "100")  # let the dense comparison run where it fits
    peak = measured_peak_tflops(device) if device == "cuda" else float("nan")
    peers = [p for p in args.peers.split(",") if p.strip()]
    unknown = set(peers) - {"speculators"}
    if unknown:
        ap.error(f"unknown peers: {sorted(unknown)}")
    rows = []
    t_start = time.perf_counter()
    ours = [b for b in args.ours.split(",") if b.strip()]
    cases = [(a, b) for a in counts(args.anchors) for b in (*ours[:1], *peers, *ours[1:])]
    cases += [(a, "flex") for a in counts(args.scale_anchors)] if not args.smoke else []
    if args.smoke:  # the CPU has no flex backward
        cases = [(16, "sdpa"), (16, "eager")] + [(16, p) for p in peers]
    for anchors, backend in cases:
        if time.perf_counter() - t_start > args.budget_s:
            rows.append({"backend": backend, "anchors": anchors, "error": "skipped: time budget"})
            continue
        steps = 3 if args.smoke else args.steps
        try:
            if backend == "speculators":
                r = run_speculators_case(s, context, anchors, steps, device)
            else:
                first_flex = args.profile and backend == "flex" and not any(x.get("profile") for x in rows)
                r = run_case(s, context, anchors, backend, steps, device, profile=first_flex)
            if "error" not in r:
                r["fraction_of_peak"] = r["tflops"] / peak if peak == peak else float("nan")
        except torch.OutOfMemoryError:
            r = {"backend": backend, "anchors": anchors, "error": "out of memory"}
        except Exception as e:  # noqa: BLE001 - a benchmark row records what failed
            r = {"backend": backend, "anchors": anchors, "error": f"{type(e).__name__}: {str(e)[:160]}"}
        if device == "cuda":  # what a case leaves behind would count in the next one's peak
            gc.collect()
            torch.cuda.empty_cache()
            r["left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
        rows.append(r)
        print(json.dumps(r), flush=True)

    print(f"\nmeasured bf16 matmul peak: {peak:.0f} TFLOP/s ({device})")
    print(
        f"{'backend':11} {'anchors':>7} {'ms/step':>8} {'TFLOP/s':>8} {'of peak':>8} {'peak GiB':>9} {'1st step s':>10}  note"
    )
    for r in rows:
        if "error" in r:
            print(
                f"{r['backend']:11} {r['anchors']:7d} {'-':>8} {'-':>8} {'-':>8} {'-':>9} {'-':>10}  {r['error']}"
            )
            continue
        note = (
            f"{r['tflop_per_step']:.1f} TFLOP/step, floor "
            f"{r['tflop_per_step'] / peak * 1e3 if peak == peak else float('nan'):.0f} ms"
        )
        if r["backend"] == "speculators":
            note += (
                f"; speculators {r['version']}, {r['attn']}, eager ce loss; +{r['uncounted_verifier_logits_tflop']:.1f}"
                " TFLOP verifier logits not counted"
            )
        print(
            f"{r['backend']:11} {r['anchors']:7d} {r['ms_per_step']:8.1f} {r['tflops']:8.0f} {r['fraction_of_peak']:8.1%} "
            f"{r['peak_gib']:9.2f} {r['first_step_s']:10.1f}  {note}"
        )
    for r in rows:
        if r.get("profile"):
            pr = r["profile"]
            print(
                f"\nprofile, {r['backend']} at {r['anchors']} anchors: {pr['gpu_ms_per_step']:.1f} ms of GPU kernels/step"
            )
            for kind, ms in pr["by_kind_ms"].items():
                print(f"  {kind:28} {ms:7.1f} ms")
            for name, ms in pr["top_kernels_ms"]:
                print(f"    {ms:7.2f} ms  {name}")
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    side_by_side = ratios(rows, device_name)
    if side_by_side:
        print("\nours / speculators, same run, same shapes:")
    for x in side_by_side:
        print(
            f"  {x['ours']:5} {x['anchors']:5d} anchors: ms/step {x['ms_ratio']:.2f}x ({x['ms_per_step']:.1f} vs "
            f"{x['speculators_ms_per_step']:.1f}), peak GiB {x['peak_ratio']:.2f}x ({x['peak_gib']:.2f} vs "
            f"{x['speculators_peak_gib']:.2f})"
        )
    write_report(
        "train_step.json", {"peak_tflops": peak, "rows": rows, "ours_over_speculators": side_by_side}
    )


if __name__ == "__main__":
    main()
