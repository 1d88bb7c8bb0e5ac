"""`prepare`'s host time: the slot generator run through the real regeneration path (`regenerate`: prompts
rendered with the target's chat template, replies detokenised, records written to the append-only cache)
on a random-weight target with the target's own tokenizer, so that the device work is small and the host's
share (everything between decode steps and prefill passes) shows.

    python benchmarks/prepare_host.py                       # CPU: 64 slots, tiny random target
    python benchmarks/prepare_host.py --cprofile 30         # + the host's top functions (cumulative)

Records: chitchat first turns and ShareGPT conversations of up to two turns, sampled (temperature 0.7,
top-p 0.95) as the GPU recipe samples them (--temperature 0: greedy); each request's reply length is its
own (8..--max-new-tokens, fixed by its key: a random target seldom ends a reply itself). Reported per run
and as the median of --repeat runs: new tokens, seconds, new tokens/s, the manifest's split (decode,
prefill, host seconds; host overlap: host work done while decode steps ran). Writes
$OUT/prepare_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import write_report  # noqa: E402

SHAPES: dict[str, dict[str, int]] = {
    # the embedded target's vocabulary on a tiny body: the device work is small, the host's is real
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4),
    "smollm2-135m": dict(
        hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9
    ),
}


def make_model(shape: str, vocab: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    kw = SHAPES[shape]
    torch.manual_seed(0)
    config = LlamaConfig(
        **kw,
        num_key_value_heads=kw["num_attention_heads"] // 3 if kw["num_attention_heads"] % 3 == 0 else 2,
        vocab_size=vocab,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


def vary_reply_lengths(max_new_tokens: int) -> None:
    """A random target seldom writes an end token, so every reply would run to max_new_tokens and all
    slots would end together; give each request its own length instead (8..max_new_tokens, fixed by its
    key), so that slots end and refill at staggered steps as real replies do."""
    import zlib

    from dflashkit.data import regenerate
    from dflashkit.data.generation import Request

    def request(**kw: Any) -> Request:
        kw["max_new_tokens"] = 8 + zlib.crc32(kw["key"].encode()) % max(1, max_new_tokens - 7)
        return Request(**kw)

    regenerate.Request = request  # type: ignore[attr-defined,assignment]


def make_jobs(records: int, seed: int, temperature: float) -> list[Any]:
    from dflashkit.data.regenerate import Job, record_id
    from dflashkit.data.sources import load_prompts, select_prompts

    jobs: list[Any] = []
    for name, share, samples in (("chitchat", 0.5, 2), ("sharegpt", 0.5, 4)):
        n = int(records * share) // samples
        prompts = select_prompts(load_prompts(name, max_turns=2).prompts, n, seed)
        jobs += [
            Job(record_id(p.id, k), p, name, k, temperature, 0.95 if temperature else 1.0)
            for p in prompts
            for k in range(samples)
        ]
    return jobs


def run_once(
    model: Any, tokenizer: Any, jobs: list[Any], args: Any, prof: cProfile.Profile | None
) -> dict[str, Any]:
    from dflashkit.data.generator import SlotGenerator, SlotSettings
    from dflashkit.data.parallel import TokenizerPool
    from dflashkit.data.regenerate import GenerationSettings, eos_token_ids, regenerate

    eos = eos_token_ids(model, tokenizer)
    settings = SlotSettings(
        slots=args.slots,
        capacity=args.max_prompt_tokens + args.max_new_tokens,
        prefill_rows=min(64, args.slots),
        steps_per_sync=args.steps_per_sync,
    )
    gen = GenerationSettings(max_new_tokens=args.max_new_tokens, max_prompt_tokens=args.max_prompt_tokens)
    pool = TokenizerPool(tokenizer)  # as `prepare` makes it: later rounds rendered in batches
    backend = SlotGenerator.create(model, eos, settings, fixed_shapes=not args.exact_shapes)
    with tempfile.TemporaryDirectory() as d:
        if prof is not None:
            prof.enable()
        t0 = time.perf_counter()
        stats = regenerate(jobs, backend, tokenizer, Path(d) / "cache.jsonl", gen, progress=False, pool=pool)
        seconds = time.perf_counter() - t0
        if prof is not None:
            prof.disable()
    x = stats.extra
    return {
        "records": stats.generated,
        "new_tokens": stats.new_tokens,
        "seconds": round(seconds, 3),
        "tok_s": round(stats.new_tokens / seconds, 1),
        "decode_seconds": x["decode_seconds"],
        "prefill_seconds": x["prefill_seconds"],
        "host_seconds": x["host_seconds"],
        "host_source_seconds": x.get("host_source_seconds", 0.0),
        "host_overlap_seconds": x.get("host_overlap_seconds", 0.0),
        "decode_steps": x["decode_steps"],
        "host_ms_per_look": round(
            1e3 * x["host_seconds"] / max(1, x["decode_steps"] / backend.sync_every), 3
        ),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="tiny", choices=sorted(SHAPES))
    ap.add_argument("--records", type=int, default=256)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument("--steps-per-sync", type=int, default=4)
    ap.add_argument(
        "--exact-shapes",
        action="store_true",
        help="the CPU's eager steps (live slots only, one step a look) instead of the GPU's fixed shapes "
        "(all slots, --steps-per-sync steps a look)",
    )
    ap.add_argument("--temperature", type=float, default=0.7, help="0: greedy (less device work on the CPU)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--cprofile", type=int, default=0, metavar="N", help="print the top N functions (cumulative)"
    )
    args = ap.parse_args()
    import torch

    from dflashkit.data.regenerate import load_target

    torch.set_num_threads(args.threads)
    _, tokenizer = load_target("embedded", weights=False)
    model = make_model(args.shape, len(tokenizer))
    vary_reply_lengths(args.max_new_tokens)
    jobs = make_jobs(args.records, seed=0, temperature=args.temperature)
    rows = []
    for i in range(args.repeat):
        prof = cProfile.Profile() if args.cprofile and i == args.repeat - 1 else None
        rows.append(run_once(model, tokenizer, jobs, args, prof))
        print(rows[-1], flush=True)
        if prof is not None:
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(args.cprofile)
            print(s.getvalue())
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    print(f"median of {len(rows)}: {med}")
    write_report("prepare_host.json", {"args": vars(args), "rows": rows, "median": med})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
