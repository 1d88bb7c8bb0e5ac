"""`dflashkit generate`, and `dflashkit eval`: the earlier name of `dflashkit bench` on one prompt set."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflashkit.commands import values
from dflashkit.config import PATHS_RULE, load_config
from dflashkit.errors import ConfigError

# what --engine and --layers take: dflashkit.infer.engine.ENGINE_CHOICES and LAYER_CHOICES (spelled here so
# --help needs no torch), and the names of earlier releases (engine.RENAMED, engine.RETIRED: each said in a line)
ENGINE_CHOICES = ("auto", "reference", "graphs")
EARLIER_ENGINES = ("dynamic", "graphs-kernels", "static", "graphs-compiled", "graphs-layers")
LAYER_CHOICES = ("auto", "torch", "triton")


def _load(args: argparse.Namespace) -> tuple[Any, Any, Any, Any, dict[str, Any] | None]:
    """Target, drafter, tokenizer, sampling settings and the dataset manifest (if any), from the flags
    (and the run config's defaults when --config is given)."""
    import torch

    from dflashkit.data.dataset import read_manifest
    from dflashkit.model.checkpoint import check_drafter_files, load_drafter
    from dflashkit.target.hf import TargetModel

    if args.config:
        cfg = load_config(args.config, list(getattr(args, "overrides", []) or []))
        args.target = args.target or cfg.target.path
        args.dtype = args.dtype or cfg.target.dtype
        args.drafter = args.drafter or str(Path(cfg.run.out_dir) / "best")
        args.data = args.data or cfg.data.dir
        if args.max_new_tokens is None:
            args.max_new_tokens = cfg.eval.max_new_tokens
        if args.temperature is None:
            args.temperature = cfg.eval.temperature
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    if not args.drafter:
        raise ConfigError(
            "name the drafter checkpoint with --drafter DIR (or give --config of a training run)"
        )
    check_drafter_files(args.drafter)  # a wrong path or a damaged file: said before the target loads
    device = torch.device(
        args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    )
    dtype_name = args.dtype or "auto"
    dtype = (
        (torch.bfloat16 if device.type == "cuda" else torch.float32)
        if dtype_name == "auto"
        else getattr(torch, dtype_name)
    )
    # lazy: the graphs engines read the weights file alone; anything else loads the model when it needs it
    target = TargetModel.load(args.target or "embedded", dtype=dtype, device=device, lazy=True)
    drafter = load_drafter(args.drafter, target, dtype=dtype, device=device, verify=False).eval()
    from dflashkit.target.tokenizer import serving_tokenizer

    tokenizer = serving_tokenizer(target.path)  # tokenizer.json and the chat template, without transformers
    manifest = read_manifest(args.data) if args.data else None
    return target, drafter, tokenizer, dtype, manifest


def _sampling(args: argparse.Namespace, console: Any):
    """The sampling settings of the flags; --draft-sampling auto resolved (`ceilings.resolve_draft_sampling`)
    and said in one line when it matters (T > 0)."""
    from dflashkit.infer.ceilings import resolve_draft_sampling
    from dflashkit.infer.speculative import Sampling

    t = args.temperature or 0.0
    proposal, why = resolve_draft_sampling(args.draft_sampling, Path(args.drafter), t, args.top_p)
    if args.draft_sampling == "auto" and t > 0:
        console.print(f"[dim]draft sampling {proposal} (--draft-sampling auto: {why})[/]")
    rule = getattr(args, "tree_rule", "match")
    return Sampling(t, args.top_p, args.rule, args.seed, proposal, rule)


def _enable_thinking(args: argparse.Namespace, tokenizer: Any, manifest: dict[str, Any] | None) -> bool:
    """The thinking-mode setting of the drafter's training data; a mismatch is refused."""
    from dflashkit.data.chat import check_template_identity, template_identity

    thinking = bool(args.enable_thinking)
    if manifest is not None:
        recorded = manifest.get("template", {})
        if "enable_thinking" in recorded and not args.enable_thinking:
            thinking = bool(recorded["enable_thinking"])
        check_template_identity(
            recorded, template_identity(tokenizer, thinking), f"dataset {args.data} vs this run"
        )
    return thinking


def _eos_ids(target: Any, tokenizer: Any) -> list[int]:
    from dflashkit.data.regenerate import eos_token_ids

    return eos_token_ids(target, tokenizer)  # its generation config, without loading a lazy target's model


def _eval(args: argparse.Namespace) -> int:
    """The earlier name of `dflashkit bench` on one prompt set: its options mapped to bench's, the bench
    command it amounts to said in one line, then bench runs it."""
    from rich.console import Console

    from dflashkit.commands import bench

    words, overrides = bench_words(args), list(args.overrides or [])
    Console().print(
        "[dim]dflashkit eval is now `dflashkit bench --sets heldout` (the held-out check); this one is "
        f"`dflashkit {' '.join(words + overrides)}`; the name eval goes in the next release[/]",
        soft_wrap=True,
    )
    parser = argparse.ArgumentParser(prog="dflashkit")
    bench.register(parser.add_subparsers(dest="command"))
    bench_args = parser.parse_args(words)
    bench_args.overrides = overrides
    bench_args.command = args.command  # an error still names the command the user typed
    return bench._bench(bench_args)


# eval's options with no bench equivalent: refused, each in one line
NO_BENCH_EQUIVALENT = {
    "no_baseline": "--no-baseline has no bench equivalent: bench always measures the autoregressive baseline",
    "rule": "--rule exact has no bench equivalent: bench accepts by rejection sampling above T=0",
}


def bench_words(args: argparse.Namespace) -> list[str]:
    """The `dflashkit bench` command line an eval command amounts to (eval's defaults kept: one temperature,
    the config's eval section or 128 new tokens and 80 prompts); an option with no equivalent is refused."""
    if args.no_baseline:
        raise ConfigError(NO_BENCH_EQUIVALENT["no_baseline"])
    if args.rule == "exact":
        raise ConfigError(NO_BENCH_EQUIVALENT["rule"])
    defaults = load_config(args.config, list(args.overrides or [])).eval if args.config else None
    temperature = (
        args.temperature if args.temperature is not None else (defaults.temperature if defaults else 0.0)
    )
    words = ["bench"]
    if args.config:
        words += ["--config", args.config]
    sets = {"validation": "heldout", "mtbench": "mtbench"}
    words += ["--sets", sets[args.prompts]] if args.prompts in sets else ["--prompts", args.prompts]
    given = {
        "--drafter": args.drafter,
        "--target": args.target,
        "--data": args.data,
        "--dtype": args.dtype,
        "--device": args.device,
        "--max-prompts": args.max_prompts or (defaults.max_prompts if defaults else 80),
        "--max-new-tokens": args.max_new_tokens or (defaults.max_new_tokens if defaults else 128),
        "--temperatures": f"{temperature:g}",
        "--top-p": f"{args.top_p:g}",
        "--seed": args.seed,
        "--engine": args.engine,
        "--layers": args.layers,
        "--tree-budget": args.tree_budget,
        "--draft-sampling": args.draft_sampling,
        "--tree-rule": args.tree_rule if args.tree_rule != "match" else None,
        "--out": args.out,
    }
    words += [w for flag, value in given.items() if value is not None for w in (flag, str(value))]
    flags = {"--check-lossless": args.check_lossless, "--enable-thinking": args.enable_thinking}
    flags["--skip-malformed"] = args.skip_malformed
    return words + [flag for flag, on in flags.items() if on]


def choose_engine(args: argparse.Namespace, target: Any, console: Any, *, long_run: bool) -> None:
    """--engine and --layers resolved in place (``engine.parse_engine``, ``resolve_engine``,
    ``resolve_layers``; ``long_run``: a command that decodes many prompts), saying an earlier release's name
    and, for the graphs engine, which layers and why, a line each."""
    from dflashkit.infer.engine import parse_engine, resolve_engine, resolve_layers

    name, layers, note = parse_engine(args.engine, args.layers)
    if note:
        console.print(f"[yellow]{note}[/]")
    args.engine = resolve_engine(name, target)
    args.layers, why = resolve_layers(layers, args.engine, target, long_run=long_run)
    if why:
        console.print(why)


def engine_label(args: argparse.Namespace) -> str:
    """The resolved engine as reports name it: "reference", or "graphs (torch layers)"."""
    return f"{args.engine} ({args.layers} layers)" if args.engine == "graphs" else args.engine


def _engine(args: argparse.Namespace, target: Any, drafter: Any, capacity: int, console: Any) -> Any:
    """The decode engine of --engine: "reference", or a graphs engine of this capacity (warmed up: its steps
    captured on a GPU, its Triton kernels compiled; the seconds reported, and kept out of the measured
    decoding)."""
    from dflashkit.infer.engine import ready_engine

    engine, warm = ready_engine(
        args.engine, target, drafter, capacity=capacity, tree_budget=args.tree_budget, layers=args.layers
    )
    if warm:
        steps = ", ".join(f"{name} {s:.1f} s" for name, s in warm.items())
        console.print(f"{engine_label(args)} engine: {capacity} positions; warmed up ({steps})")
        for note in warm.notes:
            console.print(f"[yellow]{note}[/]")
    return engine


def choose_rounds(args: argparse.Namespace, drafter: Any, temperature: float) -> str:
    """Resolve --tree-budget (auto: ``resolve_tree_budget`` for --engine, already resolved, at
    ``temperature``; above 0 by the drafter's bench record, `ceilings.sampled_trees_pay`) into
    ``args.tree_budget``; what a round verifies, said to the user: "trees of N drafted nodes" or "chains", and
    whether auto chose it (and why, when sampling)."""
    from dflashkit.infer.ceilings import recorded, sampled_trees_pay
    from dflashkit.infer.engine import resolve_tree_budget

    chosen = args.tree_budget is None
    why = ""
    sampled_trees = False
    if chosen and temperature > 0:
        sampled_trees, why = sampled_trees_pay(recorded(Path(args.drafter), temperature, args.top_p))
    args.tree_budget = resolve_tree_budget(
        args.tree_budget, args.engine, args.layers, drafter.config.block_size, temperature, sampled_trees
    )
    what = f"trees of {args.tree_budget} drafted nodes" if args.tree_budget else "chains"
    return what + (f" (--tree-budget auto{': ' + why if why else ''})" if chosen else "")


def _width(args: argparse.Namespace, drafter: Any) -> int:
    """Positions one speculative round writes: the block, or a tree of --tree-budget nodes and its root."""
    from dflashkit.infer.engine import round_width

    return round_width(drafter.config.block_size, args.tree_budget)


# A graphs engine for `generate` holds this many prompt tokens (more when a one-shot prompt is longer).
GENERATE_PROMPT_ROOM = 1024


def _generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from dflashkit.data.chat import generation_prompt_ids
    from dflashkit.infer.speculative import Stopper, speculative_generate
    from dflashkit.target.context import beyond_context, context_of

    console = Console()
    target, drafter, tokenizer, _dtype, manifest = _load(args)
    choose_engine(args, target, console, long_run=False)
    check_tree_rule(args, [args.temperature or 0.0], args.engine)  # auto resolved, the config's T read
    thinking = _enable_thinking(args, tokenizer, manifest)
    stopper = Stopper(_eos_ids(target, tokenizer), args.stop or [], tokenizer)
    sampling = _sampling(args, console)
    rounds = choose_rounds(args, drafter, sampling.temperature)

    engines: list[Any] = []  # the graphs engine, built for the first prompt and rebuilt if one is longer

    def engine_for(prompt_len: int) -> Any:
        room = args.max_new_tokens + _width(args, drafter)
        if args.engine == "reference":
            return "reference"
        if not engines or engines[0].capacity < prompt_len + room:
            engines[:] = [
                _engine(args, target, drafter, max(prompt_len, GENERATE_PROMPT_ROOM) + room, console)
            ]
        return engines[0]

    def one(text: str) -> None:
        ids = generation_prompt_ids(tokenizer, [{"role": "user", "content": text}], enable_thinking=thinking)
        warning = beyond_context(len(ids), args.max_new_tokens, context_of(target.config))
        if warning:
            console.print(f"[yellow]{warning}[/]", soft_wrap=True)
        engine = engine_for(len(ids))
        g = speculative_generate(
            target,
            drafter,
            ids,
            args.max_new_tokens,
            sampling,
            stopper,
            engine=engine,
            tree_budget=args.tree_budget,
        )
        console.print(rounds_markup(g, tokenizer, stopper.eos), soft_wrap=True)  # the model's own lines
        console.print(
            f"[dim]{len(g.tokens)} tokens, mean acceptance length {g.mean_acceptance_length:.2f}, "
            f"{g.tokens_per_second:.1f} tokens/s, stopped by {g.stopped}, {engine_label(args)} engine, {rounds}[/]"
        )

    console.print(ROUNDS_LEGEND)
    if args.prompt:
        one(args.prompt)
        return 0
    console.print("interactive: type a prompt, empty line to quit")
    while True:
        try:
            text = input("> ").strip()
        except EOFError:
            break
        if not text:
            break
        one(text)
    return 0


# How `generate` shows the rounds of speculative decoding (printed before the first reply).
ROUNDS_LEGEND = (
    "[dim]each round of speculative decoding is one span, on alternating backgrounds: "
    "[green]green[/green] = the target accepted drafted tokens (tau > 1), plain = the target's own token only "
    "(tau = 1)[/]"
)


def rounds_markup(g: Any, tokenizer: Any, eos_ids: set[int]) -> str:
    """A generation as rich markup, one span per round; end-of-sequence and other special tokens hidden."""
    from rich.markup import escape

    def text(tokens: list[int]) -> str:
        return escape(tokenizer.decode([t for t in tokens if t not in eos_ids], skip_special_tokens=True))

    pos, parts = 0, []
    for i, tau in enumerate(g.accept_lengths):
        chunk = text(g.tokens[pos : pos + tau])
        pos += tau
        style = ("green" if tau > 1 else "default") + (" on grey11" if i % 2 else "")
        parts.append(f"[{style}]{chunk}[/]" if chunk else "")
    return "".join(parts) + text(g.tokens[pos:])


def add_model_options(p: argparse.ArgumentParser, data_help: str = "") -> None:
    """The options every decoding command shares: the run config, drafter, target, dataset, dtype, device and
    the chat template's thinking mode."""
    p.add_argument(
        "--config", "-c", help="training run config: defaults for target, drafter (its best/), data"
    )
    p.add_argument("--drafter", help="drafter checkpoint folder (z-lab or speculators layout)")
    p.add_argument("--target", help="'embedded' or an HF model folder (default: embedded)")
    p.add_argument(
        "--data",
        help=f"the drafter's dataset folder{data_help}: its template settings are checked and reused "
        "(default: data.dir of --config)",
    )
    p.add_argument(
        "--dtype", choices=["auto", "float32", "bfloat16"], help="target/drafter dtype (auto: bf16 on GPU)"
    )
    p.add_argument(
        "--device",
        default="auto",
        help="auto (default: CUDA when present, else the CPU), cpu, cuda, cuda:1, ...",
    )
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="render prompts with the chat template's thinking mode on (default: as the drafter's dataset was)",
    )


