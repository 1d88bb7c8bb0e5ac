"""The command line speaks to a new user: examples in --help, help text on every option, the config path
rule where the options are, and one clear line for words it does not understand."""

import argparse

import pytest

from dflashkit.cli import build_parser, main
from dflashkit.config import PATHS_RULE


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    (action,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


def test_help_shows_examples_and_the_path_rule(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    top = " ".join(capsys.readouterr().out.split())
    assert "examples" in top and "dflashkit train -c configs/embedded.yaml" in top
    assert " ".join(PATHS_RULE.split()) in top
    commands = subparsers()
    for name in ("train", "eval", "generate", "convert", "init"):
        text = " ".join(commands[name].format_help().split())
        assert "example" in text, name
    for name in ("train", "eval", "generate"):
        assert "resolve from the working directory" in " ".join(commands[name].format_help().split()), name


@pytest.mark.parametrize("command", ["eval", "generate"])
def test_every_eval_and_generate_option_has_help(command):
    for action in subparsers()[command]._actions:
        assert action.help, f"{command} {action.option_strings or action.dest} has no help text"


def test_a_bare_word_among_overrides_says_what_overrides_are(capsys):
    assert main(["train", "--dry-run", "train.lr=1e-3", "blocksize"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("dflashkit train: error:") and len(err.splitlines()) == 1
    assert "'blocksize' is not an option or an override" in err and "section.key=value" in err
    assert "usage:" not in err


def test_an_unknown_option_is_one_line_naming_the_command(capsys):
    assert main(["eval", "--nope"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "dflashkit eval: error: unknown option --nope; see dflashkit eval --help"
