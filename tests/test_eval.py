"""`dflashkit eval`, the earlier name of `dflashkit bench` on one prompt set: it says so, maps its options to
bench's (refusing those with none in one line) and bench writes its outputs: the table, bench.json and the plot;
--check-lossless passes on a real drafter and names the position when outputs differ. And `dflashkit generate`."""

import json

import pytest

from dflashkit.cli import main


@pytest.fixture(scope="module")
def untrained_drafter(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter") / "d"
    assert (
        main(["init", "--target", "embedded", "--out", str(out), "--layers", "1", "--block-size", "4"]) == 0
    )
    return out


def _eval_args(drafter, data, out, *extra):
    return [
        "eval",
        "--drafter", str(drafter),
        "--data", str(data),
        "--prompts", "validation",
        "--max-prompts", "2",
        "--max-new-tokens", "10",
        "--dtype", "float32",
        "--out", str(out),
        *extra,
    ]  # fmt: skip


def _bench_json(out):
    return json.loads((out / "bench.json").read_text())


def test_eval_says_it_is_bench_now_and_writes_benchs_outputs(
    untrained_drafter, tiny_dataset, tmp_path, capsys
):
    assert main(_eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless")) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert out.startswith("dflashkit eval is now `dflashkit bench --sets heldout`")
    assert "`dflashkit bench --sets heldout --drafter" in out and "--temperatures 0" in out
    assert "dflashkit bench" in out and "fp32 lossless" in out and "held-out" in out
    result = _bench_json(tmp_path)
    assert list(result["sets"]) == ["heldout"] and result["settings"]["max_new_tokens"] == 10
    held = result["sets"]["heldout"]
    assert held["prompts"] == 2 and held["lossless_fp32"]["lossless"] is True
    fig = held["temperatures"]["0"]  # eval's one temperature: T=0 unless given
    assert list(held["temperatures"]) == ["0"] and fig["tau"] >= 1.0
    assert len(fig["per_position_acceptance"]) == 3
    assert sum(fig["accept_length_histogram"]) == fig["rounds"]
    assert fig["speedup"] is not None
    assert (tmp_path / "bench.png").stat().st_size > 1000 and (tmp_path / "bench.md").is_file()


def test_check_lossless_names_prompt_and_position(
    untrained_drafter, tiny_dataset, tmp_path, capsys, monkeypatch
):
    from dflashkit.infer import speculative

    real = speculative.speculative_generate

    def corrupted(*args, **kwargs):
        g = real(*args, **kwargs)
        if len(g.tokens) > 3:
            g.tokens[3] += 1  # a lossy decoder: the 4th new token differs
        return g

    monkeypatch.setattr(speculative, "speculative_generate", corrupted)
    assert main(_eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless")) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert err.startswith("dflashkit eval: error: fp32 lossless check failed on heldout")
    assert "prompt 0 turn 0" in err and "new token 3" in err and "Traceback" not in err


def test_a_bf16_eval_checks_losslessness_on_float32_copies(untrained_drafter, tiny_dataset, tmp_path, capsys):
    """--dtype bfloat16 --check-lossless: the greedy check runs on float32 copies, the figures in bf16."""
    args = _eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless", "--dtype", "bfloat16")
    assert main(args) == 0
    result = _bench_json(tmp_path)
    held = result["sets"]["heldout"]
    assert result["settings"]["dtype"] == "bfloat16" and held["lossless_fp32"]["lossless"] is True
    assert held["lossless_fp32"]["dtype"] == "float32" and held["lossless_fp32"]["responses"] >= 2
    fig = held["temperatures"]["0"]
    assert fig["round_cost_ar_tokens"] == pytest.approx(fig["tau"] / fig["speedup"])
    out = " ".join(capsys.readouterr().out.split())
    assert "float32 copies" in out


def test_eval_with_tree_rounds(untrained_drafter, tiny_dataset, tmp_path, capsys):
    args = _eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless", "--tree-budget", "6")
    assert main(args) == 0
    result = _bench_json(tmp_path)
    assert result["settings"]["tree_budget"] == 6 and result["sets"]["heldout"]["lossless_fp32"]["lossless"]
    assert "trees of 6 drafted nodes" in " ".join(capsys.readouterr().out.split())
    with pytest.raises(SystemExit) as refused:
        main([*args[:-1], "-1"])
    assert refused.value.code == 2
    assert "a node budget, a whole number >= 0" in capsys.readouterr().err


def test_eval_refuses_a_template_mismatch(untrained_drafter, tiny_dataset, tmp_path, capsys):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["template"]["chat_template_sha256"] = "0" * 64
    (data / "manifest.json").write_text(json.dumps(manifest))
    assert main(_eval_args(untrained_drafter, data, tmp_path / "out")) == 2
    assert "chat template mismatch" in capsys.readouterr().err


def test_eval_on_the_reference_engine_under_its_earlier_name(
    untrained_drafter, tiny_dataset, tmp_path, capsys
):
    """--engine dynamic (an earlier release's name, said in one line): the reference engine decodes both loops,
    losslessly."""
    args = _eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless", "--engine", "dynamic")
    assert main(args) == 0
    result = _bench_json(tmp_path)
    assert (
        result["settings"]["engine"] == "reference" and result["sets"]["heldout"]["lossless_fp32"]["lossless"]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "reference engine" in out and "--engine dynamic is now --engine reference" in out


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--no-baseline"], "--no-baseline has no bench equivalent"),
        (["--rule", "exact"], "--rule exact has no"),
    ],
)
def test_eval_refuses_an_option_bench_has_no_equivalent_of_in_one_line(
    untrained_drafter, tiny_dataset, tmp_path, capsys, option, said
):
    assert main([*_eval_args(untrained_drafter, tiny_dataset, tmp_path / "out"), *option]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("dflashkit eval: error: ") and said in err[0]
    assert not (tmp_path / "out").exists()


def test_eval_keeps_the_config_eval_defaults_in_the_bench_command():
    from dflashkit.cli import build_parser
    from dflashkit.commands.infer import bench_words
    from dflashkit.config import load_config

    args, _ = build_parser().parse_known_args(
        ["eval", "-c", "configs/embedded.yaml", "--prompts", "validation", "--check-lossless"]
    )
    cfg = load_config("configs/embedded.yaml", []).eval
    words = " ".join(bench_words(args))
    assert words.startswith("bench --config configs/embedded.yaml --sets heldout")
    assert f"--max-prompts {cfg.max_prompts} --max-new-tokens {cfg.max_new_tokens}" in words
    assert f"--temperatures {cfg.temperature:g}" in words and words.endswith("--check-lossless")
    args.prompts = "my.jsonl"
    assert "--prompts my.jsonl" in " ".join(bench_words(args))


def test_generate_on_the_reference_engine_and_a_retired_one(untrained_drafter, capsys):
    """--engine reference and auto (the graphs engine, its layers said) decode the same text; a retired engine
    ends in one line naming what to use."""
    args = ["generate", "--drafter", str(untrained_drafter), "--dtype", "float32", "--max-new-tokens", "6"]
    assert main([*args, "--engine", "reference", "Hello"]) == 0
    reference = capsys.readouterr().out
    assert main([*args, "Hello"]) == 0
    auto = capsys.readouterr().out
    assert auto.splitlines()[1] == reference.splitlines()[0]  # the same text, after auto's layers line
    assert "layers: torch (--layers auto:" in auto.splitlines()[0]
    assert main([*args, "--engine", "static", "Hello"]) == 2
    assert "the static decode engine was retired" in capsys.readouterr().err
    assert "chains (--tree-budget auto)" in " ".join(auto.split())  # the rounds, said


def test_eval_keeps_earlier_sets_and_compares_like_with_like(
    untrained_drafter, tiny_dataset, tmp_path, capsys
):
    import shutil

    best = tmp_path / "run" / "best"
    shutil.copytree(untrained_drafter, best)
    trained = {
        "step": 1,
        "acceptance_length": 1.3,
        "served_acceptance_length": 1.2,
        "data_dir": str(tiny_dataset),
    }
    (best / "metrics.json").write_text(json.dumps(trained))
    out = tmp_path / "bench"
    mtbench = [a if a != "validation" else "mtbench" for a in _eval_args(best, tiny_dataset, out)]
    assert main([*mtbench, "--max-prompts", "1"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "train/serve agreement" not in text  # MT-Bench is not where training measured
    assert "training_metric" not in _bench_json(out)["sets"]["mtbench"]
    assert main(_eval_args(best, tiny_dataset, out)) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "train/serve agreement" in text and "decoded vs trained" in text
    result = _bench_json(out)
    assert list(result["sets"]) == ["mtbench", "heldout"]  # the earlier set is still there
    metric = result["sets"]["heldout"]["training_metric"]
    assert metric["comparable"] is True and metric["acceptance_length"] == 1.2
    assert result["sets"]["heldout"]["prompts"] == 2


def test_generate_hides_end_of_sequence_tokens_and_shows_a_legend(untrained_drafter, capsys):
    args = ["generate", "--drafter", str(untrained_drafter), "--dtype", "float32", "--max-new-tokens", "60"]
    assert main([*args, "Say hello."]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "stopped by eos" in out  # the reply ended with the end-of-sequence token...
    assert "<|im_end|>" not in out  # ...which is not printed
    assert "each round of speculative decoding is one span" in out and "green = the target accepted" in out


def test_the_training_metric_compares_on_another_dataset_holding_out_the_same_prompts(tiny_dataset, tmp_path):
    """A dataset written again with the same held-out prompts (e.g. one prepared with another sample seed beside
    the drafter's own dataset) compares, whatever its replies; other held-out prompts do not."""
    import shutil

    import torch

    from dflashkit.data.dataset import held_out_prompts_fingerprint, load_dataset, read_manifest, write_split
    from dflashkit.infer.bench import training_reference

    fingerprint = held_out_prompts_fingerprint(tiny_dataset)
    assert fingerprint is not None and held_out_prompts_fingerprint(tmp_path / "none") is None
    best = tmp_path / "best"
    best.mkdir()
    trained = {
        "step": 1,
        "served_acceptance_length": 1.2,
        "data_dir": "/gone",
        "held_out_prompts": fingerprint,
    }
    (best / "metrics.json").write_text(json.dumps(trained))

    def rewritten(name: str, change) -> str:
        folder = tmp_path / name
        shutil.copytree(tiny_dataset, folder)
        records = load_dataset(folder, "validation")
        ids, masks = change([r.input_ids.clone() for r in records]), [r.loss_mask for r in records]
        write_split(
            folder / read_manifest(folder)["splits"]["validation"]["file"],
            [r.id for r in records],
            ids,
            masks,
        )
        return str(folder)

    def new_replies(ids):  # every reply token another one: the target wrote other replies
        return [
            torch.where(r.loss_mask, (i + 1) % 100, i)
            for i, r in zip(ids, load_dataset(tiny_dataset, "validation"), strict=True)
        ]

    def new_prompt(ids):  # one prompt token another one
        ids[0][0] += 1
        return ids

    same, other = rewritten("same", new_replies), rewritten("other", new_prompt)
    assert held_out_prompts_fingerprint(same) == fingerprint
    assert training_reference(best, "validation", same).comparable
    assert not training_reference(best, "mtbench", same).comparable  # not the held-out split
    assert held_out_prompts_fingerprint(other) != fingerprint
    assert not training_reference(best, "validation", other).comparable
    del trained["held_out_prompts"]  # a drafter trained before the fingerprint: the folder alone
    (best / "metrics.json").write_text(json.dumps(trained))
    assert not training_reference(best, "validation", same).comparable
