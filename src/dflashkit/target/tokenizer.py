"""A target's tokenizer and chat template, read from its folder without transformers.

The serving commands (`eval`, `generate`, `bench`) need four things of a tokenizer: the chat template rendered
for a conversation, the rendered text's token ids (no special tokens added: the template writes them),
replies decoded back to text, and the EOS token. Loading transformers' tokenizer for them cost 3-4 s of a
command's start on a 2-core CPU (its import, then the tokenizer; 0.13 s for the `tokenizers` library alone),
more than the lazy target's whole load. `ChatTokenizer` reads `tokenizer.json` with the `tokenizers` library
(the same Rust tokenizer transformers' fast tokenizers wrap) and renders the chat template with Jinja in
the environment transformers renders it in: a sandbox with ``trim_blocks`` and ``lstrip_blocks``, loop
controls, the ``tojson`` filter without HTML escaping, ``raise_exception`` and ``strftime_now``, the named
special tokens as variables, and ``{% generation %}`` blocks rendered as their body.

`serving_tokenizer` takes it for a folder with a `tokenizer.json` and a chat template, and transformers'
AutoTokenizer otherwise (a folder with a slow tokenizer only). Held equal to transformers on every benchmark
prompt and reply (tests/test_tokenizer.py): the rendered text, its ids and the decoded replies.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from dflashkit.errors import ConfigError

# The named special tokens transformers passes a chat template (`special_tokens_map`), in its order.
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: its text, or an AddedToken's ``content``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def read_chat_template(folder: Path, config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The folder's chat template: ``chat_template.jinja`` (what transformers writes now), else the config's
    ``chat_template`` (a string, or named templates as a list of {name, template})."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template}
    return template if isinstance(template, str) else None


class ChatTokenizer:
    """A `tokenizers.Tokenizer` and a chat template: the part of transformers' tokenizer the serving
    commands use (`apply_chat_template`, call, `decode`, the EOS token), with the same results."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | dict[str, str] | None,
        special_tokens: Mapping[str, str],
        name_or_path: str,
    ):
        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.special_tokens_map = dict(special_tokens)
        self.name_or_path = name_or_path
        self.dflashkit_folder = name_or_path
        self.eos_token = self.special_tokens_map.get("eos_token")
        self.eos_token_id = tokenizer.token_to_id(self.eos_token) if self.eos_token else None

    @classmethod
    def from_folder(cls, folder: str | Path) -> ChatTokenizer | None:
        """The tokenizer of a transformers folder, or None when it has no ``tokenizer.json`` or no chat template
        (`serving_tokenizer` then takes transformers')."""
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            return None
        config_file = folder / "tokenizer_config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ConfigError(
                f"{config_file} is not JSON ({e}); copy the target's tokenizer files again"
            ) from None
        template = read_chat_template(folder, config)
        if template is None:
            return None
        from tokenizers import Tokenizer

        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as e:  # the Rust reader raises a plain Exception on a damaged file
            raise ConfigError(
                f"{folder / 'tokenizer.json'} cannot be read as a tokenizer ({e}); copy the target's tokenizer "
                "files again"
            ) from None
        special = {k: t for k in SPECIAL_TOKENS if (t := _token_text(config.get(k))) is not None}
        return cls(tokenizer, template, special, str(folder))

    @cached_property
    def _template(self) -> Any:
        template = self.chat_template
        if isinstance(template, dict):
            if "default" not in template:
                raise ValueError(
                    f"the tokenizer of {self.name_or_path} has named chat templates {sorted(template)} and none "
                    "is 'default'"
                )
            template = template["default"]
        return chat_environment().from_string(template)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = False,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """The conversation rendered by the chat template, as transformers renders it (the named special
        tokens and ``kwargs``, e.g. ``enable_thinking``, are the template's variables); its ids with
        ``tokenize``."""
        variables = {**self.special_tokens_map, **kwargs}
        text = self._template.render(
            messages=[dict(m) for m in messages],
            tools=None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
        return self.encode(text) if tokenize else text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))


def chat_environment() -> Any:
    """The Jinja environment chat templates are written for (see the module docstring)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        """``{% generation %} .. {% endgeneration %}`` (the assistant-mask markers): the body as it is."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: Any = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format: str) -> str:
        return datetime.now().strftime(format)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def serving_tokenizer(folder: str | Path) -> Any:
    """The target folder's tokenizer: a `ChatTokenizer` where the folder allows (tokenizer.json and a chat
    template), else transformers' AutoTokenizer."""
    tokenizer = ChatTokenizer.from_folder(folder)
    if tokenizer is not None:
        return tokenizer
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
