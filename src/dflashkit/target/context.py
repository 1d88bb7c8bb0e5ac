"""The target's context (max_position_embeddings): a prompt and its reply that need more positions than
the target was trained on decode slowly into unreliable text, so every command that decodes says so first."""

from __future__ import annotations

from typing import Any


def context_of(config: Any) -> int | None:
    """The positions a target handles (its config's max_position_embeddings; None when it has none)."""
    n = getattr(config, "max_position_embeddings", None)
    return int(n) if n else None


def beyond_context(
    prompt_tokens: int, new_tokens: int, context: int | None, what: str = "the prompt"
) -> str | None:
    """One warning line when ``prompt_tokens + new_tokens`` pass ``context``; None when they fit."""
    if context is None or prompt_tokens + new_tokens <= context:
        return None
    longer = "is longer than" if prompt_tokens > context else f"with {new_tokens} new tokens passes"
    return (
        f"warning: {what} ({prompt_tokens} tokens) {longer} the target's context of {context} positions "
        "(max_position_embeddings): what it decodes past that is unreliable and slow; shorten it or lower "
        "the new tokens"
    )
