"""`dflashkit eval`: table, JSON and plot; --check-lossless passes on a real drafter and names the first
prompt and position when outputs differ."""

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


def test_eval_writes_table_json_and_plot(untrained_drafter, tiny_dataset, tmp_path, capsys):
    assert main(_eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless")) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["prompts"] == 2 and report["lossless"] is True
    assert report["mean_acceptance_length"] >= 1.0
    assert len(report["per_position_acceptance"]) == 3
    assert sum(report["accept_length_histogram"]) == sum(len(r["accept_lengths"]) for r in report["results"])
    assert report["speedup"] is not None
    assert (tmp_path / "eval.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "mean acceptance length" in out and "lossless" in out


def test_check_lossless_names_prompt_and_position(
    untrained_drafter, tiny_dataset, tmp_path, capsys, monkeypatch
):
    import dflashkit.infer.evaluate as evaluate_module

    real = evaluate_module.speculative_generate

    def corrupted(*args, **kwargs):
        g = real(*args, **kwargs)
        g.tokens[3] += 1  # a lossy decoder: the 4th new token differs
        return g

    monkeypatch.setattr(evaluate_module, "speculative_generate", corrupted)
    assert main(_eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless")) == 2
    err = capsys.readouterr().err
    assert "prompt 0" in err and "new token 3" in err and "Traceback" not in err


def test_a_bf16_eval_checks_losslessness_on_float32_copies(untrained_drafter, tiny_dataset, tmp_path, capsys):
    """--dtype bfloat16 --check-lossless: the greedy check runs on float32 copies, the figures in bf16, and
    the table shows both (the main job's last step)."""
    args = _eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless", "--dtype", "bfloat16")
    assert main(args) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["dtype"] == "bfloat16" and report["lossless"] is True
    assert report["lossless_check"]["dtype"] == "float32" and report["lossless_check"]["prompts"] == 2
    assert report["round_cost_ar_tokens"] == pytest.approx(
        report["mean_acceptance_length"] / report["speedup"]
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "speedup (bfloat16)" in out and "on float32 copies" in out
    assert "chains (--tree-budget auto)" in out  # auto's rule on the CPU's engine: the chain, said


def test_eval_with_tree_rounds(untrained_drafter, tiny_dataset, tmp_path, capsys):
    args = _eval_args(untrained_drafter, tiny_dataset, tmp_path, "--check-lossless", "--tree-budget", "6")
    assert main(args) == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["tree_budget"] == 6 and report["lossless"] is True
    assert "trees of 6 drafted nodes" in capsys.readouterr().out
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
    report = json.loads((tmp_path / "eval.json").read_text())
    assert report["engine"] == "reference" and report["lossless"] is True
    out = " ".join(capsys.readouterr().out.split())
    assert "decode engine" in out and "--engine dynamic is now --engine reference" in out


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


def test_eval_keeps_earlier_evaluations_and_compares_like_with_like(
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
    out = tmp_path / "eval"
    mtbench = [a if a != "validation" else "mtbench" for a in _eval_args(best, tiny_dataset, out)]
    assert main([*mtbench, "--max-prompts", "1", "--no-baseline"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "served vs trained" not in text and "comparable" in text
    first = json.loads((out / "eval.json").read_text())
    assert first["training_metric"]["comparable"] is False
    assert main([*_eval_args(best, tiny_dataset, out), "--no-baseline"]) == 0
    assert "served vs trained" in " ".join(capsys.readouterr().out.split())
    second = json.loads((out / "eval.json").read_text())
    assert second["training_metric"]["comparable"] is True and second["prompts"] == 2
    kept = sorted(out.glob("eval-*.json"))
    assert [p.name.rsplit("-", 1)[-1] for p in kept] == ["mtbench.json", "validation.json"]
    assert json.loads(kept[0].read_text()) == first  # the earlier evaluation is still there
    assert len(list(out.glob("eval-*.png"))) == 2


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
    from dflashkit.infer.evaluate import training_reference

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
