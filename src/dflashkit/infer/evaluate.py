"""`dflashkit eval`: acceptance length, per-position acceptance and speedup of a drafter, measured
by actually decoding (speculative vs autoregressive on the same engine), plus a losslessness check.

Prompts are rendered with the target tokenizer's chat template and the same thinking-mode setting the
drafter's training data used (checked against the dataset manifest when one is given).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import Engine
from dflashkit.infer.speculative import (
    Generation,
    Sampling,
    Stopper,
    autoregressive_generate,
    speculative_generate,
)


class LosslessError(DflashkitError):
    """Greedy speculative output differs from the target's own greedy output."""


@dataclass
class PromptResult:
    prompt_index: int
    prompt_tokens: int
    new_tokens: int
    accept_lengths: list[int]
    spec_seconds: float
    ar_seconds: float | None
    ar_new_tokens: int | None
    first_difference: int | None = None  # position of the first token where spec != AR (greedy check)


@dataclass
class EvalReport:
    drafter: str
    target: str
    prompts: int
    block_size: int
    temperature: float
    rule: str
    mean_acceptance_length: float
    accept_length_histogram: list[int]  # index = acceptance length (0 unused), count of rounds
    per_position_acceptance: list[float]  # P(draft slot k accepted), k = 1..B-1
    spec_tokens_per_second: float
    ar_tokens_per_second: float | None
    speedup: float | None
    lossless: bool | None
    results: list[PromptResult] = field(default_factory=list)
    engine: str = "dynamic"  # the decode engine both loops ran on

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarise(
    gens: list[tuple[Generation, Generation | None]], block_size: int
) -> tuple[float, list[int], list[float], float, float | None]:
    taus = [t for g, _ in gens for t in g.accept_lengths]
    hist = [0] * (block_size + 1)
    for t in taus:
        hist[min(t, block_size)] += 1
    rounds = len(taus)
    # slot k (1..B-1) is accepted in a round iff tau >= k + 1
    per_pos = [
        sum(1 for t in taus if t >= k + 1) / rounds if rounds else math.nan for k in range(1, block_size)
    ]
    mean_tau = sum(taus) / rounds if rounds else math.nan
    spec_tokens = sum(len(g.tokens) for g, _ in gens)
    spec_time = sum(g.seconds - g.prefill_seconds for g, _ in gens)
    ar = [a for _, a in gens if a is not None]
    ar_tps = None
    if ar:
        ar_tps = sum(len(a.tokens) for a in ar) / sum(a.seconds - a.prefill_seconds for a in ar)
    return mean_tau, hist, per_pos, spec_tokens / spec_time if spec_time > 0 else math.nan, ar_tps


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def evaluate(
    target: Any,
    drafter: Any,
    prompt_ids: list[list[int]],
    *,
    max_new_tokens: int,
    sampling: Sampling,
    eos_ids: list[int],
    baseline: bool = True,
    check_lossless: bool = False,
    backend: str = "sdpa",
    progress: Any = None,
    names: tuple[str, str] = ("drafter", "target"),
    engine: str | Engine = "dynamic",
) -> EvalReport:
    """Decode every prompt speculatively (and autoregressively for the baseline/lossless check), both on
    ``engine`` (a name, or an engine built once for all prompts: ``dflashkit.infer.engine``)."""
    if check_lossless and not sampling.greedy:
        raise DflashkitError("--check-lossless compares greedy outputs token for token: use --temperature 0")
    stopper = Stopper(eos_ids)
    gens: list[tuple[Generation, Generation | None]] = []
    results = []
    for i, ids in enumerate(prompt_ids):
        spec = speculative_generate(target, drafter, ids, max_new_tokens, sampling, stopper, backend, engine)
        ar = None
        if baseline or check_lossless:
            ar = autoregressive_generate(
                target, ids, max_new_tokens, sampling, stopper, drafter.config.target_layer_ids, engine
            )
        diff = first_difference(spec.tokens, ar.tokens) if (check_lossless and ar is not None) else None
        gens.append((spec, ar))
        results.append(
            PromptResult(
                i,
                len(ids),
                len(spec.tokens),
                spec.accept_lengths,
                spec.seconds,
                ar.seconds if ar else None,
                len(ar.tokens) if ar else None,
                diff,
            )
        )
        if progress is not None:
            progress(i, spec)
        if check_lossless and diff is not None:
            raise LosslessError(
                f"prompt {i}: speculative output differs from the target's greedy output at new token {diff} "
                f"(speculative {spec.tokens[diff] if diff < len(spec.tokens) else 'end'} vs target "
                f"{ar.tokens[diff] if ar and diff < len(ar.tokens) else 'end'})"
            )
    B = drafter.config.block_size
    mean_tau, hist, per_pos, spec_tps, ar_tps = summarise(gens, B)
    return EvalReport(
        drafter=names[0],
        target=names[1],
        prompts=len(prompt_ids),
        block_size=B,
        temperature=sampling.temperature,
        rule=sampling.rule,
        mean_acceptance_length=mean_tau,
        accept_length_histogram=hist,
        per_position_acceptance=per_pos,
        spec_tokens_per_second=spec_tps,
        ar_tokens_per_second=ar_tps,
        speedup=spec_tps / ar_tps if ar_tps else None,
        lossless=True if check_lossless else None,
        results=results,
        engine=engine if isinstance(engine, str) else engine.name,
    )


def plot_report(report: EvalReport, path: Path, training_tau: float | None = None) -> Path:
    """Histogram of acceptance lengths and per-position acceptance, as one PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    B = report.block_size
    rounds = sum(report.accept_length_histogram)
    frac = [c / rounds if rounds else 0 for c in report.accept_length_histogram[1:]]
    ax1.bar(range(1, B + 1), frac, color="#3b7dd8")
    ax1.axvline(
        report.mean_acceptance_length,
        color="k",
        ls="--",
        label=f"mean tau {report.mean_acceptance_length:.2f}",
    )
    if training_tau is not None:
        ax1.axvline(training_tau, color="#d8663b", ls=":", label=f"training metric {training_tau:.2f}")
    ax1.set_xlabel("acceptance length tau (tokens per target pass)")
    ax1.set_ylabel("fraction of rounds")
    ax1.set_xticks(range(1, B + 1))
    ax1.legend()
    ax2.plot(range(1, B), report.per_position_acceptance, marker="o", color="#3b7dd8")
    ax2.set_ylim(0, 1)
    ax2.set_xlabel("draft slot k")
    ax2.set_ylabel("P(slot k accepted)")
    speed = f", speedup {report.speedup:.2f}x" if report.speedup else ""
    fig.suptitle(f"{report.drafter} on {report.prompts} prompts (T={report.temperature}{speed})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(report: EvalReport, out_dir: Path, training_tau: float | None = None) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    js = out_dir / "eval.json"
    data = report.to_json()
    if training_tau is not None:
        data["training_acceptance_length"] = training_tau
    js.write_text(json.dumps(data, indent=2) + "\n")
    png = plot_report(report, out_dir / "eval.png", training_tau)
    return js, png
