"""A prompt (with its reply) longer than the target's context (max_position_embeddings) is warned about in
one line, in generate, eval/bench and prepare, before anything decodes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from dflashkit.cli import main
from dflashkit.target.context import beyond_context, context_of


def test_the_warning_says_which_limit_is_passed() -> None:
    assert beyond_context(100, 28, 128) is None
    assert "is longer than the target's context of 8192" in beyond_context(9000, 0, 8192)
    assert "with 500 new tokens passes the target's context of 8192" in beyond_context(8000, 500, 8192)
    assert beyond_context(10**6, 0, None) is None
    assert context_of(SimpleNamespace(max_position_embeddings=8192)) == 8192


def test_generate_warns_of_a_prompt_longer_than_the_context(tmp_path: Path, monkeypatch, capsys) -> None:
    from dflashkit.infer import speculative

    drafter = tmp_path / "d"
    assert main(["init", "--out", str(drafter), "--layers", "1", "--block-size", "4"]) == 0
    done = SimpleNamespace(
        tokens=[], accept_lengths=[], mean_acceptance_length=1.0, tokens_per_second=1.0, stopped="length"
    )
    monkeypatch.setattr(speculative, "speculative_generate", lambda *a, **k: done)
    capsys.readouterr()
    long_prompt = "words of a long letter " * 2500  # ~10,000 tokens: SmolLM2's context is 8192
    assert main(["generate", "--drafter", str(drafter), "--engine", "reference", long_prompt]) == 0
    out = capsys.readouterr().out
    assert "is longer than the target's context of 8192 positions" in out
    assert main(["generate", "--drafter", str(drafter), "--engine", "reference", "a short one"]) == 0
    assert "context" not in capsys.readouterr().out


def test_prepare_warns_when_its_prompts_may_pass_the_context() -> None:
    from dflashkit.commands.data import longest_prompt_beyond_context
    from dflashkit.data.dataset import PrepareSettings

    settings = PrepareSettings(out="x", max_prompt_tokens=9000)
    assert (
        "a prompt of up to --max-prompt-tokens (9000 tokens) is longer than"
        in longest_prompt_beyond_context(settings)
    )
    assert longest_prompt_beyond_context(PrepareSettings(out="x")) is None