def _common(p: argparse.ArgumentParser) -> None:
    add_model_options(p)
    p.add_argument(
        "--max-new-tokens",
        type=values.count,
        default=None,
        metavar="N",
        help="new tokens per prompt (default: eval.max_new_tokens of --config, else 128)",
    )
    p.add_argument(
        "--temperature",
        type=values.temperature,
        default=None,
        metavar="T",
        help="0 for greedy decoding (default: eval.temperature of --config, else 0), above 0 to sample",
    )
    p.add_argument(
        "--top-p",
        type=values.top_p,
        default=1.0,
        metavar="P",
        help="nucleus sampling threshold when sampling (default 1.0)",
    )
    p.add_argument(
        "--rule",
        choices=["exact", "rejection"],
        default="rejection",
        help="acceptance rule when sampling: rejection (speculative sampling: accepts the most; on the graphs "
        "engines a round is one step; the default) or exact (a draft token is kept when it equals the target's "
        "sample); the target's distribution either way",
    )
    p.add_argument("--seed", type=values.whole_number, default=0, help="seed of the sampling (default 0)")
    add_engine(p, "bench, which decodes many prompts")
    add_tree_budget(p)
    add_draft_sampling(p)
    add_tree_rule(p)


def add_engine(p: argparse.ArgumentParser, long_run: str) -> None:
    """--engine and --layers (``long_run``: which of the command's uses decode many prompts)."""
    p.add_argument(
        "--engine",
        choices=[*ENGINE_CHOICES, *EARLIER_ENGINES],
        metavar="{" + ",".join(ENGINE_CHOICES) + "}",
        default="auto",
        help="decode engine of both loops: auto (the fastest lossless one: graphs for llama/mistral/qwen2/qwen3 "
        "targets, else reference), reference (growing caches, eager PyTorch; any target; readable) or graphs "
        "(preallocated caches, the fused target forward, one CUDA graph per step shape on a GPU)",
    )
    p.add_argument(
        "--layers",
        choices=list(LAYER_CHOICES),
        default="auto",
        help="the graphs engine's layers: torch, or triton (our kernels, six a layer; GPU only; their first "
        "compile ~11 s, kept in a cache file after). auto: the layers measured faster on this device and "
        "target when benchmarks/decode_steps.py recorded them, else triton on a GPU for " + long_run + " "
        "where the kernels run the target, else torch; the choice is said in one line",
    )


