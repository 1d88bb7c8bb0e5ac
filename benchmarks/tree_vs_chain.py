"""Tree verification against the chain: tau, tokens/s, speedup and the cost of a round, per node budget.

For each prompt set (MT-Bench, the held-out split of the drafter's dataset) every reply is decoded, one after
another on the same prompt, autoregressively (the baseline), with chain rounds, and with tree rounds of each
node budget (`dflashkit.infer.tree`), all greedy on one decode engine, so that every figure of a reply is
measured side by side. A later turn of a conversation follows the target's own reply to the earlier one (the
autoregressive reply), the same for every configuration. Per set and configuration:

- tau: tokens per target pass over all rounds (what the speedup follows);
- AR and speculative tokens/s (decode time, prefill excluded) and the speedup;
- the round cost in autoregressive tokens: tau x AR tok/s / speculative tok/s (speedup = tau / round cost);
- for trees, tau and round cost relative to the chain (the issue's goal: tau +30% at no more than +10% round
  cost), and whether the greedy output equalled the autoregressive output (always, in float32).

Writes `tree_vs_chain.json` and `tree_vs_chain.md` to --out (and to $OUT on the GPU machine).

    python benchmarks/tree_vs_chain.py -c configs/embedded.yaml --out runs/embedded/tree_vs_chain   # CPU
    python benchmarks/tree_vs_chain.py --drafter DIR --data DIR --engine graphs --dtype bfloat16 \\
        --max-prompts 80 --max-new-tokens 256 --out OUT                                          # GPU
    python benchmarks/tree_vs_chain.py -c configs/embedded.yaml --smoke --out /tmp/tvc             # seconds
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from dflashkit.infer.engine import ENGINE_CHOICES, LAYER_CHOICES  # noqa: E402
from report import write_report  # noqa: E402

CHAIN = "chain"
RESULTS = Path(__file__).resolve().parent / "results" / "decode_steps.json"


def configurations(budgets: list[int]) -> list[tuple[str, int]]:
    """(name, node budget (0: the chain)) of each measured configuration: the chain, then a tree per budget
    ("tree-8", ...). Reports of 2026-12-04 also name a tree attention ("tree-8-masked"):
    ``--from`` and ``--update-results 8-masked`` still read them."""
    return [(CHAIN, 0)] + [(f"tree-{b}", b) for b in budgets]


def summarise(rows: list[dict[str, Any]], configs: list[tuple[str, int]]) -> dict[str, Any]:
    """The figures of one set from its per-reply rows: AR tokens/s, and per configuration tau, tokens/s,
    speedup, round cost and (trees) the ratios to the chain."""
    ar_tokens = sum(r["ar_tokens"] for r in rows)
    ar_seconds = sum(r["ar_seconds"] for r in rows)
    ar_tps = ar_tokens / ar_seconds if ar_seconds > 0 else math.nan
    out: dict[str, Any] = {"replies": len(rows), "ar_tokens_per_second": ar_tps, "configs": {}}
    for name, budget in configs:
        rounds = [t for r in rows for t in r[name]["accept_lengths"]]
        tokens = sum(r[name]["tokens"] for r in rows)
        seconds = sum(r[name]["seconds"] for r in rows)
        tau = sum(rounds) / len(rounds) if rounds else math.nan
        spec_tps = tokens / seconds if seconds > 0 else math.nan
        fig = {
            "tree_budget": budget or None,
            "rounds": len(rounds),
            "new_tokens": tokens,
            "tau": tau,
            "spec_tokens_per_second": spec_tps,
            "speedup": spec_tps / ar_tps,
            "round_cost_ar_tokens": tau * ar_tps / spec_tps,
            "equal_to_ar": all(r[name]["equal_to_ar"] for r in rows),
        }
        if budget:
            chain = out["configs"][CHAIN]
            fig["tau_gain_vs_chain"] = tau / chain["tau"] - 1
            fig["round_cost_vs_chain"] = fig["round_cost_ar_tokens"] / chain["round_cost_ar_tokens"] - 1
        out["configs"][name] = fig
    return out


def report_from_bench(
    chain: dict[str, Any], tree: dict[str, Any], temperature: float = 0.0
) -> dict[str, Any]:
    """This script's report from two ``dflashkit bench`` results of one drafter: ``chain`` (chain rounds) and
    ``tree`` (``--tree-budget N``), over the sets both measured at ``temperature`` (0: greedy; at T > 0 the
    chain's rounds take bench's rule, the tree's the exact rule). Each command's speedup is against its own
    autoregressive baseline, so the round costs (in AR tokens) compare across the two commands; the outputs
    were not compared with the autoregressive ones here (bench checks fp32 losslessness instead)."""
    at = f"{temperature:g}"  # bench's key for the temperature
    budget = tree["settings"].get("tree_budget")
    if chain["settings"].get("tree_budget") or not budget:
        sys.exit("--from-bench: the first file must hold chain rounds and the second tree rounds")
    for key in ("drafter_weights", "engine", "dtype", "max_new_tokens"):
        if chain["settings"].get(key) != tree["settings"].get(key):
            sys.exit(f"--from-bench: the two benches differ in {key}: not one drafter on one engine")
    configs = [(CHAIN, 0, chain), (f"tree-{budget}", budget, tree)]
    sets: dict[str, Any] = {}
    for name in chain["sets"]:
        runs = [(c, b, r["sets"].get(name, {}).get("temperatures", {}).get(at)) for c, b, r in configs]
        if any(t is None for _, _, t in runs):
            continue
        out: dict[str, Any] = {"replies": runs[0][2]["responses"], "configs": {}}
        out["ar_tokens_per_second"] = runs[0][2]["ar_tokens_per_second"]
        for config, b, t in runs:
            fig = {
                "tree_budget": b or None,
                "rounds": t["rounds"],
                "new_tokens": t["new_tokens"],
                "tau": t["tau"],
                "spec_tokens_per_second": t["spec_tokens_per_second"],
                "ar_tokens_per_second": t["ar_tokens_per_second"],
                "speedup": t["speedup"],
                "round_cost_ar_tokens": t["tau"] / t["speedup"],
                "equal_to_ar": None,
            }
            if b:
                first = out["configs"][CHAIN]
                fig["tau_gain_vs_chain"] = fig["tau"] / first["tau"] - 1
                fig["round_cost_vs_chain"] = fig["round_cost_ar_tokens"] / first["round_cost_ar_tokens"] - 1
            out["configs"][config] = fig
        sets[name] = out
    if not sets:
        sys.exit(f"--from-bench: no set measured at T={at} by both benches")
    settings = {**chain["settings"], "tree_budget": None, "temperature": temperature}
    return {"settings": settings, "budgets": [budget], "sets": sets}


def markdown(result: dict[str, Any]) -> str:
    s = result["settings"]
    temperature = s.get("temperature") or 0
    drawn = f"T = {temperature:g} (trees: the exact rule)" if temperature else "greedy"
    lines = [
        f"{s['drafter']} (B={s['block_size']}) on {s['target']}: {s['engine']} engine, {s['dtype']}, {s['device']}, "
        f"{drawn}, {s['max_new_tokens']} new tokens per reply",
        "",
        f"`{result['command']}`",
        "",
        "| set | rounds of | replies | tau | tau vs chain | AR tok/s | spec tok/s | speedup | round cost (AR tokens) "
        "| round cost vs chain | greedy output = AR |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    one_step = s.get("one_step_rounds") or {}
    for set_name, res in result["sets"].items():
        for name, f in res["configs"].items():
            shown = f"{name} (calls)" if one_step.get(name) is False else name
            gain = f"{f['tau_gain_vs_chain']:+.1%}" if "tau_gain_vs_chain" in f else "-"
            cost = f"{f['round_cost_vs_chain']:+.1%}" if "round_cost_vs_chain" in f else "-"
            same = {True: "yes", False: "no", None: "-"}[f["equal_to_ar"]]
            tps = f.get("ar_tokens_per_second", res["ar_tokens_per_second"])
            lines.append(
                f"| {set_name} | {shown} | {res['replies']} | {f['tau']:.2f} | {gain} | "
                f"{tps:.1f} | {f['spec_tokens_per_second']:.1f} | {f['speedup']:.2f}x | "
                f"{f['round_cost_ar_tokens']:.2f} | {cost} | {same} |"
            )
    if False in one_step.values():
        lines += [
            "",
            "(calls): rounds as separate calls, not one captured step (a tree smaller than a block)",
        ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "-c", "--config", help="a training run config: its target, dtype, drafter (best/) and data"
    )
    ap.add_argument("--drafter", help="drafter checkpoint folder")
    ap.add_argument("--target", help="'embedded' or an HF model folder")
    ap.add_argument("--data", help="the drafter's dataset folder (the held-out set)")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the config's, else bfloat16")
    ap.add_argument("--device", default="auto")
    ap.add_argument(
        "--engine",
        default="auto",
        choices=ENGINE_CHOICES,
        help="decode engine of every configuration (auto: the fastest lossless one for trees on this device)",
    )
    ap.add_argument(
        "--layers",
        default="auto",
        choices=LAYER_CHOICES,
        help="the graphs engine's layers (as bench takes them)",
    )
    ap.add_argument("--sets", default="mtbench,heldout")
    ap.add_argument("--budgets", default="8,16,32,64", help="node budgets of the trees")
    ap.add_argument("--max-prompts", type=int, default=16, help="conversations per set")
    ap.add_argument("--max-turns", type=int, default=None, help="user turns per conversation (default: all)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--smoke", action="store_true", help="2 prompts, 1 turn, 16 tokens, budgets 8,16")
    ap.add_argument("--out", help="folder for tree_vs_chain.json and tree_vs_chain.md")
    ap.add_argument(
        "--from", dest="from_file", help="a tree_vs_chain.json of an earlier run: report it, measure nothing"
    )
    ap.add_argument(
        "--from-bench",
        nargs=2,
        metavar=("CHAIN", "TREE"),
        help="two bench.json files of one drafter, chain rounds and tree rounds (`dflashkit bench "
        "--tree-budget N`): their sets at --temperature as one report, measure nothing (each speedup against "
        "its own command's autoregressive baseline)",
    )
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="with --from-bench: the benches' temperature to report (0)",
    )
    ap.add_argument(
        "--update-results",
        metavar="CONFIG",
        help="write tree_tau_gain (MT-Bench, trees of a node budget: 32; an older report's tree attention "
        f"named: 32-masked) and a tree block into {RESULTS}",
    )
    args = ap.parse_args()
    if args.from_bench:
        chain, tree = (json.loads(Path(f).read_text()) for f in args.from_bench)
        report = report_from_bench(chain, tree, args.temperature)
        if args.update_results and args.temperature:
            sys.exit("--update-results takes the T=0 report (the issue's tree_tau_gain is greedy)")
        report["command"] = " ".join(sys.argv)
        print(markdown(report))
        if args.out:
            Path(args.out).mkdir(parents=True, exist_ok=True)
            (Path(args.out) / "tree_vs_chain.json").write_text(json.dumps(report, indent=2) + "\n")
        if args.update_results:
            update_results(report, " and ".join(args.from_bench), args.update_results)
        return
    if args.from_file:
        report = json.loads(Path(args.from_file).read_text())
        print(markdown(report))
        if args.update_results:
            update_results(report, args.from_file, args.update_results)
        return
    if not args.out:
        ap.error("--out is required (unless --from)")
    if args.smoke:
        args.max_prompts, args.max_turns, args.max_new_tokens, args.budgets = 2, 1, 16, "8,16"

    import torch
    from transformers import AutoTokenizer

    from dflashkit.data.regenerate import eos_token_ids
    from dflashkit.infer import bench
    from dflashkit.infer.bench import first_difference
    from dflashkit.infer.engine import ready_engine, resolve_engine, resolve_layers
    from dflashkit.infer.speculative import Sampling, Stopper, autoregressive_generate, speculative_generate
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.target.hf import TargetModel

    if args.config:
        from dflashkit.config import load_config

        cfg = load_config(args.config, [])
        args.target = args.target or cfg.target.path
        args.drafter = args.drafter or str(Path(cfg.run.out_dir) / "best")
        args.data = args.data or cfg.data.dir
        args.dtype = args.dtype or cfg.target.dtype
    if not args.drafter:
        sys.exit("name the drafter: --drafter DIR or -c CONFIG")
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    if any(b < 1 for b in budgets):
        sys.exit(f"node budgets are whole numbers >= 1, got {args.budgets!r}")
    configs = configurations(budgets)
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype = getattr(torch, args.dtype or "bfloat16")
    sets = [
        bench.load_set(s, limit=args.max_prompts, max_turns=args.max_turns, data_dir=args.data)
        for s in args.sets.split(",")
    ]
    target = TargetModel.load(args.target or "embedded", dtype=dtype, device=device)
    drafter = load_drafter(args.drafter, target, dtype=dtype, device=device).eval()
    tokenizer = AutoTokenizer.from_pretrained(target.path)
    eos = eos_token_ids(target.model, tokenizer)
    B = drafter.config.block_size
    # sized for the widest round (the largest tree)
    dec = bench.Decoder(
        target, drafter, tokenizer, eos, max_new_tokens=args.max_new_tokens, tree_budget=max(budgets)
    )
    capacity = max(dec.capacity(s) for s in sets)
    capacity = -(-capacity // bench.CAPACITY_STEP) * bench.CAPACITY_STEP
    # auto, resolved as bench resolves it (a long run: Triton layers on a GPU where they run the target)
    engine_name = resolve_engine(args.engine, target)
    layers, why = resolve_layers(args.layers, engine_name, target, long_run=True)
    print(why or f"{engine_name} engine")
    engines = {}  # one engine per configuration: a graphs engine readies the tree step of its budget
    for name, b in configs:
        t0 = time.perf_counter()
        engine, _ = ready_engine(
            engine_name, target, drafter, capacity=capacity, tree_budget=b or None, layers=layers
        )
        engines[name] = engine
        # a cold compile of each budget's steps can take minutes: say where the time goes
        print(f"{engine_name} engine for {name} ready in {time.perf_counter() - t0:.1f} s", flush=True)
    budget_of = dict(configs)
    # whether each configuration's round runs as one captured step (a graphs engine's tree round: a tree of at
    # least a block's nodes) or as separate calls, which cost a round more
    one_step = {
        name: e.fuses_rounds(budget_of[name] or None) if hasattr(e, "fuses_rounds") else None
        for name, e in engines.items()
    }
    stopper = Stopper(eos)
    greedy = Sampling()
    layer_ids = drafter.config.target_layer_ids
    warm = dec.prompt_ids(sets[0].conversations[0], 0, [])
    for name, engine in engines.items():  # first-call costs out of the figures
        speculative_generate(
            target, drafter, warm, 4, greedy, engine=engine, tree_budget=budget_of[name] or None
        )
    autoregressive_generate(target, warm, 4, greedy, layer_ids=layer_ids, engine=engines[CHAIN])

    result: dict[str, Any] = {
        "kind": "dflashkit-tree-vs-chain",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "python " + " ".join(sys.argv),
        "settings": {
            "target": target.name,
            "drafter": "/".join(Path(args.drafter).resolve().parts[-2:]),
            "block_size": B,
            "engine": f"{engine_name} ({layers} layers)" if engine_name == "graphs" else engine_name,
            "dtype": args.dtype or "bfloat16",
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "threads": torch.get_num_threads(),
            "max_new_tokens": args.max_new_tokens,
            "budgets": budgets,
            "one_step_rounds": one_step,
        },
        "sets": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for bset in sets:
        rows = []
        for conv in bset.conversations:
            replies: list[str] = []
            for turn in range(conv.n_turns):
                ids = dec.prompt_ids(conv, turn, replies)
                ar = autoregressive_generate(
                    target, ids, args.max_new_tokens, greedy, stopper, layer_ids, engine=engines[CHAIN]
                )
                row: dict[str, Any] = {
                    "ar_tokens": len(ar.tokens),
                    "ar_seconds": ar.seconds - ar.prefill_seconds,
                }
                for name, engine in engines.items():
                    g = speculative_generate(
                        target,
                        drafter,
                        ids,
                        args.max_new_tokens,
                        greedy,
                        stopper,
                        engine=engine,
                        tree_budget=budget_of[name] or None,
                    )
                    row[name] = {
                        "tokens": len(g.tokens),
                        "seconds": g.seconds - g.prefill_seconds,
                        "accept_lengths": g.accept_lengths,
                        "equal_to_ar": first_difference(g.tokens, ar.tokens) is None,
                    }
                rows.append(row)
                taus = " ".join(
                    f"{name} {sum(row[name]['accept_lengths']) / len(row[name]['accept_lengths']):.2f}"
                    for name in engines
                )
                print(f"{bset.name} {len(rows)}: tau {taus}", flush=True)
                if not conv.prefixes:
                    replies.append(dec.reply_text(ar.tokens))
        result["sets"][bset.name] = summarise(rows, configs) | {"source": bset.source}
        # each set as it finishes, so that a run cut short keeps the sets it measured
        (out / "tree_vs_chain.json").write_text(json.dumps(result, indent=2) + "\n")
    table = markdown(result)
    (out / "tree_vs_chain.md").write_text(table)
    write_report("tree_vs_chain.json", result)
    print(table)
    print(f"wrote {out / 'tree_vs_chain.json'} and {out / 'tree_vs_chain.md'}")
    if args.update_results:
        update_results(result, str(out / "tree_vs_chain.json"), args.update_results)


def update_results(report: dict[str, Any], source: str, config: str) -> None:
    """``tree_tau_gain`` (the issue's key: MT-Bench, trees of ``config``'s node budget against the chain, as a
    fraction) and a ``tree`` block (every set's tau gain and round cost at that budget) in the results file.
    Refused, the file left alone, when the report has no MT-Bench trees of that configuration."""
    name = f"tree-{config}"
    rows = {k: v["configs"][name] for k, v in report["sets"].items() if name in v["configs"]}
    if "mtbench" not in rows:
        sys.exit(f"--update-results: {source} has no MT-Bench configuration {name}")
    budget = rows["mtbench"]["tree_budget"]
    results = json.loads(RESULTS.read_text())
    results["tree_tau_gain"] = rows["mtbench"]["tau_gain_vs_chain"]
    results["tree"] = {
        "source": source,
        "budget": budget,
        # an older report's tree attention, when it measured several ("tree-32-masked")
        **({"tree_attention": a} if (a := rows["mtbench"].get("tree_attention")) else {}),
        "engine": report["settings"]["engine"],
        "device": report["settings"]["device"],
        "dtype": report["settings"]["dtype"],
        "sets": {
            k: {
                key: r[key]
                for key in ("tau", "tau_gain_vs_chain", "round_cost_ar_tokens", "round_cost_vs_chain")
            }
            for k, r in rows.items()
        },
        # every tree of the report beside it (MT-Bench): what the chosen budget was chosen from
        "mtbench_budgets": {
            c: {key: r[key] for key in ("tau_gain_vs_chain", "round_cost_vs_chain", "speedup")}
            for c, r in report["sets"]["mtbench"]["configs"].items()
            if c.startswith("tree-")
        },
    }
    RESULTS.write_text(json.dumps(results, indent=2) + "\n")
    print(f"{RESULTS}: tree_tau_gain {results['tree_tau_gain']:.3f} (MT-Bench, {name})")


if __name__ == "__main__":
    main()
