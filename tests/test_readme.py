"""The README is the product's front page: short, and every `dflashkit ...` command in it runs as written. Each
command of its code blocks parses with the real parser (options and section.key=value overrides, checked
against its config); the dry run of the 8B config runs on the CPU with a small random Qwen3 target. The map
of docs/architecture.md names only file:function pairs that exist."""

import re
import shlex
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands(text: str) -> list[str]:
    """The `dflashkit ...` lines of the README's code blocks, continuation lines joined, comments dropped."""
    commands, block, pending = [], False, ""
    for line in text.splitlines():
        if line.startswith("```"):
            block = not block
            continue
        if not block:
            continue
        line = pending + line.split(" #", 1)[0].strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1].rstrip() + " "
            continue
        if line.startswith("dflashkit "):
            commands.append(line)
    return commands


def parse(command: str):
    """The command through `dflashkit.cli.build_parser` as `dflashkit.cli.main` reads it: every word an option
    took, or a section.key=value override of a command that takes them."""
    from dflashkit.cli import build_parser

    args, extra = build_parser().parse_known_args(shlex.split(command)[1:])
    assert not extra or (
        hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra)
    ), f"{command}: the parser takes no {extra}"
    args.overrides = list(getattr(args, "overrides", None) or []) + extra
    return args


def test_the_readme_is_short_and_starts_with_the_two_commands():
    text = README.read_text()
    assert len(text.splitlines()) <= 220
    first = "\n".join(text.splitlines()[:8])
    assert "make demo" in first and "make test" in first


def test_the_readme_commands_parse_with_the_real_parser():
    from dflashkit.config import load_config

    commands = readme_commands(README.read_text())
    assert len(commands) >= 12, commands  # the demo, your own target, the fan-out, the table's command
    for command in commands:
        args = parse(command)
        config = getattr(args, "config", None)
        if config:  # a ready config: its file exists and the overrides name real keys
            assert (ROOT / config).is_file(), f"{command}: no {config}"
            load_config(ROOT / config, args.overrides)


def test_an_unknown_option_or_key_in_a_readme_command_would_fail():
    from dflashkit.config import load_config
    from dflashkit.errors import DflashkitError

    with pytest.raises(AssertionError):
        parse("dflashkit train -c configs/embedded.yaml --dry-rnu")
    args = parse("dflashkit train -c configs/embedded.yaml train.lrr=1e-3")
    with pytest.raises(DflashkitError):
        load_config(ROOT / args.config, args.overrides)
    assert readme_commands("```bash\ndflashkit train -c a.yaml \\\n  --dry-run  # checks\n```") == [
        "dflashkit train -c a.yaml --dry-run"
    ]


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory, tiny_dataset):
    """A random Qwen3 target of the 8B's architecture and depth (36 layers: the recipe's target layers 1..33
    exist; Qwen3's vocabulary: its mask id 151669 is a row) at a tiny width, with the embedded tokenizer; and
    the suite's small dataset, whose token ids are that tokenizer's, recorded as prepared by it (generating
    with a random 36-layer target on the CPU takes a minute and checks nothing more here)."""
    import json

    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    from dflashkit.data.regenerate import load_tokenizer
    from dflashkit.target.hf import identity_of_folder

    folder = tmp_path_factory.mktemp("qwen3") / "Qwen3-8B"
    config = Qwen3Config(
        vocab_size=151936,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=36,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    load_tokenizer("embedded").save_pretrained(folder)
    data = folder.parent / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["target"] = identity_of_folder(folder)
    (data / "manifest.json").write_text(json.dumps(manifest))
    return folder, data


def test_the_readme_dry_run_of_the_8b_config_checks_out_on_the_cpu(tiny_qwen3, tmp_path, monkeypatch, capsys):
    """The README's `train -c configs/qwen3-8b.yaml --dry-run`, as written, on a random Qwen3 target in the
    config's own target folder and a dataset in its own data folder (both relative to the directory it runs
    in, as the README says): every check of the run passes on the CPU."""
    from dflashkit.cli import main

    folder, data = tiny_qwen3
    command = next(c for c in readme_commands(README.read_text()) if "qwen3-8b.yaml --dry-run" in c)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(data, tmp_path / "runs" / "qwen3-8b" / "data")
    words = shlex.split(command)[1:] + [f"target.path={folder}"]
    assert main(words) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert "everything checks out" in out and "Qwen3ForCausalLM" in out and "block 16" in out
    assert not (tmp_path / "runs" / "qwen3-8b" / "checkpoints").exists()  # a dry run trains nothing


def test_the_architecture_map_names_functions_that_exist():
    text = (ROOT / "docs" / "architecture.md").read_text()
    entries = re.findall(r"`([a-z_/]+\.py):([A-Za-z_]+)`", text)
    assert len(entries) >= 25
    missing = [
        f"{path}:{name}"
        for path, name in entries
        if not re.search(
            rf"^(def|class) {name}\b", (ROOT / "src" / "dflashkit" / path).read_text(), re.MULTILINE
        )
    ]
    assert not missing, f"docs/architecture.md names {missing}: move the map to where they are now"


def test_the_readme_dry_run_of_the_fanout_sweep_checks_out(tiny_dataset, tmp_path, monkeypatch, capsys):
    """The README's fan-out dry run, as written, after the demo (its dataset in runs/embedded/data)."""
    from dflashkit.cli import main

    command = next(c for c in readme_commands(README.read_text()) if "fanout.yaml --dry-run" in c)
    monkeypatch.chdir(tmp_path)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    shutil.copytree(tiny_dataset, tmp_path / "runs" / "embedded" / "data")
    assert main(shlex.split(command)[1:]) == 0, capsys.readouterr().err
    assert not (tmp_path / "runs" / "fanout").exists()  # a dry run trains and writes nothing
