"""Piped output (a log, `| tee`): `generate` prints the model's text with its own line breaks only (rich
hard-wraps at 80 columns otherwise), and bench's table keeps its headers whole."""

from __future__ import annotations

import io
from pathlib import Path
from types import SimpleNamespace

from rich.console import Console

from dflashkit.cli import main

HEADERS = ("set", "prompts", "tau", "p10-p90", "AR tok/s", "spec tok/s", "speedup", "fp32 lossless")


def test_generate_never_breaks_the_models_lines(tmp_path: Path, monkeypatch, capsys) -> None:
    from dflashkit.infer import speculative
    from dflashkit.target.tokenizer import serving_tokenizer

    text = "The sea is wide and deep and blue, " * 8  # one line of ~280 characters
    drafter = tmp_path / "d"
    assert main(["init", "--out", str(drafter), "--layers", "1", "--block-size", "4"]) == 0

    def generated(target, *args, **kwargs):
        ids = serving_tokenizer(target.path).encode(text.strip(), add_special_tokens=False)
        return SimpleNamespace(
            tokens=ids, accept_lengths=[2] * (len(ids) // 2) + [1] * (len(ids) % 2),
            mean_acceptance_length=2.0, tokens_per_second=1.0, stopped="length",
        )  # fmt: skip

    monkeypatch.setattr(speculative, "speculative_generate", generated)
    capsys.readouterr()
    assert main(["generate", "--drafter", str(drafter), "--engine", "reference", "hello"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert text.strip() in lines  # the whole reply on one line, as the model wrote it


def test_bench_table_keeps_its_headers_whole_when_piped() -> None:
    from dflashkit.commands.bench import bench_table, print_whole

    fig = {
        "responses": 3,
        "tau": 2.5,
        "tau_per_response": {"p10": 1.0, "p90": 3.0},
        "ar_tokens_per_second": 10.0,
        "spec_tokens_per_second": 20.0,
        "speedup": 2.0,
    }
    settings = {
        "drafter": "runs/x/best",
        "block_size": 4,
        "target": "SmolLM2-135M-Instruct",
        "engine": "graphs-kernels",
        "dtype": "bfloat16",
        "device": "NVIDIA H100 80GB HBM3",
        "max_new_tokens": 256,
    }
    sets = {"mtbench": {"prompts": 80, "lossless_fp32": {"responses": 80, "lossless": True}}}
    sets["mtbench"]["temperatures"] = {"0": fig, "1": fig}
    out = io.StringIO()
    piped = Console(file=out, width=80)
    assert not piped.is_terminal
    print_whole(piped, bench_table({"settings": settings, "sets": sets}, ["mtbench"]))
    header = next(line for line in out.getvalue().splitlines() if "prompts" in line)
    cells = [c.strip() for c in header.strip("┃ ").split("┃")]
    assert [c for c in cells if c in HEADERS] == [h for h in HEADERS if h in cells] and set(HEADERS) <= set(
        cells
    )
    assert "…" not in out.getvalue()
