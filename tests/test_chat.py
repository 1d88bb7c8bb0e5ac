"""Chat rendering: the loss mask covers exactly the assistant's tokens (and the EOS closing each turn),
for single and multi-turn conversations, with and without the template's default system prompt; the
template identity changes with the template and with enable_thinking."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from transformers import AutoTokenizer

from dflashkit.data.chat import (
    check_template_identity,
    encode_chat,
    encode_text,
    generation_prompt_ids,
    template_identity,
)
from dflashkit.errors import ConfigError
from dflashkit.target.embedded import embedded_dir

DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM"


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(embedded_dir())


def with_template(tok: Any, template: str) -> Any:
    t = copy.deepcopy(tok)
    t.chat_template = template
    return t


def masked_text(tok: Any, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if m], skip_special_tokens=False)


def unmasked_text(tok: Any, ids: list[int], mask: list[int]) -> str:
    return tok.decode([i for i, m in zip(ids, mask, strict=True) if not m], skip_special_tokens=False)


SINGLE = [
    {"role": "user", "content": "Give me three tips for staying healthy."},
    {"role": "assistant", "content": "1. Drink water.\n2. Sleep well.\n3. Walk daily."},
]
MULTI = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
    {"role": "assistant", "content": " Rome, of course!"},
]


def test_single_turn_with_the_default_system_prompt(tok: Any) -> None:
    enc = encode_chat(tok, SINGLE, enable_thinking=False)
    assert DEFAULT_SYSTEM in tok.decode(enc.input_ids)  # the template added its default system prompt
    assert masked_text(tok, enc.input_ids, enc.loss_mask) == SINGLE[1]["content"] + tok.eos_token
    assert SINGLE[1]["content"] not in unmasked_text(tok, enc.input_ids, enc.loss_mask)
    # Exactly the reply's own tokens and one EOS, at the end (the template's newline after it is not).
    n = len(encode_text(tok, SINGLE[1]["content"])) + 1
    assert sum(enc.loss_mask) == n and enc.loss_mask[-n - 1 : -1] == [1] * n and enc.loss_mask[-1] == 0
    assert (enc.assistant_turns, enc.masked_turns) == (1, 1)
    # The ids are the template's own tokenization.
    assert enc.input_ids == tok.apply_chat_template(SINGLE, tokenize=True)["input_ids"]


def test_multi_turn_with_own_system_prompt(tok: Any) -> None:
    enc = encode_chat(tok, MULTI, enable_thinking=False)
    text = tok.decode(enc.input_ids)
    assert DEFAULT_SYSTEM not in text and "You answer in one line." in text
    assert (
        masked_text(tok, enc.input_ids, enc.loss_mask)
        == "Paris." + tok.eos_token + " Rome, of course!" + tok.eos_token
    )
    assert (enc.assistant_turns, enc.masked_turns) == (2, 2)
    for m in MULTI:
        if m["role"] != "assistant":
            assert m["content"] in unmasked_text(tok, enc.input_ids, enc.loss_mask)


def test_unfinished_reply_leaves_its_eos_unsupervised(tok: Any) -> None:
    enc = encode_chat(tok, MULTI, enable_thinking=False, finished=[True, False])
    assert masked_text(tok, enc.input_ids, enc.loss_mask) == "Paris." + tok.eos_token + " Rome, of course!"
    with pytest.raises(ValueError, match="finished has 1 entries for 2"):
        encode_chat(tok, MULTI, enable_thinking=False, finished=[True])


def test_generation_prompt_is_what_the_template_renders(tok: Any) -> None:
    ids = generation_prompt_ids(tok, SINGLE[:1], enable_thinking=False)
    assert ids == tok.apply_chat_template(SINGLE[:1], add_generation_prompt=True, tokenize=True)["input_ids"]
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    # The full conversation continues the generation prompt token for token.
    assert encode_chat(tok, SINGLE, enable_thinking=False).input_ids[: len(ids)] == ids


# ChatML with {% generation %} markers around what the assistant writes, so transformers can compute
# its own assistant mask: an independent reference for ours.
CHATML_GENERATION = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def test_mask_matches_transformers_assistant_mask(tok: Any) -> None:
    t = with_template(tok, CHATML_GENERATION)
    for messages in (SINGLE, MULTI):
        ref = t.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        enc = encode_chat(t, messages, enable_thinking=False)
        assert enc.input_ids == ref["input_ids"]
        assert enc.loss_mask == ref["assistant_masks"]


def test_template_that_rewrites_history_leaves_old_turns_unsupervised(tok: Any) -> None:
    # Earlier assistant turns are rendered shortened (as some templates drop old reasoning), so they no
    # longer appear verbatim: only the last turn can be supervised.
    rewriting = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' and not loop.last %}{{ message['content'][:2] }}"
        "{% else %}{{ message['content'] }}{% endif %}{{ '<|im_end|>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    enc = encode_chat(with_template(tok, rewriting), MULTI, enable_thinking=False)
    assert (enc.assistant_turns, enc.masked_turns) == (2, 1)
    assert masked_text(tok, enc.input_ids, enc.loss_mask) == " Rome, of course!" + tok.eos_token


THINKING = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
    "{% if not enable_thinking %}{{ '<think>\n\n</think>\n\n' }}{% endif %}{% endif %}"
)


def test_enable_thinking_reaches_the_template(tok: Any) -> None:
    t = with_template(tok, THINKING)
    off = tok.decode(generation_prompt_ids(t, SINGLE[:1], enable_thinking=False))
    on = tok.decode(generation_prompt_ids(t, SINGLE[:1], enable_thinking=True))
    assert off.endswith("<think>\n\n</think>\n\n") and on.endswith("assistant\n")


def test_template_identity_changes_with_thinking_and_template(tok: Any) -> None:
    base = template_identity(tok, enable_thinking=False)
    assert base == template_identity(tok, enable_thinking=False)
    assert set(base) == {"chat_template_sha256", "enable_thinking", "probe_sha256", "eos_token"}
    thinking = template_identity(tok, enable_thinking=True)
    assert thinking["enable_thinking"] and thinking != base
    other = template_identity(
        with_template(tok, tok.chat_template.replace("SmolLM", "Bob")), enable_thinking=False
    )
    assert other["chat_template_sha256"] != base["chat_template_sha256"]
    assert other["probe_sha256"] != base["probe_sha256"]
    # For a template that reads enable_thinking, the rendered probe differs too.
    t = with_template(tok, THINKING)
    assert template_identity(t, True)["probe_sha256"] != template_identity(t, False)["probe_sha256"]


def test_check_template_identity(tok: Any) -> None:
    base = template_identity(tok, enable_thinking=False)
    check_template_identity(base, dict(base), "dataset vs training")
    with pytest.raises(ConfigError, match=r"dataset vs training\): enable_thinking: False vs True") as e:
        check_template_identity(base, template_identity(tok, enable_thinking=True), "dataset vs training")
    assert "chat_template_sha256" not in str(e.value)


def test_no_chat_template_is_a_clear_error(tok: Any) -> None:
    t = copy.deepcopy(tok)
    t.chat_template = None
    with pytest.raises(ConfigError, match="has no chat template"):
        encode_chat(t, SINGLE, enable_thinking=False)
    with pytest.raises(ConfigError, match="has no chat template"):
        template_identity(t, enable_thinking=False)
