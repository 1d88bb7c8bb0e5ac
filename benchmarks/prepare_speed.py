"""`prepare`'s generation speed: the slot generator against transformers' `generate`, on the same prompts, in
one run.

Both answer the same requests (first user turns of chitchat and ShareGPT, seeded, rendered with the target's
chat template, greedy, up to --max-new-tokens): transformers' `generate` through the ``hf`` backend (fixed
left-padded batches of --hf-batch prompts, shortest first, as `prepare --backend hf` runs it; on a GPU a quarter
of the prompts, taken evenly through them: --hf-prompts), then the slot
generator at each --slots setting, twice each (cold: its first run captures the CUDA graphs; warm: the graphs
replayed). Reported per row: new tokens, seconds, new tokens/s, slot occupancy, decode steps; the ratio
ours/hf; how many greedy replies are identical between the two (bf16: they part after near ties); and the
floor: at the measured copy bandwidth, what a decode step over all slots must read (the weights once, the K/V
cache of each slot's mean context) gives a ceiling in tokens/s.

    python benchmarks/prepare_speed.py                    # GPU, the embedded target (needs its GGUF)
    python benchmarks/prepare_speed.py --smoke            # CPU, a few prompts, no CUDA graphs

Writes $OUT/prepare_speed.json: {"ours_tok_s", "hf_generate_tok_s", "device", "new_tokens", ...}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import fill_defaults, write_report  # noqa: E402


def make_requests(tokenizer: Any, sources: list[str], n: int, max_prompt: int, max_new: int) -> list[Any]:
    from dflashkit.data.chat import generation_prompt_ids
    from dflashkit.data.generation import Request
    from dflashkit.data.sources import load_prompts, select_prompts

    per = -(-n // len(sources))
    out: list[Any] = []
    for name in sources:
        prompts = select_prompts(load_prompts(name, max_turns=1).prompts, None, seed=0)
        taken = 0
        for p in prompts:
            if taken == per or len(out) == n:
                break
            ids = generation_prompt_ids(tokenizer, p.messages(), enable_thinking=False)
            if len(ids) <= max_prompt:
                out.append(Request(f"{name}:{p.id}", tuple(ids), max_new))
                taken += 1
    return out


def spread(requests: list[Any], n: int | None) -> list[Any]:
    """``n`` of the requests taken evenly through the list (every source in its share), or all of them."""
    if n is None or n >= len(requests):
        return requests
    step = len(requests) / n
    return [requests[int(i * step)] for i in range(n)]


def random_setup(args: Any, device: Any) -> tuple[Any, Any, list[int], list[Any], list[str]]:
    """A random-weight target of a TARGET_SHAPES shape and random prompts (no tokenizer: the hf rows pad
    with token 0)."""
    import torch
    import transformers

    from dflashkit.data.generation import Request
    from fanout import TARGET_SHAPES

    cls_name, kwargs = TARGET_SHAPES[args.random_weights]
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            getattr(transformers, cls_name)(**kwargs), dtype=getattr(torch, args.dtype)
        ).eval()
    lo, hi = (int(x) for x in args.prompt_tokens.split(","))
    g = torch.Generator().manual_seed(0)
    vocab = kwargs["vocab_size"]
    requests = [
        Request(
            f"r{i}",
            tuple(
                torch.randint(
                    3, vocab, (int(torch.randint(lo, hi + 1, (), generator=g)),), generator=g
                ).tolist()
            ),
            args.max_new_tokens,
        )
        for i in range(args.prompts)
    ]

    class NoTokenizer:
        pad_token_id = 0

    return model, NoTokenizer(), [2], requests, [f"random {args.random_weights}, prompts {lo}-{hi} tokens"]


def copy_bandwidth(device: Any) -> float | None:
    """Bytes/s (read + write) of a 1 GiB device-to-device copy, median of 10; None on the CPU."""
    import torch

    if device.type != "cuda":
        return None
    a = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * a.numel() * a.element_size() / statistics.median(times[2:])


def run_backend(backend: Any, requests: list[Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    import torch

    from dflashkit.data.generation import ListSource

    source = ListSource(requests)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    stats = backend.run(source)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    row = {
        "backend": backend.name,
        "requests": stats.requests,
        "new_tokens": stats.new_tokens,
        "prompt_tokens": stats.prompt_tokens,
        "seconds": round(seconds, 3),
        "tok_s": round(stats.new_tokens / seconds, 1),
        **{k: round(v, 4) if isinstance(v, float) else v for k, v in stats.extra.items()},
    }
    return row, source.replies


def profile(model: Any, eos: list[int], requests: list[Any], slots: int, args: Any) -> None:
    """Device time by kernel over a run of `requests` with eager fixed-shape steps (the kernels a CUDA
    graph replays, each seen by the profiler)."""
    import os

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from dflashkit.data.generator import SlotGenerator, SlotSettings

    settings = SlotSettings(
        slots=slots, capacity=args.max_prompt_tokens + args.max_new_tokens, cuda_graphs=False
    )
    gen = SlotGenerator.create(model, eos, settings, fixed_shapes=True)
    run_backend(gen, requests[: max(1, len(requests) // 8)])  # warm
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        row, _ = run_backend(gen, requests)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(f"profile: {row}\n{table}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "prepare_profile.txt").write_text(f"{row}\n{table}\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU, few prompts")
    ap.add_argument("--target", default="embedded")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", type=int, default=None)
    ap.add_argument("--sources", default="chitchat,sharegpt")
    ap.add_argument("--max-new-tokens", type=int, default=None)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--hf-batch", type=int, default=None)
    ap.add_argument(
        "--hf-prompts",
        type=int,
        default=None,
        help="transformers' generate answers this many of the prompts, taken evenly through them (default on a "
        "GPU: 2,048 of 8,192; its batches are fixed, so its rate hardly depends on the count, while the slot "
        "generator needs many more prompts than slots to reach its steady rate); all of them on the CPU",
    )
    ap.add_argument("--slots", default=None, help="comma-separated slot counts (default 1024,2048)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--prefill",
        default="auto",
        help="comma-separated prefill modes at each --slots setting: auto (packed on a GPU in bf16), packed, "
        "padded (e.g. packed,padded: both side by side)",
    )
    ap.add_argument(
        "--random-weights",
        metavar="SHAPE",
        help="a random-weight target of this fanout.TARGET_SHAPES shape (e.g. smollm2-135m: nothing to "
        "carry) with random prompts of --prompt-tokens lengths; replies run to --max-new-tokens, so this "
        "measures steady decoding, not the real mix",
    )
    ap.add_argument("--prompt-tokens", default="40,400", metavar="MIN,MAX", help="random prompt lengths")
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="then profile N requests through the largest slot setting with eager fixed-shape steps: the "
        "kernels that take the device time ($OUT/prepare_profile.txt)",
    )
    args = ap.parse_args()
    gpu = not args.smoke
    fill_defaults(
        args,
        {
            "dtype": "bfloat16" if gpu else "float32",
            "prompts": 8192 if gpu else 12,
            "hf_prompts": 2048 if gpu else None,
            "max_new_tokens": 256 if gpu else 16,
            "hf_batch": 384 if gpu else 4,
            "slots": "1024,2048" if gpu else "4",
        },
    )
    import torch

    from dflashkit.data.generator import SlotGenerator, SlotSettings
    from dflashkit.data.hf_generate import HFGenerator
    from dflashkit.data.regenerate import eos_token_ids, load_target

    device = torch.device("cuda" if gpu else "cpu")
    t0 = time.perf_counter()
    if args.random_weights:
        model, tok, eos, requests, sources = random_setup(args, device)
    else:
        model, tok = load_target(args.target, dtype=args.dtype, device=str(device))
        eos = eos_token_ids(model, tok)
        sources = [s for s in args.sources.split(",") if s]
        requests = make_requests(tok, sources, args.prompts, args.max_prompt_tokens, args.max_new_tokens)
    load_s = time.perf_counter() - t0
    print(f"{len(requests)} prompts ({', '.join(sources)}), target loaded in {load_s:.1f} s", flush=True)

    rows: list[dict[str, Any]] = []
    hf_replies: dict[str, Any] = {}
    if not args.skip_hf:
        pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
        hf = HFGenerator(model, eos, pad, args.hf_batch)
        run_backend(hf, requests[: min(8, len(requests))])  # CUDA and cuBLAS start-up out of the timing
        hf_requests = spread(requests, args.hf_prompts)
        row, hf_replies = run_backend(hf, hf_requests)
        row["setting"] = f"generate, batch {args.hf_batch}" + (
            f", {len(hf_requests)} of the prompts" if len(hf_requests) < len(requests) else ""
        )
        rows.append(row)
        print(row, flush=True)

    kv_token_bytes = None
    modes = {"auto": None, "packed": True, "padded": False}
    settings_list = [
        (int(x), mode) for x in args.slots.split(",") if x for mode in args.prefill.split(",") if mode
    ]
    for slots, mode in settings_list:
        settings = SlotSettings(
            slots=slots, capacity=args.max_prompt_tokens + args.max_new_tokens, packed_prefill=modes[mode]
        )
        t0 = time.perf_counter()
        gen = SlotGenerator.create(model, eos, settings)
        build_s = time.perf_counter() - t0
        kv_token_bytes = gen.cache.nbytes() / ((slots + 1) * gen.capacity)
        label = f"slots {slots}" + (
            "" if mode == "auto" else f", {'packed' if gen.packed else 'padded'} prefill"
        )
        for run in ("cold", "warm"):
            row, replies = run_backend(gen, requests)
            row["setting"] = f"{label}, {run}" + (
                f" (+{build_s:.1f} s weights/cache)" if run == "cold" else ""
            )
            row["slots"], row["run"], row["packed_prefill"] = slots, run, gen.packed
            if hf_replies:
                same = sum(replies[k].ids == hf_replies[k].ids for k in hf_replies)
                row["identical_to_hf"] = round(same / len(hf_replies), 4)
            rows.append(row)
            print(row, flush=True)
        del gen
        if gpu:
            torch.cuda.empty_cache()

    if args.profile:
        profile(model, eos, requests[: args.profile], int(args.slots.split(",")[-1]), args)

    ours = [r for r in rows if r["backend"] == "slots"]
    best = max(ours, key=lambda r: r["tok_s"])
    hf_row = next((r for r in rows if r["backend"] == "hf"), None)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bandwidth = copy_bandwidth(device)
    floor = None
    if bandwidth and kv_token_bytes:
        mean_context = best["prompt_tokens"] / best["requests"] + best["new_tokens"] / best["requests"] / 2
        per_token = weight_bytes / best["slots"] + mean_context * kv_token_bytes
        floor = {
            "copy_bandwidth_gb_s": round(bandwidth / 1e9, 1),
            "weight_bytes": weight_bytes,
            "kv_bytes_per_position": kv_token_bytes,
            "mean_context": round(mean_context, 1),
            "slots": best["slots"],
            "ceiling_tok_s": round(bandwidth / per_token),
        }
    report = {
        "ours_tok_s": best["tok_s"],
        "hf_generate_tok_s": hf_row["tok_s"] if hf_row else None,
        "speedup": round(best["tok_s"] / hf_row["tok_s"], 2) if hf_row else None,
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "new_tokens": best["new_tokens"],
        "prompts": len(requests),
        "hf_prompts": hf_row["requests"] if hf_row else None,
        "sources": sources,
        "dtype": args.dtype,
        "max_new_tokens": args.max_new_tokens,
        "torch": torch.__version__,
        "rows": rows,
        "floor": floor,
    }
    write_report("prepare_speed.json", report)
    print(f"\n{'setting':52s} {'new tokens':>11s} {'s':>8s} {'tok/s':>10s} {'occupancy':>9s} {'=hf':>6s}")
    for r in rows:
        occ = f"{r['slot_occupancy']:.2f}" if "slot_occupancy" in r else "-"
        same = f"{r['identical_to_hf']:.2f}" if "identical_to_hf" in r else "-"
        print(
            f"{r['setting']:52s} {r['new_tokens']:11,d} {r['seconds']:8.2f} {r['tok_s']:10,.0f} {occ:>9s} {same:>6s}"
        )
    if hf_row:
        print(f"ours / hf: {report['speedup']}x ({best['setting']})")
    if floor:
        print(f"floor: {floor['ceiling_tok_s']:,} tok/s at {floor['copy_bandwidth_gb_s']} GB/s ({floor})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