def add_draft_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-sampling",
        choices=["marginal", "argmax", "auto"],
        default="auto",
        help="a chain round's drafts when sampling (both keep the target's distribution): marginal (each slot "
        "drawn from the drafter's distribution), argmax (each slot's most likely token, accepted with the "
        "target's probability of it) or auto (the default: the one the drafter's latest bench record at this "
        "temperature expects more tokens from; marginal without a record)",
    )


def add_tree_rule(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--tree-rule",
        choices=["match", "recursive"],
        default="match",
        help="a tree round's rule when sampling (both keep the target's distribution): match (the default: the "
        "drafter's top tokens as children, the target's draw followed) or recursive (each node's children "
        "drawn without replacement from the drafter's distribution, accepted by recursive rejection; the "
        "reference engine only, with --tree-budget N above 0 and a temperature above 0)",
    )


# Why --tree-rule recursive is refused, one line each.
RECURSIVE_REFUSALS = {
    "engine": "recursive trees run on the reference engine only: give --engine reference",
    "greedy": "recursive trees sample: at temperature 0 they are the match rule's trees; give a temperature "
    "above 0 or --tree-rule match",
    "budget": "recursive trees need trees: give --tree-budget N above 0",
}


def check_tree_rule(args: argparse.Namespace, temperatures: list[float], engine: str | None = None) -> None:
    """Refuse --tree-rule recursive where it does not run: a temperature of 0, no tree budget given, or
    (``engine``: --engine resolved, `choose_engine`) an engine other than the reference."""
    if getattr(args, "tree_rule", "match") != "recursive":
        return
    if engine is not None and engine != "reference":
        raise ConfigError(RECURSIVE_REFUSALS["engine"])
    if any(t <= 0 for t in temperatures):
        raise ConfigError(RECURSIVE_REFUSALS["greedy"])
    if not args.tree_budget:
        raise ConfigError(RECURSIVE_REFUSALS["budget"])


