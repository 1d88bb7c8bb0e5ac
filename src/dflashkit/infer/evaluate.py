"""`dflashkit eval`: acceptance length, per-position acceptance and speedup of a drafter, measured
by actually decoding (speculative vs autoregressive on the same engine), plus a losslessness check.

Prompts are rendered with the target tokenizer's chat template and the same thinking-mode setting the
drafter's training data used (checked against the dataset manifest when one is given).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflashkit.atomic import atomic_file, write_json
from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import Engine
from dflashkit.infer.speculative import (
    Generation,
    Sampling,
    Stopper,
    autoregressive_generate,
    speculative_generate,
)
from dflashkit.model.acceptance import served_tau


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
    engine: str = "reference"  # the decode engine both loops ran on
    tree_budget: int | None = None  # drafted nodes per tree round (None: chain rounds)
    dtype: str = ""  # of the target and drafter the figures were measured with
    # the greedy check when it ran on float32 copies (a bf16 run): its dtype, prompts, tau and speedup
    lossless_check: dict[str, Any] | None = None
    draft_sampling: str = "marginal"  # a sampled chain round's proposal (`sampling.propose`)

    @property
    def round_cost(self) -> float | None:
        """What one speculative round costs in autoregressive tokens: tau / speedup (speedup = tau / cost)."""
        return self.mean_acceptance_length / self.speedup if self.speedup else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "round_cost_ar_tokens": self.round_cost}


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
    engine: str | Engine = "reference",
    tree_budget: int | None = None,
) -> EvalReport:
    """Decode every prompt speculatively (and autoregressively for the baseline/lossless check), both on
    ``engine`` (a name, or an engine built once for all prompts: ``dflashkit.infer.engine``); with
    ``tree_budget``, speculative rounds verify trees of that many drafted nodes (``dflashkit.infer.tree``)."""
    if check_lossless and not sampling.greedy:
        raise DflashkitError("--check-lossless compares greedy outputs token for token: use --temperature 0")
    stopper = Stopper(eos_ids)
    gens: list[tuple[Generation, Generation | None]] = []
    results = []
    for i, ids in enumerate(prompt_ids):
        spec = speculative_generate(
            target, drafter, ids, max_new_tokens, sampling, stopper, backend, engine, tree_budget
        )
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
        draft_sampling=sampling.draft_sampling,
        mean_acceptance_length=mean_tau,
        accept_length_histogram=hist,
        per_position_acceptance=per_pos,
        spec_tokens_per_second=spec_tps,
        ar_tokens_per_second=ar_tps,
        speedup=spec_tps / ar_tps if ar_tps else None,
        lossless=True if check_lossless else None,
        results=results,
        engine=engine if isinstance(engine, str) else engine.name,
        tree_budget=tree_budget or None,
    )


# --------------------------------------------------------------------------------------------------
# The training metric beside the served one: like with like only


@dataclass
class TrainingReference:
    """The drafter's training metric (from its metrics.json) and whether it was measured on the prompts
    being evaluated: the held-out split of the dataset it was trained on."""

    acceptance_length: float
    kind: str  # "served order" or "mean over anchors" (a drafter trained before the served-order walk)
    data_dir: str | None  # the dataset whose held-out split it was measured on (None: not recorded)
    comparable: bool

    def table_row(self, served: float) -> tuple[str, str]:
        where = (
            f"held-out split of {self.data_dir}" if self.data_dir else "held-out split of its training data"
        )
        label = f"training metric ({where}, {self.kind})"
        if not self.comparable:
            return label, f"{self.acceptance_length:.3f} (other prompts than these: not comparable)"
        gap = (served - self.acceptance_length) / self.acceptance_length
        return label, f"{self.acceptance_length:.3f} ({gap:+.1%} served vs trained, same prompts)"


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


# --------------------------------------------------------------------------------------------------
# Report files


def plot_report(report: EvalReport, path: Path, reference: TrainingReference | None = None) -> Path:
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
    if reference is not None and reference.comparable:
        ax1.axvline(
            reference.acceptance_length,
            color="#d8663b",
            ls=":",
            label=f"training metric {reference.acceptance_length:.2f}",
        )
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
    with atomic_file(path) as tmp:  # never a half-written plot
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    return path


LATEST_JSON, LATEST_PNG = "eval.json", "eval.png"


def write_report(
    report: EvalReport, out_dir: Path, reference: TrainingReference | None = None, *, label: str = ""
) -> tuple[Path, Path, Path]:
    """Write this evaluation as eval-<time>[-label].json/.png in ``out_dir``, where earlier evaluations stay,
    and make eval.json / eval.png (the newest) copies of it. Returns (eval.json, eval.png, the kept json)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    keep_unstamped(out_dir)
    stem = _unique_stem(
        out_dir, f"eval-{time.strftime('%Y%m%d-%H%M%S')}" + (f"-{_slug(label)}" if label else "")
    )
    data = report.to_json()
    if reference is not None:
        data["training_acceptance_length"] = reference.acceptance_length
        data["training_metric"] = asdict(reference)
    kept = out_dir / f"{stem}.json"
    write_json(kept, data)
    plot_report(report, out_dir / f"{stem}.png", reference)
    for src, name in ((kept, LATEST_JSON), (out_dir / f"{stem}.png", LATEST_PNG)):
        tmp = out_dir / f".{name}.tmp"
        shutil.copyfile(src, tmp)
        os.replace(tmp, out_dir / name)
    return out_dir / LATEST_JSON, out_dir / LATEST_PNG, kept


def keep_unstamped(out_dir: Path) -> None:
    """An eval.json that has no kept copy (written by an older dflashkit) is kept under its own time."""
    latest = out_dir / LATEST_JSON
    if not latest.is_file():
        return
    content = latest.read_bytes()
    if any(p.read_bytes() == content for p in out_dir.glob("eval-*.json")):
        return
    stem = _unique_stem(
        out_dir, "eval-" + time.strftime("%Y%m%d-%H%M%S", time.localtime(latest.stat().st_mtime))
    )
    shutil.copyfile(latest, out_dir / f"{stem}.json")
    if (out_dir / LATEST_PNG).is_file():
        shutil.copyfile(out_dir / LATEST_PNG, out_dir / f"{stem}.png")


def _unique_stem(out_dir: Path, stem: str) -> str:
    k, candidate = 1, stem
    while (out_dir / f"{candidate}.json").exists():
        k += 1
        candidate = f"{stem}-{k}"
    return candidate


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")[:40]
