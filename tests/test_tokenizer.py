"""The serving commands' tokenizer without transformers (`target.tokenizer.ChatTokenizer`): held equal to
transformers' on every benchmark prompt (rendered text and ids, both thinking settings), on replies decoded
back, on the template identity, and on a template that uses what chat templates use (tojson, namespaces, loop
controls, generation markers, raise_exception)."""

import shutil

import pytest

from dflashkit.data.chat import generation_prompt_ids, template_identity
from dflashkit.errors import ConfigError, DataError
from dflashkit.infer.bench import load_set
from dflashkit.target.embedded import embedded_dir
from dflashkit.target.tokenizer import ChatTokenizer, serving_tokenizer

REPLY = 'Sure — here\'s a reply with ünïcödé, <tags>, "quotes", a tab\tand\nnew lines.  Two spaces; 3.14!'


@pytest.fixture(scope="module")
def both():
    from transformers import AutoTokenizer

    folder = embedded_dir()
    ours = serving_tokenizer(folder)
    assert isinstance(ours, ChatTokenizer)
    return ours, AutoTokenizer.from_pretrained(folder, local_files_only=True)


@pytest.mark.parametrize("name", ["mtbench", "gsm8k", "humaneval"])
def test_every_benchmark_prompt_renders_and_encodes_as_transformers_does(both, name):
    """MT-Bench always (scripts/setup.sh installs it); GSM8K and HumanEval where their packages are."""
    ours, theirs = both
    try:
        bset = load_set(name)
    except DataError as e:
        pytest.skip(str(e))
    assert len(bset.conversations) >= 80
    for conv in bset.conversations:
        for turn in range(conv.n_turns):
            messages = conv.messages(turn, [REPLY] * turn)
            for thinking in (False, True):
                kw = {"add_generation_prompt": True, "enable_thinking": thinking}
                assert ours.apply_chat_template(messages, **kw) == theirs.apply_chat_template(
                    messages, tokenize=False, **kw
                )
            assert generation_prompt_ids(ours, messages, enable_thinking=False) == generation_prompt_ids(
                theirs, messages, enable_thinking=False
            ), conv.key


def test_replies_decode_and_the_template_identity_is_the_same(both):
    ours, theirs = both
    texts = [
        REPLY,
        "def f(x):\n    return x ** 2  # 😀",
        "<|im_start|>user\nhi<|im_end|>\n",
        "  leading spaces",
    ]
    for text in texts:
        ids = ours.encode(text)
        assert ids == theirs(text, add_special_tokens=False)["input_ids"]
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(ids, skip_special_tokens=skip)
    assert ours.eos_token == theirs.eos_token and ours.eos_token_id == theirs.eos_token_id
    for thinking in (False, True):
        assert template_identity(ours, thinking) == template_identity(theirs, thinking)


TEMPLATE = """{%- set ns = namespace(n=0) -%}
{%- for message in messages -%}
  {%- if message['role'] not in ['system', 'user', 'assistant'] -%}
    {{ raise_exception('unknown role ' + message['role']) }}
  {%- endif -%}
  {%- if message['role'] == 'system' %}{% continue %}{% endif -%}
  {%- set ns.n = ns.n + 1 %}
{{ bos_token }}{{ message['role'] }} {{ ns.n }}: {{ message | tojson }}
  {% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{ bos_token }}assistant{% if enable_thinking is defined and enable_thinking %} <think>{% endif %}
{% endif %}"""


def test_a_template_with_what_chat_templates_use_renders_as_transformers_does(tmp_path):
    from transformers import AutoTokenizer

    folder = tmp_path / "tok"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(embedded_dir() / name, folder / name)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    ours, theirs = (
        ChatTokenizer.from_folder(folder),
        AutoTokenizer.from_pretrained(folder, local_files_only=True),
    )
    assert ours is not None
    messages = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": 'x < y & "z" — ü'},
        {"role": "assistant", "content": REPLY},
        {"role": "user", "content": "again"},
    ]
    for gen in (False, True):
        for kw in ({}, {"enable_thinking": True}):
            got = ours.apply_chat_template(messages, add_generation_prompt=gen, **kw)
            assert got == theirs.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen, **kw
            )
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "{}"}])


def test_a_folder_without_a_chat_template_takes_transformers_tokenizer(tmp_path):
    folder = tmp_path / "plain"
    folder.mkdir()
    shutil.copy(embedded_dir() / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(embedded_dir() / "tokenizer_config.json", folder / "tokenizer_config.json")
    assert ChatTokenizer.from_folder(folder) is None
    assert not isinstance(serving_tokenizer(folder), ChatTokenizer)


def test_damaged_tokenizer_files_end_in_one_clear_error(tmp_path):
    """A tokenizer_config.json that is not JSON, or a tokenizer.json the reader cannot read: one message that
    names the file, not a traceback from the JSON or Rust reader."""
    folder = tmp_path / "bad"
    folder.mkdir()
    shutil.copy(embedded_dir() / "tokenizer.json", folder / "tokenizer.json")
    shutil.copy(embedded_dir() / "chat_template.jinja", folder / "chat_template.jinja")
    (folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json is not JSON"):
        serving_tokenizer(folder)
    shutil.copy(embedded_dir() / "tokenizer_config.json", folder / "tokenizer_config.json")
    (folder / "tokenizer.json").write_text('{"version": "1.0", "model": 3}')
    with pytest.raises(ConfigError, match="tokenizer.json cannot be read as a tokenizer"):
        serving_tokenizer(folder)


def test_an_embedded_folder_whose_eos_another_transformers_named_is_mended(tmp_path, monkeypatch):
    """transformers 5.17's GGUF loader names <|im_start|> SmolLM2's EOS where 5.24 names <|im_end|>; a dataset
    made on one machine was then refused on the other (template mismatch). The converted folder is pinned to
    the model's own tokens, and a folder made before the pin is mended on its next use."""
    import json

    from transformers import AutoTokenizer

    from dflashkit.target import embedded

    folder = tmp_path / embedded.DIR_NAME
    folder.mkdir()
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
    ):
        shutil.copy(embedded_dir() / name, folder / name)
    (folder / "model.safetensors").write_bytes(b"")  # present: embedded_dir() treats the folder as made
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "eos_token": "<|im_start|>"}))
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": 1}))
    assert AutoTokenizer.from_pretrained(folder).eos_token == "<|im_start|>"  # the drift, as it was met
    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    assert embedded.embedded_dir() == folder
    tok = AutoTokenizer.from_pretrained(folder)
    assert (tok.eos_token, tok.eos_token_id, tok.bos_token_id) == ("<|im_end|>", 2, 1)
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert template_identity(tok, False) == template_identity(
        AutoTokenizer.from_pretrained(embedded_dir()), False
    )