def add_tree_budget(
    p: argparse.ArgumentParser,
    sampled: str = "where the drafter's bench record at this temperature expects a tree's extra tokens to pay "
    "for its round",
) -> None:
    """--tree-budget; ``sampled``: where auto serves trees when sampling."""
    p.add_argument(
        "--tree-budget",
        type=values.tree_budget,
        default=None,
        metavar="N|auto",
        help="verify a tree of N drafted nodes per round (the best branches of the drafter's per-slot top-k, "
        "one target pass, the longest branch the target agrees with; lossless) instead of the chain (0); "
        "auto (the default): trees of 15 where they were measured faster (greedy decoding on the "
        f"graphs engine with triton layers, a block of at most 16; when sampling, {sampled}), else the chain",
    )


def register(subparsers: argparse._SubParsersAction) -> None:
    e = subparsers.add_parser(
        "eval",
        help="the earlier name of `bench` on one prompt set (kept for one release)",
        description="Now `dflashkit bench --sets heldout` (the held-out check and the train/serve agreement); "
        "--prompts mtbench is bench's --sets mtbench, a file its --prompts FILE. Its options map to bench's; "
        "the bench command it amounts to is said in one line, then bench runs it. " + PATHS_RULE,
        epilog="example:\n"
        "  dflashkit eval -c configs/embedded.yaml --prompts validation --check-lossless\n"
        "  is dflashkit bench --config configs/embedded.yaml --sets heldout --max-prompts 16 "
        "--max-new-tokens 64 --temperatures 0 ... --check-lossless\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(e)
    e.add_argument(
        "--prompts",
        default="mtbench",
        help="mtbench (default), validation (the dataset's held-out split) or a file",
    )
    e.add_argument(
        "--max-prompts",
        type=values.count,
        default=None,
        metavar="N",
        help="prompts to decode (default: eval.max_prompts of --config, else 80)",
    )
    e.add_argument(
        "--skip-malformed",
        action="store_true",
        help="with --prompts FILE: skip and count malformed records instead of stopping at the first",
    )
    e.add_argument(
        "--check-lossless", action="store_true", help="fail unless greedy speculative == greedy target"
    )
    e.add_argument("--no-baseline", action="store_true", help="skip the autoregressive baseline")
    e.add_argument(
        "--out",
        help="bench's output folder (default: bench/ beside the drafter folder)",
    )
    e.set_defaults(handler=_eval, overrides=[])  # section.key=value words anywhere: overrides of --config

    g = subparsers.add_parser(
        "generate",
        help="generate with a drafter, showing acceptance live",
        description="Generate replies speculatively, one prompt or interactively; each round of speculative "
        "decoding is shown as one span (green: drafted tokens accepted). " + PATHS_RULE,
        epilog="examples:\n"
        '  dflashkit generate -c configs/embedded.yaml "Tell me about the sea"\n'
        "  dflashkit generate --drafter runs/embedded/best --max-new-tokens 200     (interactive)\n",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _common(g)
    g.add_argument("prompt", nargs="?", help="a prompt (interactive when absent)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.set_defaults(handler=_generate)
