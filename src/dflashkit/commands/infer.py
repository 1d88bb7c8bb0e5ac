"""`dflashkit eval` and `dflashkit generate`."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from dflashkit.atomic import check_folder_can_be_made
from dflashkit.commands import values
from dflashkit.config import PATHS_RULE, load_config
from dflashkit.errors import ConfigError, DataError
from dflashkit.lock import hold_folder

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
        if getattr(args, "max_prompts", None) is None:
            args.max_prompts = cfg.eval.max_prompts
        if args.max_new_tokens is None:
            args.max_new_tokens = cfg.eval.max_new_tokens
        if args.temperature is None:
            args.temperature = cfg.eval.temperature
    if args.max_new_tokens is None:
        args.max_new_tokens = 128
    if getattr(args, "max_prompts", 0) is None:
        args.max_prompts = 80
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
    return Sampling(temperature=t, top_p=args.top_p, rule=args.rule, seed=args.seed, draft_sampling=proposal)


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


def eval_prompts(args: argparse.Namespace, tokenizer: Any, thinking: bool) -> tuple[list[list[int]], str]:
    """Token ids of the evaluation prompts, rendered with the chat template."""
    from dflashkit.data.chat import generation_prompt_ids
    from dflashkit.data.sources import load_prompts, read_mtbench, select_prompts

    if args.prompts == "validation":
        from dflashkit.data.dataset import load_dataset, prompt_ids

        if not args.data:
            raise ConfigError("--prompts validation needs the dataset folder (--data DIR or --config)")
        ids = prompt_ids(load_dataset(args.data, "validation")[: args.max_prompts])
        return ids, f"{args.data} (validation split)"
    if args.prompts == "mtbench":
        prompts = read_mtbench()
    else:
        found = load_prompts(args.prompts, skip_malformed=args.skip_malformed)
        prompts = found.prompts
        if found.malformed:
            print(f"skipped {found.malformed} malformed records of {args.prompts} (--skip-malformed)")
    prompts = (
        select_prompts(prompts, args.max_prompts, seed=0)
        if args.prompts != "mtbench"
        else prompts[: args.max_prompts]
    )
    out = [
        generation_prompt_ids(
            tokenizer, p.messages()[: (1 if p.system is None else 2)], enable_thinking=thinking
        )
        for p in prompts
    ]
    return out, args.prompts


def _eos_ids(target: Any, tokenizer: Any) -> list[int]:
    from dflashkit.data.regenerate import eos_token_ids

    return eos_token_ids(target, tokenizer)  # its generation config, without loading a lazy target's model


def _eval(args: argparse.Namespace) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from dflashkit.infer.evaluate import training_reference, write_report
    from dflashkit.target.context import beyond_context, context_of

    console = Console()
    target, drafter, tokenizer, dtype, manifest = _load(args)
    out_dir = Path(args.out or Path(args.drafter).parent / "eval")
    check_folder_can_be_made(out_dir)  # before decoding anything
    hold_folder(out_dir)  # one writer per eval folder (`dflashkit.lock`)
    choose_engine(args, target, console, long_run=True)
    thinking = _enable_thinking(args, tokenizer, manifest)
    prompt_ids, source = eval_prompts(args, tokenizer, thinking)
    if not prompt_ids:  # nothing to measure: said before any file is written
        raise DataError(f"no prompts to evaluate in {source}; give a file or a split that holds some")
    sampling = _sampling(args, console)
    rounds = choose_rounds(args, drafter, sampling.temperature)
    longest = max((len(p) for p in prompt_ids), default=0)
    capacity = longest + args.max_new_tokens + _width(args, drafter)
    warning = beyond_context(longest, args.max_new_tokens, context_of(target.config), "the longest prompt")
    if warning:
        console.print(f"[yellow]{warning}[/]", soft_wrap=True)
    eos_ids = _eos_ids(target, tokenizer)
    check32 = None
    if args.check_lossless and dtype != torch.float32:
        # Greedy outputs are compared in float32, on float32 copies (in bf16 the two loops may part after a
        # near tie, as any two bf16 kernels may); the figures are then measured in the run's dtype.
        from dflashkit.model.checkpoint import load_drafter
        from dflashkit.target.hf import TargetModel

        console.print("lossless check: decoding on float32 copies of the target and the drafter first")
        t32 = TargetModel.load(
            args.target or "embedded", dtype=torch.float32, device=target.device, lazy=True
        )
        d32 = load_drafter(args.drafter, t32, dtype=torch.float32, device=target.device, verify=False).eval()
        engine32 = _engine(args, t32, d32, capacity, console)
        check32 = _decode(
            args, t32, d32, prompt_ids, sampling, eos_ids, engine32, check=True, console=console
        )
        del t32, d32, engine32
    engine = _engine(args, target, drafter, capacity, console)
    report = _decode(
        args,
        target,
        drafter,
        prompt_ids,
        sampling,
        eos_ids,
        engine,
        check=args.check_lossless and check32 is None,
        console=console,
    )
    report.engine = engine_label(args)
    report.dtype = str(dtype).removeprefix("torch.")
    if check32 is not None:
        report.lossless = True
        report.lossless_check = {
            "dtype": "float32",
            "prompts": check32.prompts,
            "mean_acceptance_length": check32.mean_acceptance_length,
            "speedup": check32.speedup,
        }
    # the training metric is a chain's served-order tau: beside tree rounds it would read as a gap
    reference = None if args.tree_budget else training_reference(Path(args.drafter), args.prompts, args.data)
    js, png, kept = write_report(report, out_dir, reference, label=prompts_label(args.prompts))

    t = Table(
        title=f"dflashkit eval: {len(prompt_ids)} prompts from {source}, T={sampling.temperature}, rule {sampling.rule}"
    )
    t.add_column("metric", style="cyan")
    t.add_column("value", justify="right")
    t.add_row("mean acceptance length (tau)", f"{report.mean_acceptance_length:.3f}")
    if reference is not None:
        t.add_row(*reference.table_row(report.mean_acceptance_length))
    t.add_row("per-position acceptance", " ".join(f"{p:.2f}" for p in report.per_position_acceptance))
    t.add_row("tau histogram (1..B)", " ".join(str(c) for c in report.accept_length_histogram[1:]))
    t.add_row("decode engine", report.engine)
    t.add_row("rounds", rounds)
    t.add_row("speculative tokens/s", f"{report.spec_tokens_per_second:.1f} ({report.dtype})")
    if report.ar_tokens_per_second:
        t.add_row("autoregressive tokens/s", f"{report.ar_tokens_per_second:.1f} ({report.dtype})")
        t.add_row(f"speedup ({report.dtype})", f"{report.speedup:.2f}x")
        t.add_row("round cost (autoregressive tokens)", f"{report.round_cost:.2f}")
    if args.check_lossless:
        t.add_row(
            "lossless (greedy spec == greedy target, float32)",
            f"[green]yes, every prompt and token[/]{_check_note(report)}",
        )
    console.print(t)
    from dflashkit.infer.evaluate import slower_than_autoregressive

    slower = slower_than_autoregressive(
        f"T={sampling.temperature}", report.mean_acceptance_length, report.speedup
    )
    if slower:
        console.print(f"[yellow]{slower}[/]")
    console.print(f"wrote {js} and {png} (this evaluation is also kept as {kept.name}; earlier ones stay)")
    return 0


def _decode(
    args: argparse.Namespace,
    target: Any,
    drafter: Any,
    prompt_ids: list[list[int]],
    sampling: Any,
    eos_ids: list[int],
    engine: Any,
    *,
    check: bool,
    console: Any,
) -> Any:
    """``evaluate`` over the prompts with a progress bar: the EvalReport."""
    from rich.progress import Progress

    from dflashkit.infer.evaluate import evaluate

    label = f"decoding {len(prompt_ids)} prompts ({str(target.dtype).removeprefix('torch.')})"
    with Progress(console=console, transient=True) as bar:
        task = bar.add_task(label, total=len(prompt_ids))
        return evaluate(
            target,
            drafter,
            prompt_ids,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling,
            eos_ids=eos_ids,
            baseline=not args.no_baseline,
            check_lossless=check,
            backend="sdpa",
            progress=lambda i, g: bar.update(
                task, advance=1, description=f"prompt {i + 1}: tau {g.mean_acceptance_length:.2f}"
            ),
            names=(str(args.drafter), target.name),
            engine=engine,
            tree_budget=args.tree_budget,
        )


def _check_note(report: Any) -> str:
    """Where the lossless check ran, when not in the measured run itself."""
    check = report.lossless_check
    if not check:
        return ""
    speed = f", speedup {check['speedup']:.2f}x there" if check["speedup"] else ""
    return f" (on float32 copies: tau {check['mean_acceptance_length']:.3f}{speed})"


def prompts_label(prompts: str) -> str:
    """A short name of the evaluated prompts for file names: mtbench, validation or the file's stem."""
    return prompts if prompts in ("mtbench", "validation") else Path(prompts).stem


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


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--config", "-c", help="training run config: defaults for target, drafter (its best/), data"
    )
    p.add_argument("--drafter", help="drafter checkpoint folder (z-lab or speculators layout)")
    p.add_argument("--target", help="'embedded' or an HF model folder (default: embedded)")
    p.add_argument(
        "--data", help="the drafter's dataset folder: its template settings are checked and reused"
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
    p.add_argument(
        "--enable-thinking",
        action="store_true",
        help="render prompts with the chat template's thinking mode on (default: as the drafter's dataset was)",
    )
    add_engine(p, "eval, which decodes many prompts")
    add_tree_budget(p)
    add_draft_sampling(p)


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
        help="acceptance length and speedup by decoding; --check-lossless",
        description="Decode prompts speculatively and autoregressively on the same engine: acceptance length "
        "(mean, histogram, per position), tokens/s and speedup; with --check-lossless, greedy speculative "
        "output must equal the target's token for token. Each evaluation is kept in the output folder "
        "(eval-<time>-<prompts>.json/.png); eval.json and eval.png are the newest. The training metric is "
        "shown beside the result when it was measured on the same prompts (the held-out split of the same "
        "dataset). " + PATHS_RULE,
        epilog="examples:\n"
        "  dflashkit eval -c configs/embedded.yaml --prompts validation --check-lossless\n"
        "  dflashkit eval --drafter runs/embedded/best --data runs/embedded/data --prompts mtbench\n"
        "  dflashkit eval --drafter DIR --target /models/Qwen3-8B --prompts prompts.jsonl --skip-malformed\n",
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
        help="folder for the evaluations: eval.json/eval.png (the newest) and every earlier one "
        "(default: eval/ beside the drafter folder)",
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
