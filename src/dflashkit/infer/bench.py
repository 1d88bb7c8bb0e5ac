"""`dflashkit bench`: the DFlash paper's evaluation for any target and drafter, set by set.

For each prompt set (MT-Bench, GSM8K, HumanEval, the held-out split of a dataset, or a file) and each
temperature, every prompt is decoded speculatively and autoregressively on the same decode engine
(`dflashkit.infer.engine`, the loops of `dflashkit.infer.speculative`): the served acceptance length tau
(tokens per target pass over all rounds, and its spread over prompts), tokens/s of both loops and their
ratio. At T = 0 the rule is greedy; above 0 it is speculative rejection sampling (`Sampling(rule=
"rejection")`), which keeps the target's distribution exactly, its drafts by ``--draft-sampling`` (under
"auto", at each T > 0 the proposal the set's ceilings expect more tokens from: `dflashkit.infer.ceilings`,
measured on the set's first prompts and recorded beside the figures, where generate and eval read them). The fp32 lossless check decodes greedily in
float32 (the run itself when it is float32, otherwise float32 copies of the target and drafter) and
compares speculative and autoregressive output token for token, on the run's own engine and layers (Triton
layers check their own kernels).

Multi-turn sets (MT-Bench) decode every turn, the next turn after the speculative reply to the last, as
the paper's evaluation does; each turn's reply is one "response". Held-out records are decoded from each
user turn of the stored conversation (the target's own greedy replies before it), as training measured them.

Each finished set is written at once to ``<out>/sets/<set>.json`` (its per-response figures included), so
a long benchmark can run set by set, in several commands, into one folder: ``bench.json``, the table, the
figure and the summary combine every set there that was measured with the same settings.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.atomic import atomic_file, write_json
from dflashkit.data.chat import generation_prompt_ids
from dflashkit.data.dataset import load_dataset
from dflashkit.data.sources import load_prompts, read_benchmark, select_prompts
from dflashkit.errors import ConfigError, DflashkitError
from dflashkit.integrity import CHECKSUMS_FILE
from dflashkit.model.acceptance import served_tau

SETS: tuple[str, ...] = ("mtbench", "gsm8k", "humaneval", "heldout")
SET_TITLES = {"mtbench": "MT-Bench", "gsm8k": "GSM8K", "humaneval": "HumanEval", "heldout": "held-out"}
BENCH_JSON, BENCH_PNG, BENCH_MD = "bench.json", "bench.png", "bench.md"
SETS_DIR, EARLIER_DIR = "sets", "earlier"
SUMMARY_TEMPERATURE = "0"
# Room for a reply that is decoded to text and tokenized again inside the next turn's prompt.
REPLY_SLACK = 16
# Graphs engine capacities are rounded up to a multiple of this.
CAPACITY_STEP = 128


class BenchLosslessError(DflashkitError):
    """The fp32 greedy speculative output differed from the autoregressive output on some set."""


# --------------------------------------------------------------------------------------------------
# Prompt sets


@dataclass(frozen=True)
class Conversation:
    """One benchmark item: user turns rendered with the chat template (each after the reply to the last),
    or fixed token prompts (``prefixes``: a held-out record's ids before each of its replies)."""

    key: str
    turns: tuple[str, ...] = ()
    system: str | None = None
    prefixes: tuple[tuple[int, ...], ...] = ()

    @property
    def n_turns(self) -> int:
        return len(self.prefixes) if self.prefixes else len(self.turns)

    def messages(self, turn: int, replies: Sequence[str]) -> list[dict[str, str]]:
        """The chat messages before the reply to user turn ``turn`` (0-based), with the earlier replies."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for i in range(turn + 1):
            out.append({"role": "user", "content": self.turns[i]})
            if i < turn:
                out.append({"role": "assistant", "content": replies[i]})
        return out


@dataclass
class BenchSet:
    name: str
    source: str  # where the prompts came from, for the report
    conversations: list[Conversation]
    malformed: int = 0  # records of a prompts file skipped (--skip-malformed)

    @property
    def responses(self) -> int:
        return sum(c.n_turns for c in self.conversations)


def set_name(spec: str) -> str:
    """The name a set is reported under: the set itself, or a prompts file's stem."""
    return spec if spec in SETS else Path(spec).stem


def _conversations(prompts: Sequence[Any], max_turns: int | None) -> list[Conversation]:
    return [
        Conversation(key=p.id, turns=tuple(p.turns[:max_turns] if max_turns else p.turns), system=p.system)
        for p in prompts
    ]


def _limited(prompts: list[Any], limit: int | None, seed: int) -> list[Any]:
    """All prompts in source order, or ``limit`` of them chosen by a seeded shuffle."""
    return prompts if limit is None or limit >= len(prompts) else select_prompts(prompts, limit, seed)


def load_set(
    spec: str,
    *,
    limit: int | None = None,
    max_turns: int | None = None,
    data_dir: str | None = None,
    seed: int = 0,
    skip_malformed: bool = False,
) -> BenchSet:
    """A prompt set by name ("mtbench", "gsm8k", "humaneval", "heldout") or a prompts file. A missing package
    raises DataError with the command that installs it; "heldout" needs ``data_dir``."""
    if spec == "heldout":
        if not data_dir:
            raise ConfigError("the heldout set is a dataset's held-out split: give --data DIR (or --config)")
        return heldout_set(data_dir, limit, max_turns)
    if spec in SETS:
        prompts, malformed = read_benchmark(spec), 0
        source = {"mtbench": "MT-Bench", "gsm8k": "GSM8K test", "humaneval": "HumanEval"}[spec]
    else:
        found = load_prompts(spec, skip_malformed=skip_malformed)
        prompts, source, malformed = found.prompts, spec, found.malformed
    chosen = _limited(prompts, limit, seed)
    source = f"{source} ({len(chosen)} of {len(prompts)})"
    return BenchSet(set_name(spec), source, _conversations(chosen, max_turns), malformed)


def reply_starts(loss_mask: Any) -> list[int]:
    """Where each supervised run (an assistant reply) of a record starts: the positions whose loss mask is
    on while the previous one is off."""
    mask = [bool(m) for m in loss_mask.tolist()]
    return [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]


def heldout_set(data_dir: str, limit: int | None, max_turns: int | None) -> BenchSet:
    """The held-out split of a dataset folder: each record is decoded from the start of each of its replies
    (its prompt and the target's own earlier replies, as stored). ``limit`` records, evenly spread over the
    split (a mixture's sources are held out one after another)."""
    records = load_dataset(data_dir, "validation")
    n = len(records)
    picked = records if limit is None or limit >= n else [records[i * n // limit] for i in range(limit)]
    conversations = []
    for rec in picked:
        starts = reply_starts(rec.loss_mask)[:max_turns] if max_turns else reply_starts(rec.loss_mask)
        ids = rec.input_ids.tolist()
        if starts:
            conversations.append(Conversation(key=rec.id, prefixes=tuple(tuple(ids[:s]) for s in starts)))
    return BenchSet("heldout", f"{data_dir} (validation split, {len(conversations)} of {n})", conversations)


# --------------------------------------------------------------------------------------------------
# Decoding


@dataclass
class Response:
    """One decoded reply: which conversation and turn, its prompt length, and what each loop made."""

    conversation: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    accept_lengths: list[int]
    spec_seconds: float  # decode time, prefill excluded (as tokens/s counts it)
    ar_new_tokens: int | None = None
    ar_seconds: float | None = None
    first_difference: int | None = None  # greedy check: the first new token where spec != AR

    @property
    def tau(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else math.nan


@dataclass
class Decoder:
    """What decoding needs besides the prompts: the models, the tokenizer for rendering and replies, the
    engine kind and the limits."""

    target: Any
    drafter: Any
    tokenizer: Any
    eos_ids: list[int]
    engine: str = "reference"
    layers: str = "torch"  # the graphs engine's layers
    max_new_tokens: int = 256
    enable_thinking: bool = False
    top_p: float = 1.0
    seed: int = 0
    graphs: bool | None = None  # the graphs engine: capture its steps (None: on a GPU)
    tree_budget: int | None = None  # drafted nodes per tree round (None: chain rounds)
    sampled_trees: bool = True  # trees at T > 0 too (False: trees at T = 0, chains above: --tree-budget auto)
    # at T > 0, trees of tree_budget where the set's ceilings (measured on its first ``ceiling_prompts``) expect
    # them to beat the chain (`ceilings.trees_pay`), else the chain: --tree-budget auto with --ceilings N
    trees_by_ceilings: bool = False
    draft_sampling: str = "marginal"  # a chain round's proposal at T > 0, or "auto": the ceilings' choice
    tree_rule: str = "match"  # a tree round's rule at T > 0: "recursive" on the reference engine only
    ceiling_prompts: int = 0  # prompts of each set whose ceilings are measured at T > 0 (`infer.ceilings`)
    console: Any = None
    _engine: Any = field(default=None, repr=False)

    def rounds(self, temperature: float) -> int | None:
        """The tree budget of a round at ``temperature`` (None: the chain); above T=0 under
        ``trees_by_ceilings``, `run_set` chooses per set."""
        return self.tree_budget if temperature == 0 or self.sampled_trees else None

    def sampled_rounds(self) -> tuple[int | None, ...]:
        """The rounds a set may be served with at T > 0: its tree budget, or the chain (None), or both when
        the set's ceilings choose."""
        if self.trees_by_ceilings and self.tree_budget:
            return (None, self.tree_budget)
        return (self.rounds(1.0),)

    def prompt_ids(self, conv: Conversation, turn: int, replies: Sequence[str]) -> list[int]:
        if conv.prefixes:
            return list(conv.prefixes[turn])
        return generation_prompt_ids(
            self.tokenizer, conv.messages(turn, replies), enable_thinking=self.enable_thinking
        )

    def capacity(self, bset: BenchSet) -> int:
        """Positions a graphs engine needs for every response of the set: the longest prompt + new tokens +
        block, where a later turn's prompt is bounded by the rendered turns plus the earlier replies."""
        from dflashkit.infer.engine import round_width

        B = self.drafter.config.block_size
        longest = 0
        for conv in bset.conversations:
            if conv.prefixes:
                longest = max(longest, max(len(p) for p in conv.prefixes))
                continue
            n = conv.n_turns
            rendered = len(self.prompt_ids(conv, n - 1, [""] * (n - 1)))
            longest = max(longest, rendered + (n - 1) * (self.max_new_tokens * 9 // 8 + REPLY_SLACK))
        return longest + self.max_new_tokens + round_width(B, self.tree_budget)

    def ready(self, capacity: int) -> Any:
        """The engine to decode with: "reference", or a graphs engine of at least ``capacity`` positions
        (built and warmed up, on a GPU captured, when none is held or the held one is too small; its
        capacity rounded up to a multiple of CAPACITY_STEP, so that similar sets share one engine)."""
        from dflashkit.infer.engine import ready_engine

        if self.engine == "reference":
            return "reference"
        if self._engine is None or self._engine.capacity < capacity:
            capacity = -(-capacity // CAPACITY_STEP) * CAPACITY_STEP
            self._engine, warm = ready_engine(
                self.engine,
                self.target,
                self.drafter,
                capacity=capacity,
                graphs=self.graphs,
                tree_budget=self.tree_budget,
                layers=self.layers,
            )
            if warm and self.console is not None:
                steps = ", ".join(f"{name} {s:.1f} s" for name, s in warm.items())
                self.console.print(
                    f"{self.engine} engine ({self.layers} layers): {capacity} positions; warmed up ({steps})"
                )
        return self._engine

    def warm_up(self, ids: list[int], temperatures: Sequence[float] = (0.0,)) -> None:
        """A few tokens of both loops at each temperature before measuring: first-call costs (a sampled round's
        step is captured on its first call) stay out of the figures."""
        from dflashkit.infer.engine import round_width
        from dflashkit.infer.speculative import Sampling, autoregressive_generate, speculative_generate

        n = min(4, self.max_new_tokens)
        engine = self.ready(len(ids) + n + round_width(self.drafter.config.block_size, self.tree_budget))
        for t in temperatures:
            for proposal in self.proposals() if t > 0 else ("marginal",):
                s = Sampling(t, self.top_p, "rejection", 0, proposal)  # type: ignore[arg-type]
                for budget in self.sampled_rounds() if t > 0 else (self.rounds(t),):
                    speculative_generate(
                        self.target, self.drafter, ids, n, s, engine=engine, tree_budget=budget
                    )
            layers = self.drafter.config.target_layer_ids
            autoregressive_generate(self.target, ids, n, s, layer_ids=layers, engine=engine)

    def proposals(self) -> tuple[str, ...]:
        """The proposals a sampled chain round may take: the one given, or both under "auto"."""
        return ("marginal", "argmax") if self.draft_sampling == "auto" else (self.draft_sampling,)

    def ceilings(self, bset: BenchSet, temperature: float) -> dict[str, Any] | None:
        """The ceilings (`infer.ceilings.measure`) on the first turns of the set's first ``ceiling_prompts``
        conversations at ``temperature`` on the reference engine; None when none are asked for."""
        from dflashkit.infer.ceilings import measure
        from dflashkit.infer.engine import AUTO_TREE_BUDGET
        from dflashkit.infer.sampling import Sampling

        if not self.ceiling_prompts or temperature <= 0 or not bset.conversations:
            return None
        prompts = [self.prompt_ids(c, 0, []) for c in bset.conversations[: self.ceiling_prompts]]
        s = Sampling(temperature=temperature, top_p=self.top_p, seed=self.seed)
        # the tree the set may be served with (choosing by them), else the one --tree-budget auto builds
        budget = self.tree_budget if self.trees_by_ceilings and self.tree_budget else AUTO_TREE_BUDGET
        return measure(self.target, self.drafter, prompts, s, self.max_new_tokens, self.eos_ids, budget)

    def reply_text(self, tokens: list[int]) -> str:
        eos = set(self.eos_ids)
        return self.tokenizer.decode([t for t in tokens if t not in eos], skip_special_tokens=True)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def decode_set(
    dec: Decoder,
    bset: BenchSet,
    temperature: float,
    *,
    baseline: bool = True,
    compare: bool = False,
    stop_at_difference: bool = False,
    progress: Callable[[Response], None] | None = None,
    draft_sampling: str = "marginal",
    trees: bool | None = None,
) -> list[Response]:
    """Decode every response of ``bset`` at ``temperature``: speculatively, and autoregressively when
    ``baseline`` or ``compare`` (greedy only: record where the two outputs first differ; with
    ``stop_at_difference`` stop at the first response that differs). Each response gets its own sampling seed;
    a sampled chain round proposes by ``draft_sampling`` (`sampling.propose`). ``trees``: rounds of the
    decoder's tree budget (True) or chains (False); None: the decoder's rounds at this temperature."""
    from dflashkit.infer.speculative import (
        Sampling,
        Stopper,
        autoregressive_generate,
        speculative_generate,
    )

    if compare and temperature > 0:
        raise DflashkitError("the lossless check compares greedy outputs token for token: temperature 0")
    from dflashkit.infer.engine import round_width

    rule = "rejection" if temperature > 0 else "exact"
    B = dec.drafter.config.block_size
    budget = dec.rounds(temperature) if trees is None else (dec.tree_budget if trees else None)
    stopper = Stopper(dec.eos_ids)
    engine = dec.ready(dec.capacity(bset))
    out: list[Response] = []
    for c, conv in enumerate(bset.conversations):
        replies: list[str] = []
        for turn in range(conv.n_turns):
            ids = dec.prompt_ids(conv, turn, replies)
            engine = dec.ready(len(ids) + dec.max_new_tokens + round_width(B, dec.tree_budget))
            seed = dec.seed * 1_000_003 + len(out)
            s = Sampling(temperature, dec.top_p, rule, seed, draft_sampling, dec.tree_rule)  # type: ignore[arg-type]
            spec = speculative_generate(
                dec.target,
                dec.drafter,
                ids,
                dec.max_new_tokens,
                s,
                stopper,
                engine=engine,
                tree_budget=budget,
            )
            r = Response(
                c,
                turn,
                len(ids),
                len(spec.tokens),
                spec.accept_lengths,
                spec.seconds - spec.prefill_seconds,
            )
            if baseline or compare:
                s_ar = Sampling(temperature=temperature, top_p=dec.top_p, rule=rule, seed=seed)
                layer_ids = dec.drafter.config.target_layer_ids
                ar = autoregressive_generate(
                    dec.target, ids, dec.max_new_tokens, s_ar, stopper, layer_ids, engine=engine
                )
                r.ar_new_tokens, r.ar_seconds = len(ar.tokens), ar.seconds - ar.prefill_seconds
                if compare:
                    r.first_difference = first_difference(spec.tokens, ar.tokens)
            out.append(r)
            if progress is not None:
                progress(r)
            if stop_at_difference and r.first_difference is not None:
                return out
            if not conv.prefixes:  # the next turn is rendered after this reply
                replies.append(dec.reply_text(spec.tokens))
    return out


# --------------------------------------------------------------------------------------------------
# Figures


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def spread(values: list[float]) -> dict[str, float]:
    """Mean, standard deviation and quantiles of per-response figures."""
    v = sorted(x for x in values if not math.isnan(x))
    if not v:
        return {k: math.nan for k in ("mean", "std", "min", "p10", "median", "p90", "max")}
    return {
        "mean": statistics.fmean(v),
        "std": statistics.pstdev(v),
        "min": v[0],
        "p10": _quantile(v, 0.1),
        "median": _quantile(v, 0.5),
        "p90": _quantile(v, 0.9),
        "max": v[-1],
    }


def figures(responses: list[Response], block_size: int, temperature: float) -> dict[str, Any]:
    """The figures of one set at one temperature: tau over all rounds (tokens per target pass; what the speedup
    follows), its spread over responses, tokens/s of both loops (decode time only) and the speedup."""
    rounds = [t for r in responses for t in r.accept_lengths]
    hist = [0] * (block_size + 1)
    for t in rounds:
        hist[min(t, block_size)] += 1
    spec_time = sum(r.spec_seconds for r in responses)
    spec_tps = sum(r.new_tokens for r in responses) / spec_time if spec_time > 0 else math.nan
    timed = [r for r in responses if r.ar_seconds is not None and r.ar_new_tokens is not None]
    ar_time = sum(r.ar_seconds or 0.0 for r in timed)
    ar_tps = sum(r.ar_new_tokens or 0 for r in timed) / ar_time if timed and ar_time > 0 else None
    # per reply: the baseline's rate and the speedup (a process's drift moves the whole spread, a few slow replies
    # its tail; on 2026-12-06 one drafter's GSM8K read 2.88-3.05x in three processes)
    paired = [
        (r, r.ar_new_tokens / r.ar_seconds)
        for r in timed
        if r.ar_seconds and r.ar_new_tokens and r.spec_seconds > 0
    ]
    fig: dict[str, Any] = {
        "temperature": temperature,
        "rule": "rejection" if temperature > 0 else "greedy",
        "responses": len(responses),
        "rounds": len(rounds),
        "new_tokens": sum(r.new_tokens for r in responses),
        "tau": sum(rounds) / len(rounds) if rounds else math.nan,
        "tau_per_response": spread([r.tau for r in responses]),
        "accept_length_histogram": hist,
        "per_position_acceptance": [
            sum(1 for t in rounds if t >= k + 1) / len(rounds) if rounds else math.nan
            for k in range(1, block_size)
        ],
        "spec_tokens_per_second": spec_tps,
        "ar_tokens_per_second": ar_tps,
        "speedup": spec_tps / ar_tps if ar_tps else None,
        "ar_tokens_per_second_per_response": spread([rate for _, rate in paired]),
        "speedup_per_response": spread([r.new_tokens / r.spec_seconds / rate for r, rate in paired]),
    }
    # what a round costs in autoregressive tokens (tau / speedup): with tau, what the speedup is made of
    fig["round_cost_ar_tokens"] = round_cost(fig)
    return fig


def round_cost(fig: dict[str, Any]) -> float | None:
    """A round's cost in autoregressive tokens: tau / speedup, from the figure's own tau and speedup (so an
    older bench.json, written before the key, has it too); None without a measured baseline."""
    return fig["tau"] / fig["speedup"] if fig.get("speedup") else None


def slower_than_autoregressive(where: str, tau: float, speedup: float | None) -> str | None:
    """One line saying so when speculative decoding measured slower than the autoregressive loop on the same
    engine (speedup < 1), with why in the method's terms: each round accepted fewer tokens (tau) than it costs
    in autoregressive tokens (tau / speedup). None when it paid, or when no baseline was measured."""
    if not speedup or math.isnan(speedup) or speedup >= 1.0:
        return None
    return (
        f"{where}: speculative decoding was slower than autoregressive decoding ({speedup:.2f}x): a round "
        f"gave {tau:.2f} tokens and cost {tau / speedup:.2f} autoregressive tokens. A drafter pays where its "
        "tau passes that cost: serve it where it was trained to be accepted (a drafter trained on the target's "
        "argmax is accepted at T=0), or decode without it"
    )


def temperature_key(t: float) -> str:
    """How a temperature keys the JSON: "0", "1", "0.7"."""
    return f"{t:g}"


# --------------------------------------------------------------------------------------------------
# Files


def drafter_identity(folder: Path) -> str:
    """A digest of a drafter checkpoint's weights: its recorded checksums when it has them, else the bytes."""
    from dflashkit.model.checkpoint import weight_files

    h = hashlib.sha256()
    sums = folder / CHECKSUMS_FILE
    if sums.is_file():
        recorded = json.loads(sums.read_text()).get("files", {})
        for name in weight_files(folder):
            h.update(f"{name}:{recorded.get(name, '')}".encode())
        if all(recorded.get(n) for n in weight_files(folder)):
            return h.hexdigest()[:16]
    h = hashlib.sha256()
    for name in weight_files(folder):
        with (folder / name).open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json(path, data)


def unique_stem(out_dir: Path, stem: str) -> str:
    k, candidate = 1, stem
    while (out_dir / f"{candidate}.json").exists():
        k += 1
        candidate = f"{stem}-{k}"
    return candidate


def write_set(out: Path, result: dict[str, Any]) -> Path:
    """A finished set's results as sets/<name>.json; an earlier result of that set is kept as
    sets/earlier/<name>-<time>.json."""
    path = out / SETS_DIR / f"{result['set']}.json"
    if path.is_file():
        earlier = out / SETS_DIR / EARLIER_DIR
        earlier.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        stem = unique_stem(earlier, f"{result['set']}-{stamp}")
        os.replace(path, earlier / f"{stem}.json")
    _write_json(path, result)
    return path


def _set_files(out: Path) -> list[Path]:
    folder = out / SETS_DIR
    return sorted(folder.glob("*.json")) if folder.is_dir() else []


def check_settings(out: Path, settings: dict[str, Any]) -> None:
    """Sets already in ``out`` must have been measured with these settings: one table compares like with like."""
    for path in _set_files(out):
        try:
            theirs = json.loads(path.read_text()).get("settings", {})
        except json.JSONDecodeError:
            continue
        diff = [k for k in sorted(set(theirs) | set(settings)) if theirs.get(k) != settings.get(k)]
        if diff:
            shown = "; ".join(f"{k}: {theirs.get(k)!r} there vs {settings.get(k)!r} now" for k in diff[:3])
            raise DflashkitError(
                f"{out} holds bench results measured with other settings ({path.name}: {shown}); "
                "use another --out, or move that folder aside"
            )


def read_sets(out: Path) -> dict[str, dict[str, Any]]:
    """Every set result in ``out`` (sets/<name>.json), by set name: the named sets in SETS order, then files."""
    found: dict[str, dict[str, Any]] = {}
    for path in _set_files(out):
        data = json.loads(path.read_text())
        found[data["set"]] = data
    order = [s for s in SETS if s in found] + sorted(s for s in found if s not in SETS)
    return {s: found[s] for s in order}


def summary(sets: dict[str, dict[str, Any]], temperature: str = SUMMARY_TEMPERATURE) -> dict[str, Any]:
    """{set: {tau, speedup, ...}} at one temperature (the drafter table: T=0)."""
    table = {}
    for name, res in sets.items():
        fig = res["temperatures"].get(temperature)
        if fig is None:
            continue
        lossless = res.get("lossless_fp32")
        table[name] = {
            "tau": fig["tau"],
            "speedup": fig["speedup"],
            "round_cost_ar_tokens": round_cost(fig),
            "prompts": res["prompts"],
            "responses": fig["responses"],
            "ar_tokens_per_second": fig["ar_tokens_per_second"],
            "spec_tokens_per_second": fig["spec_tokens_per_second"],
            "lossless_fp32": lossless["lossless"] if lossless else None,
        }
    return table


def training_loss(drafter_dir: Path) -> str:
    """The loss a drafter was trained with, as its run config says (train.loss, or train.distill's older
    {ce, kl} mix; with the temperature of a distribution loss): "ce", "lk at T=1", "{ce: 0.1, tv: 0.9} at T=1".
    Read from best/'s metrics.json ("train"), the folder's run_config.yaml (a checkpoint) or its run folder's
    config.yaml; "unknown" when none holds it (a drafter trained before best/ recorded it, copied out of its run)."""
    import yaml

    for path in (
        drafter_dir / "metrics.json",
        drafter_dir / "run_config.yaml",
        drafter_dir.parent / "config.yaml",
    ):
        try:
            data = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            continue
        train = data.get("train") if isinstance(data, dict) else None
        if not isinstance(train, dict):
            continue
        distill = float(train.get("distill") or 0.0)
        loss = {"ce": 1 - distill, "kl": distill} if distill > 0 else train.get("loss", "ce")
        if isinstance(loss, dict):
            weights = {str(k): float(v) for k, v in loss.items()}
            name = "{" + ", ".join(f"{k}: {v:g}" for k, v in weights.items()) + "}"
        else:
            weights, name = {str(loss): 1.0}, str(loss)
        if any(k != "ce" and w > 0 for k, w in weights.items()):  # against the target's distribution at T
            name += f" at T={float(train.get('loss_temperature', 1.0)):g}"
        return name
    return "unknown"


def sampling_table(sets: dict[str, dict[str, Any]], settings: dict[str, Any]) -> dict[str, Any]:
    """The sampling table (issue 60's shape): per temperature "t<T>" ("t0", "t0.7", "t1") {set: {tau, speedup,
    rounds}}, rounds "tree<N>" or "chain"; per T > 0 whose ceilings were measured "ceiling_t<T>" {set: E[max p_T]
    (the argmax chain's per-slot ceiling, the mean over the measured slots)}; "loss", the drafter's training
    loss (`training_loss`); "draft_sampling" per T > 0, the proposal served, or {set: proposal} where sets
    served different ones."""
    temps = sorted({k for res in sets.values() for k in res["temperatures"]}, key=float)
    table: dict[str, Any] = {}
    for key in temps:
        table[f"t{key}"] = {
            name: {
                "tau": fig["tau"],
                "speedup": fig["speedup"],
                "rounds": served_rounds(fig, res.get("settings", settings)),
            }
            for name, res in sets.items()
            if (fig := res["temperatures"].get(key)) is not None
        }
    for key in temps:
        ceilings = {
            name: statistics.fmean(c["max_p"])
            for name, res in sets.items()
            if (c := res["temperatures"].get(key, {}).get("ceilings")) and c.get("max_p")
        }
        if ceilings:
            table[f"ceiling_t{key}"] = ceilings
    table["loss"] = training_loss(Path(settings["drafter"]))
    proposals: dict[str, Any] = {}
    for key in temps:
        if float(key) <= 0:
            continue
        served = {
            name: res["temperatures"][key].get("draft_sampling", settings.get("draft_sampling", "marginal"))
            for name, res in sets.items()
            if key in res["temperatures"]
        }
        one = set(served.values())
        proposals[f"t{key}"] = one.pop() if len(one) == 1 else served
    table["draft_sampling"] = proposals
    return table


def sampled(sets: dict[str, dict[str, Any]]) -> bool:
    """Whether any set was measured above T=0 (then --summary writes the sampling table)."""
    return any(float(k) > 0 for res in sets.values() for k in res["temperatures"])


def combined(out: Path, settings: dict[str, Any], command: str) -> dict[str, Any]:
    """bench.json: the settings, every set in ``out`` without its per-response lists, and the T=0 summary."""
    sets = read_sets(out)
    brief = {name: {k: v for k, v in res.items() if k != "responses_detail"} for name, res in sets.items()}
    return {
        "kind": "dflashkit-bench",
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": command,
        "settings": settings,
        "sets": brief,
        "summary_t0": summary(sets),
    }


def plot(bench: dict[str, Any], path: Path) -> Path:
    """Bars of tau and speedup per set, one bar per temperature, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = bench["sets"]
    names = list(sets)
    temps = sorted({t for res in sets.values() for t in res["temperatures"]}, key=float)
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.2 * len(names) + 3), 4))
    width = 0.8 / max(1, len(temps))
    colors = ["#3b7dd8", "#d8663b", "#5aa05a", "#8d5ad8"]
    for ax, key, label in ((axes[0], "tau", "acceptance length tau"), (axes[1], "speedup", "speedup (x)")):
        for j, t in enumerate(temps):
            xs, ys, low, high = [], [], [], []
            for i, name in enumerate(names):
                fig_t = sets[name]["temperatures"].get(t)
                value = fig_t.get(key) if fig_t else None
                if value is None or math.isnan(value):
                    continue
                xs.append(i + (j - (len(temps) - 1) / 2) * width)
                ys.append(value)
                if key == "tau":  # the spread over responses: p10 to p90
                    sp = fig_t["tau_per_response"]
                    low.append(max(0.0, value - sp["p10"]))
                    high.append(max(0.0, sp["p90"] - value))
            errors = [low, high] if key == "tau" and ys else None
            color = colors[j % len(colors)]
            bars = ax.bar(xs, ys, width, yerr=errors, capsize=3, label=f"T={t}", color=color)
            ax.bar_label(bars, fmt="%.2f", fontsize=8, label_type="center" if key == "tau" else "edge")
        if key == "speedup":
            ax.axhline(1.0, color="k", lw=0.8, ls="--")
        ax.set_xticks(range(len(names)), [SET_TITLES.get(n, n) for n in names])
        ax.set_ylabel(label)
        ax.legend()
    axes[0].set_title("tau over all rounds; whiskers: p10-p90 over responses", fontsize=9)
    s = bench["settings"]
    fig.suptitle(
        f"{'/'.join(Path(s['drafter']).parts[-2:])} on {s['target']}: {s['engine']} engine{rounds_note(s)}, "
        f"{s['dtype']}, {s['max_new_tokens']} new tokens",
        fontsize=9,
    )
    fig.tight_layout()
    with atomic_file(path) as tmp:  # never a half-written plot
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


def served_rounds(fig: dict[str, Any], settings: dict[str, Any]) -> str:
    """What a set's rounds were at one temperature, "tree<N>" or "chain": as recorded (``rounds_served``), or
    for a result written before the key, from the settings' rule."""
    if fig.get("rounds_served"):
        return str(fig["rounds_served"])
    budget = settings.get("tree_budget")
    trees = budget and (fig.get("temperature") == 0 or settings.get("trees_at") != "T=0")
    return f"tree{budget}" if trees else "chain"


def trees_by_ceilings_note() -> str:
    """The settings' ``trees_at`` under --tree-budget auto with --ceilings N: trees at T=0, and above where each
    set's ceilings expect them to pay (the round cost named: a folder's sets were chosen by one rule)."""
    from dflashkit.infer.ceilings import TREE_ROUND_COST

    return f"T=0, and above where the set's ceilings expect over {TREE_ROUND_COST:g}x the chain's tokens"


def rounds_note(settings: dict[str, Any]) -> str:
    """ ", trees of N drafted nodes" (and "at T=0, chains above" under --tree-budget auto; above T=0 by the
    ceilings when they chose) when the rounds verified trees; nothing for chains."""
    budget = settings.get("tree_budget")
    if not budget:
        return ""
    at = settings.get("trees_at")
    where = "" if not at else f" at {at}, chains above" if at == "T=0" else f" at {at} (else chains)"
    return f", trees of {budget} drafted nodes{where}"


def markdown_table(bench: dict[str, Any]) -> str:
    """The table as Markdown (for a results file), with the settings and the command above it."""
    s = bench["settings"]
    trees = rounds_note(s)
    lines = [
        f"{'/'.join(Path(s['drafter']).parts[-2:])} (B={s['block_size']}) on {s['target']}: {s['engine']} engine"
        f"{trees}, {s['dtype']}, {s['device']}, {s['max_new_tokens']} new tokens per reply",
        "",
        f"`{bench['command']}`",
        "",
        "| set | T | prompts (replies) | tau | tau p10-p90 | AR tok/s | spec tok/s | speedup | round (AR tokens) "
        "| rounds | fp32 lossless |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(x: float | None, spec: str) -> str:
        return "-" if x is None or math.isnan(x) else format(x, spec)

    for name, res in bench["sets"].items():
        check = res.get("lossless_fp32")
        for key, fig in res["temperatures"].items():
            lossless = "-"
            if check and key == "0":
                lossless = f"{'yes' if check['lossless'] else 'NO'} ({check['responses']})"
            sp = fig["tau_per_response"]
            lines.append(
                f"| {SET_TITLES.get(name, name)} | {key} | {res['prompts']} ({fig['responses']}) | "
                f"{f(fig['tau'], '.2f')} | {f(sp['p10'], '.2f')}-{f(sp['p90'], '.2f')} | "
                f"{f(fig['ar_tokens_per_second'], '.1f')} | {f(fig['spec_tokens_per_second'], '.1f')} | "
                f"{f(fig['speedup'], '.2f')}x | {f(round_cost(fig), '.2f')} | {served_rounds(fig, s)} | {lossless} |"
            )
    return "\n".join(lines) + "\n"


def write_outputs(
    out: Path, settings: dict[str, Any], command: str, summary_path: Path | None
) -> dict[str, Any]:
    """bench.json, bench.md and bench.png from every set in ``out``; the summary at ``summary_path`` when asked:
    the sampling table (`sampling_table`) when the folder's sets were measured above T=0, else the T=0
    summary {set: {tau, speedup, ...}} (the drafter table)."""
    bench = combined(out, settings, command)
    _write_json(out / BENCH_JSON, bench)
    (out / BENCH_MD).write_text(markdown_table(bench))
    plot(bench, out / BENCH_PNG)
    if summary_path is not None:
        sets = read_sets(out)
        if not sets:
            raise DflashkitError(f"--summary: {out} holds no measured set")
        _write_json(summary_path, sampling_table(sets, settings) if sampled(sets) else bench["summary_t0"])
    return bench


# --------------------------------------------------------------------------------------------------
# One set, every temperature


def lossless_result(bset: BenchSet, responses: list[Response], dtype: str, engine: str) -> dict[str, Any]:
    """Whether greedy speculative output equalled the autoregressive output on every checked response (decoded
    in ``dtype`` on ``engine``), and where the first difference was."""
    first = next((r for r in responses if r.first_difference is not None), None)
    where = None
    if first is not None:
        where = {
            "conversation": first.conversation,
            "key": bset.conversations[first.conversation].key,
            "turn": first.turn,
            "new_token": first.first_difference,
        }
    return {
        "dtype": dtype,
        "engine": engine,
        "responses": len(responses),
        "lossless": first is None,
        "first_difference": where,
    }


# --------------------------------------------------------------------------------------------------
# The training metric beside the decoded one: like with like only


@dataclass
@dataclass
class TrainingReference:
    """The drafter's training metric (from its metrics.json) and whether it was measured on the prompts
    being evaluated: the held-out split of the dataset it was trained on."""

    acceptance_length: float
    kind: str  # "served order" or "mean over anchors" (a drafter trained before the served-order walk)
    data_dir: str | None  # the dataset whose held-out split it was measured on (None: not recorded)
    comparable: bool


def training_reference(drafter_dir: Path, prompts: str, data_dir: str | None) -> TrainingReference | None:
    """The training metric of a drafter folder, compared only where it compares: ``prompts`` is
    "validation" of the very dataset it was measured on. None when the folder has no metrics.json."""
    metrics = drafter_dir / "metrics.json"
    if not metrics.is_file():
        return None
    try:
        trained = json.loads(metrics.read_text())
        tau = served_tau(trained)
    except (ValueError, TypeError, AttributeError):
        return None
    kind = "served order" if "served_acceptance_length" in trained else "mean over anchors"
    measured_on = trained.get("data_dir") or _run_data_dir(drafter_dir)
    same_data = measured_on is None or (
        data_dir is not None
        and (
            Path(measured_on).resolve() == Path(data_dir).resolve()
            or _holds_out_the_same_prompts(trained.get("held_out_prompts"), data_dir)
        )
    )
    return TrainingReference(tau, kind, measured_on, prompts == "validation" and same_data)


def _holds_out_the_same_prompts(fingerprint: object, data_dir: str) -> bool:
    """Whether the dataset at ``data_dir`` holds out the prompts training measured on (another folder, e.g. a
    dataset of the held-out set alone, written again with the same prompts)."""
    from dflashkit.data.dataset import held_out_prompts_fingerprint

    return isinstance(fingerprint, str) and fingerprint == held_out_prompts_fingerprint(data_dir)


def _run_data_dir(drafter_dir: Path) -> str | None:
    """data.dir of the training run a drafter folder belongs to (<run>/config.yaml), if it is there."""
    import yaml

    config = drafter_dir.parent / "config.yaml"
    try:
        data = yaml.safe_load(config.read_text()) if config.is_file() else None
        return str(data["data"]["dir"]) if isinstance(data, dict) else None
    except (yaml.YAMLError, KeyError, TypeError):
        return None


def training_metric(
    drafter_dir: Path, data_dir: str | None, decoded_tau: float, bset: BenchSet
) -> dict[str, Any] | None:
    """The drafter's training metric (the served-order tau on the held-out split of its dataset) beside the tau
    decoded on that split, and the gap; None when the drafter folder records none."""
    from dataclasses import asdict

    ref = training_reference(drafter_dir, "validation", data_dir)
    if ref is None:
        return None
    gap = (decoded_tau - ref.acceptance_length) / ref.acceptance_length if ref.acceptance_length else math.nan
    return {**asdict(ref), "decoded_tau": decoded_tau, "gap": gap if ref.comparable else None}


def run_set(
    dec: Decoder,
    bset: BenchSet,
    temperatures: Sequence[float],
    *,
    settings: dict[str, Any],
    lossless: Decoder | None = None,
    lossless_limit: int | None = None,
    drafter_dir: Path | None = None,
    data_dir: str | None = None,
    progress: Callable[[str, Response], None] | None = None,
) -> dict[str, Any]:
    """Decode ``bset`` at each temperature; with ``lossless`` (a float32 decoder) also check greedy
    losslessness: inside the T=0 pass when ``lossless`` is ``dec`` itself, else in a pass of its own over the
    first ``lossless_limit`` conversations. Under ``dec.trees_by_ceilings`` each T > 0 is served by trees or
    the chain as the set's ceilings choose (`ceilings.trees_pay`). Returns the set's result (what
    sets/<name>.json holds: at each temperature ``rounds_served``, "tree<N>" or "chain", and under the ceilings'
    choice ``rounds_why``, the expected tokens it compared)."""
    from dflashkit.infer.ceilings import trees_pay

    B = dec.drafter.config.block_size
    result: dict[str, Any] = {
        "set": bset.name,
        "source": bset.source,
        "prompts": len(bset.conversations),
        "settings": settings,
        "temperatures": {},
        "lossless_fp32": None,
        "responses_detail": {},
    }
    if bset.conversations:
        dec.warm_up(dec.prompt_ids(bset.conversations[0], 0, []), temperatures)
    for t in temperatures:
        key = temperature_key(t)
        compare = lossless is dec and t == 0

        def report(r: Response, key: str = key) -> None:
            if progress is not None:
                progress(f"{bset.name} T={key}", r)

        ceilings = dec.ceilings(bset, t)
        proposal = dec.draft_sampling
        if proposal == "auto":  # the proposal whose chain the ceilings expect more tokens from
            proposal = ceilings["draft_sampling"] if ceilings else "marginal"
        trees, why = None, None
        if t > 0 and dec.trees_by_ceilings and dec.tree_budget:  # trees where the ceilings expect them to pay
            trees, why = trees_pay(ceilings, proposal) if ceilings else (False, None)
        responses = decode_set(
            dec, bset, t, compare=compare, progress=report, draft_sampling=proposal, trees=trees
        )
        fig = result["temperatures"][key] = figures(responses, B, t)
        budget = dec.rounds(t) if trees is None else (dec.tree_budget if trees else None)
        fig["rounds_served"] = f"tree{budget}" if budget else "chain"
        if why is not None:
            fig["rounds_why"] = why
        if t > 0:
            fig["draft_sampling"] = proposal
        if ceilings is not None:
            fig["ceilings"] = ceilings
        result["responses_detail"][key] = [
            {**r.__dict__, "key": bset.conversations[r.conversation].key} for r in responses
        ]
        if compare:
            result["lossless_fp32"] = lossless_result(bset, responses, "float32", dec.engine)
    if lossless is not None and result["lossless_fp32"] is None:
        subset = BenchSet(bset.name, bset.source, bset.conversations[:lossless_limit])
        if subset.conversations and lossless is not dec:
            lossless.warm_up(lossless.prompt_ids(subset.conversations[0], 0, []))

        def report32(r: Response) -> None:
            if progress is not None:
                progress(f"{bset.name} fp32 check", r)

        checked = decode_set(lossless, subset, 0.0, compare=True, stop_at_difference=True, progress=report32)
        result["lossless_fp32"] = lossless_result(subset, checked, "float32", lossless.engine)
    t0 = result["temperatures"].get("0")
    # the training metric is a chain's served-order tau: beside tree rounds it would read as a gap
    if bset.name == "heldout" and drafter_dir is not None and t0 is not None and not dec.rounds(0.0):
        result["training_metric"] = training_metric(drafter_dir, data_dir, t0["tau"], bset)
    return result
