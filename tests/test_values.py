"""One validator for the values every command takes (dflashkit.commands.values): each option of every
command that takes a temperature, a top-p, a count, a fraction or a size refuses a bad value while the
command line is read, in one line naming the option."""

import argparse

import pytest

from dflashkit.cli import build_parser, main
from dflashkit.commands import values

# (command line before the value, the option, a refused value, part of the one line)
REFUSED = [
    ("eval", "--temperature", "-2", "temperature >= 0"),
    ("generate", "--temperature", "-0.5", "temperature >= 0"),
    ("bench", "--temperatures", "0,-1", "temperatures >= 0"),
    ("prepare", "--temperature", "-2", "temperature >= 0"),
    ("eval", "--top-p", "0", "above 0 and at most 1"),
    ("bench", "--top-p", "1.5", "above 0 and at most 1"),
    ("prepare", "--top-p", "nan", "above 0 and at most 1"),
    ("eval", "--max-prompts", "0", "whole number >= 1"),
    ("eval", "--max-new-tokens", "0", "whole number >= 1"),
    ("generate", "--max-new-tokens", "0", "whole number >= 1"),
    ("bench", "--max-new-tokens", "-3", "whole number >= 1"),
    ("bench", "--max-prompts", "0", "whole number >= 1"),
    ("bench", "--lossless-prompts", "0", "whole number >= 1"),
    ("prepare", "--max-prompts", "-1", "whole number >= 1 (0: all)"),
    ("prepare", "--max-new-tokens", "0", "whole number >= 1"),
    ("prepare", "--batch-size", "0", "whole number >= 1"),
    ("prepare", "--val-fraction", "1.5", "fraction from 0 to 1"),
    ("prepare", "--server-timeout", "0", "number > 0"),
    ("prepare", "--server-retries", "-1", "whole number >= 0"),
    ("prepare", "--seed", "-1", "whole number >= 0"),
    ("capture", "--shard-mb", "0", "number > 0"),
    ("capture", "--batch-rows", "0", "whole number >= 1"),
    ("train", "--nproc", "0", "whole number >= 1"),
    ("init --out x", "--layers", "0", "whole number >= 1"),
    ("init --out x", "--block-size", "-4", "whole number >= 1"),
    ("eval", "--tree-budget", "-1", "node budget"),
]


@pytest.mark.parametrize(("command", "option", "value", "said"), REFUSED)
def test_a_bad_value_is_refused_while_the_command_line_is_read(command, option, value, said, capsys):
    with pytest.raises(SystemExit) as refused:
        main([*command.split(), option, value])
    assert refused.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        err[-1]
        == f"dflashkit {command.split()[0]}: error: argument {option}: takes " + err[-1].split("takes ", 1)[1]
    )
    assert said in err[-1] and repr(value) in err[-1]


def test_every_option_of_a_kind_uses_the_one_validator():
    """Every --temperature/--top-p/--max-new-tokens/--max-prompts of every command is typed by values."""
    kinds = {
        "--temperature": values.temperature,
        "--top-p": values.top_p,
        "--max-new-tokens": values.count,
        "--max-turns": values.count,
        "--seed": values.whole_number,
    }
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    seen = 0
    for name, parser in sub.choices.items():
        for action in parser._actions:
            for option in action.option_strings:
                if option in kinds:
                    assert action.type is kinds[option], f"dflashkit {name} {option}"
                    seen += 1
                if option == "--max-prompts":
                    assert action.type in (values.count, values.count_or_all), f"dflashkit {name} {option}"
    assert seen >= 12


def test_good_values_pass_through():
    assert values.temperature("0") == 0.0 and values.top_p("1") == 1.0 and values.count("3") == 3
    assert values.temperatures("0,1") == [0.0, 1.0] and values.tree_budget("auto") is None
    assert values.count_or_all("0") == 0 and values.fraction("0.05") == 0.05
