"""Chat rendering with the target tokenizer's own chat template, and the loss mask on assistant tokens.

A drafter that trains on one rendering of a conversation and is served on another (a different system
prompt, thinking mode on instead of off) accepts far fewer tokens than its training metrics promise.
So there is exactly one way to turn messages into tokens here, `tokenizer.apply_chat_template` with
an explicit `enable_thinking`, and `template_identity` records which template and setting were used so
that training, evaluation and serving can compare (`check_template_identity`).

Finding the assistant tokens works for any template, including those without `{% generation %}`
markers: the conversation is rendered incrementally. For assistant message i, the rendering of the
messages before it with the generation prompt must be a prefix of the full rendering, and the message
text must follow verbatim; its characters are then supervised, plus the end-of-turn (EOS) token that
closes it. A template that rewrites earlier turns (some drop old reasoning blocks) leaves those turns
unsupervised, and `EncodedChat.masked_turns` says so.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from dflashkit.errors import ConfigError

Messages = Sequence[dict[str, str]]

# A short fixed conversation whose rendering is hashed into the template identity: it catches any
# template variable (such as enable_thinking) that changes what the template produces.
PROBE_MESSAGES: tuple[dict[str, str], ...] = (
    {"role": "user", "content": "Hello."},
    {"role": "assistant", "content": "Hi! How can I help?"},
    {"role": "user", "content": "Name a colour."},
)


def template_text(tokenizer: Any) -> str:
    """The chat template's source text (several named templates are joined in name order)."""
    ct = getattr(tokenizer, "chat_template", None)
    if not ct:
        raise ConfigError(
            f"the tokenizer of {getattr(tokenizer, 'name_or_path', 'the target')!r} has no chat template; "
            "use an instruct/chat model (dflashkit trains drafters on chat-formatted data)"
        )
    if isinstance(ct, dict):
        return json.dumps(ct, sort_keys=True)
    return str(ct)


def render_text(
    tokenizer: Any, messages: Messages, *, add_generation_prompt: bool, enable_thinking: bool
) -> str:
    """The conversation as text, exactly as the target's chat template writes it."""
    template_text(tokenizer)  # a clear error when there is none
    text = tokenizer.apply_chat_template(
        list(messages),
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        enable_thinking=enable_thinking,
    )
    return str(text)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of rendered text. The template writes every special token itself, so the tokenizer
    adds none (this is what serving engines do with a rendered chat prompt)."""
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def generation_prompt_ids(tokenizer: Any, messages: Messages, *, enable_thinking: bool) -> list[int]:
    """The token ids the target sees before it writes the next assistant reply."""
    return encode_text(
        tokenizer,
        render_text(tokenizer, messages, add_generation_prompt=True, enable_thinking=enable_thinking),
    )


@dataclass(frozen=True)
class AssistantSpan:
    """Character offsets, in the full rendering, of one assistant message: its text is
    [start, end); the template's end-of-turn text is [end, turn_end)."""

    start: int
    end: int
    turn_end: int


def assistant_spans(
    tokenizer: Any, messages: Messages, *, enable_thinking: bool, full_text: str | None = None
) -> list[AssistantSpan | None]:
    """One entry per assistant message, in order; None where the template does not render that
    message as a plain continuation of what came before it."""
    if full_text is None:
        full_text = render_text(
            tokenizer, messages, add_generation_prompt=False, enable_thinking=enable_thinking
        )
    spans: list[AssistantSpan | None] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = render_text(
            tokenizer, messages[:i], add_generation_prompt=True, enable_thinking=enable_thinking
        )
        after = render_text(
            tokenizer, messages[: i + 1], add_generation_prompt=False, enable_thinking=enable_thinking
        )
        start, end = len(before), len(before) + len(m["content"])
        if full_text.startswith(after) and after.startswith(before) and after[start:end] == m["content"]:
            spans.append(AssistantSpan(start, end, len(after)))
        else:
            spans.append(None)
    return spans


@dataclass(frozen=True)
class EncodedChat:
    """A tokenized conversation. loss_mask[k] is 1 where token k is written by the assistant."""

    input_ids: list[int]
    loss_mask: list[int]
    assistant_turns: int
    masked_turns: int  # assistant turns found in the rendering (the rest have no loss)


def encode_chat(
    tokenizer: Any,
    messages: Messages,
    *,
    enable_thinking: bool,
    finished: Sequence[bool] | None = None,
    eos_ids: Collection[int] | None = None,
) -> EncodedChat:
    """Tokenize a conversation with its loss mask: 1 on each assistant message's tokens and on the
    EOS token that ends the turn. `finished[j]` False (a reply cut at the token limit) leaves that
    turn's EOS unsupervised, because the target never produced it there."""
    full = render_text(tokenizer, messages, add_generation_prompt=False, enable_thinking=enable_thinking)
    enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    ids: list[int] = list(enc["input_ids"])
    offsets: list[tuple[int, int]] = [tuple(o) for o in enc["offset_mapping"]]
    eos = set(eos_ids) if eos_ids is not None else {tokenizer.eos_token_id}
    spans = assistant_spans(tokenizer, messages, enable_thinking=enable_thinking, full_text=full)
    if finished is None:
        finished = [True] * len(spans)
    if len(finished) != len(spans):
        raise ValueError(f"finished has {len(finished)} entries for {len(spans)} assistant messages")
    mask = [0] * len(ids)
    for span, done in zip(spans, finished, strict=True):
        if span is None:
            continue
        for k, (a, _b) in enumerate(offsets):
            if span.start <= a < span.end:
                mask[k] = 1
        if done:  # the template's closing tokens, up to and including the first EOS
            closing = [k for k, (a, _b) in enumerate(offsets) if span.end <= a < span.turn_end]
            eos_at = next((n for n, k in enumerate(closing) if ids[k] in eos), None)
            if eos_at is not None:
                for k in closing[: eos_at + 1]:
                    mask[k] = 1
    return EncodedChat(
        input_ids=ids,
        loss_mask=mask,
        assistant_turns=len(spans),
        masked_turns=sum(s is not None for s in spans),
    )


def template_identity(tokenizer: Any, enable_thinking: bool) -> dict[str, Any]:
    """What identifies the rendering: a hash of the template text, the thinking-mode setting, a hash
    of a fixed probe conversation rendered with that setting, and the EOS token. Stored in dataset
    manifests and checkpoints; compare two with `check_template_identity`."""
    text = template_text(tokenizer)
    probe = render_text(
        tokenizer, PROBE_MESSAGES, add_generation_prompt=True, enable_thinking=enable_thinking
    )
    return {
        "chat_template_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "enable_thinking": bool(enable_thinking),
        "probe_sha256": hashlib.sha256(probe.encode()).hexdigest(),
        "eos_token": tokenizer.eos_token,
    }


def check_template_identity(recorded: dict[str, Any], current: dict[str, Any], where: str) -> None:
    """Raise ConfigError when two template identities differ, naming each difference. `where` says
    what is being compared, e.g. "dataset runs/data vs this evaluation"."""
    keys = sorted(set(recorded) | set(current))
    diffs = [
        f"{k}: {recorded.get(k)!r} vs {current.get(k)!r}" for k in keys if recorded.get(k) != current.get(k)
    ]
    if diffs:
        raise ConfigError(
            f"chat template mismatch ({where}): {'; '.join(diffs)}. Use the same target tokenizer and "
            "the same --enable-thinking setting for data preparation, training, evaluation and serving"
        )
