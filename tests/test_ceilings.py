"""The per-slot ceilings at T > 0 (`dflashkit.infer.ceilings`): its figures against hand and brute-force
computations, its record in a bench folder, and the auto choices that read it."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from dflashkit.infer import ceilings
from dflashkit.infer.bench import SETS_DIR, drafter_identity
from dflashkit.infer.engine import AUTO_TREE_BUDGET, resolve_tree_budget
from dflashkit.infer.sampling import Sampling
from dflashkit.infer.tree import DraftTree, accepted_path


def test_merged_branches_share_their_prefixes():
    tree, paths = ceilings.merge_branches(9, [[1, 2, 3], [1, 4, 3], [1, 2, 3], [5]])
    assert tree.tokens == [9, 1, 2, 3, 4, 3, 5]
    assert tree.parents == [-1, 0, 1, 2, 1, 4, 0]
    assert paths == [[0, 1, 2, 3], [0, 1, 4, 5], [0, 1, 2, 3], [0, 6]]


def test_round_figures_by_hand():
    """Two slots over three tokens; the argmax chain and the marginal chain part after the root."""
    q = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.5, 0.3]])
    p = torch.tensor(
        [
            [0.5, 0.2, 0.3],  # the root
            [0.1, 0.7, 0.2],  # after token 0 (the argmax chain's first node)
            [0.3, 0.3, 0.4],  # after token 2 (the marginal chain's)
        ]
    )
    marginal = torch.tensor([2, 0])
    fig = ceilings.round_figures(q, p, [0, 1, 9], marginal, [0, 2, 9])
    assert torch.allclose(fig["argmax_accept"], torch.tensor([0.5, 0.7]))
    assert torch.allclose(fig["argmax_reach"], torch.tensor([1.0, 0.5]))
    assert torch.allclose(fig["max_p"], torch.tensor([0.5, 0.7]))
    # slot 1: q's top tokens 0, 1, 2 under the root; slot 2: 1, 2, 0 after token 0
    assert torch.allclose(fig["top_mass"][:, :3], torch.tensor([[0.5, 0.7, 1.0], [0.7, 0.9, 1.0]]))
    # beta_k = sum min(p, q) where the marginal chain stands; it reaches slot 2 with min(1, p(2) / q(2)) = 1
    assert torch.allclose(fig["marginal_accept"], torch.tensor([0.5 + 0.2 + 0.1, 0.2 + 0.3 + 0.3]))
    assert torch.allclose(fig["marginal_reach"], torch.tensor([1.0, 1.0]))


def test_a_trees_expected_tokens_are_those_of_its_walk():
    """tree_tokens (1 + the product of p along each node's branch) equals the mean tokens a round commits
    when the target's choice at every node is enumerated with its probability and the real walk follows it."""
    tree = DraftTree.of([7, 0, 1, 2, 0], [-1, 0, 0, 1, 3])
    p = torch.tensor([[0.5, 0.3, 0.2], [0.1, 0.2, 0.7], [0.3, 0.3, 0.4], [0.6, 0.2, 0.2], [0.4, 0.4, 0.2]])
    node_of = {(0,): 1, (1,): 2, (0, 2): 3, (0, 2, 0): 4}
    expected = 0.0
    for choices in itertools.product(range(3), repeat=len(tree)):
        weight = float(torch.prod(p[torch.arange(len(tree)), torch.tensor(choices)]))
        path, committed = accepted_path(tree, list(choices))
        expected += weight * len(committed)
    assert ceilings.tree_tokens(tree, p, node_of) == pytest.approx(expected)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from dflashkit.model.config import config_for_target
    from dflashkit.model.drafter import DFlashDrafter
    from test_bench import _tiny_target

    target = _tiny_target(tmp_path_factory.mktemp("tiny-target"))
    cfg = config_for_target(
        target.config, num_layers=1, block_size=4, mask_token_id=11, target_layer_ids=[0, 2]
    )
    torch.manual_seed(1)
    return target, DFlashDrafter(cfg).eval()


def test_measured_ceilings_hold_together(tiny):
    target, drafter = tiny
    fig = ceilings.measure(target, drafter, [[3, 1, 4, 1], [2, 7, 1]], Sampling(1.0, seed=0), 10, budget=5)
    assert fig["rounds"] > 2 and fig["slots"] == 3 and fig["draft_sampling"] in ("marginal", "argmax")
    for k in range(3):
        masses = [fig["top_k_mass"][str(j)][k] for j in range(1, ceilings.TOP_K + 1)]
        assert masses == sorted(masses) and masses[-1] <= 1 + 1e-6
        # q's top token is the argmax: its mass is the argmax proposal's acceptance, no more than E[max p]
        assert masses[0] == pytest.approx(fig["argmax_acceptance"][k])
        assert fig["argmax_acceptance"][k] <= fig["max_p"][k] + 1e-6
        assert 0 <= fig["marginal_acceptance"][k] <= 1 + 1e-6
    tokens = fig["expected_tokens"]
    assert 1 <= tokens["argmax"] <= 4 and 1 <= tokens["marginal"] <= 4 and tokens["tree5"] >= 1
    assert 1 <= tokens["tree5_recursive"] <= 4
    assert fig["expected_tokens"]["argmax"] > 1.0, "the test must see accepted drafts"


def _record(folder: Path, drafter_dir: Path, tokens: dict[str, float], temperature: str = "1") -> None:
    sets = folder / SETS_DIR
    sets.mkdir(parents=True, exist_ok=True)
    fig = {"rounds": 10, "expected_tokens": tokens, "tree_budget": AUTO_TREE_BUDGET}
    result = {
        "settings": {"drafter_weights": drafter_identity(drafter_dir), "top_p": 1.0},
        "temperatures": {temperature: {"ceilings": fig}},
    }
    (sets / "mtbench.json").write_text(json.dumps(result))


def test_auto_proposal_and_trees_read_the_drafters_bench_record(tmp_path):
    drafter_dir = tmp_path / "run" / "best"
    drafter_dir.mkdir(parents=True)
    (drafter_dir / "model.safetensors").write_bytes(b"weights")
    proposal, why = ceilings.resolve_draft_sampling("auto", drafter_dir, 1.0, 1.0)
    assert proposal == ceilings.DEFAULT_PROPOSAL and why == ceilings.DEFAULT_WHY  # no record
    assert ceilings.resolve_draft_sampling("argmax", drafter_dir, 1.0, 1.0)[0] == "argmax"
    assert ceilings.sampled_trees_pay(None)[0] is False

    bench = tmp_path / "run" / "bench"
    _record(bench, drafter_dir, {"argmax": 2.0, "marginal": 1.5, "tree15": 2.05})
    proposal, why = ceilings.resolve_draft_sampling("auto", drafter_dir, 1.0, 1.0)
    assert proposal == "argmax" and "2.00 argmax, 1.50 marginal" in why
    assert ceilings.resolve_draft_sampling("auto", drafter_dir, 0.7, 1.0)[0] == "marginal"  # not measured
    assert ceilings.resolve_draft_sampling("auto", drafter_dir, 1.0, 0.9)[0] == "marginal"  # another top-p
    record = ceilings.recorded(drafter_dir, 1.0, 1.0)
    assert ceilings.sampled_trees_pay(record)[0] is False  # 2.05 < 2.0 * TREE_ROUND_COST

    _record(bench, drafter_dir, {"argmax": 1.6, "marginal": 1.8, "tree15": 2.4})
    record = ceilings.recorded(drafter_dir, 1.0, 1.0)
    assert record is not None and record["draft_sampling"] == "marginal"
    pays, why = ceilings.sampled_trees_pay(record)
    assert pays and "trees" in why
    assert resolve_tree_budget(None, "graphs", "triton", 16, 1.0, pays) == AUTO_TREE_BUDGET
    assert resolve_tree_budget(None, "graphs", "triton", 16, 1.0) == 0  # no measurement: the chain
    assert (
        resolve_tree_budget(None, "graphs", "torch", 16, 1.0, pays) == 0
    )  # a tree's round cost not measured there

    (drafter_dir / "model.safetensors").write_bytes(b"other weights")  # another drafter: not its record
    assert ceilings.recorded(drafter_dir, 1.0, 1.0) is None


def test_bench_records_the_ceilings_and_decodes_with_the_proposal_they_choose(tiny, tmp_path, monkeypatch):
    """Under --draft-sampling auto a set's pass at T > 0 measures the ceilings on its first prompts, decodes
    with the proposal they expect more tokens from, and records both; generate and eval read that record."""
    from dflashkit.infer import bench
    from dflashkit.infer import speculative as spec

    target, drafter = tiny
    drafter_dir = tmp_path / "run" / "best"
    drafter_dir.mkdir(parents=True)
    (drafter_dir / "model.safetensors").write_bytes(b"weights")
    used: list[str] = []
    real = spec.speculative_generate

    def spy(*args, **kwargs):
        used.append(args[4].draft_sampling)
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "speculative_generate", spy)
    dec = bench.Decoder(target, drafter, None, [], max_new_tokens=6, draft_sampling="auto", ceiling_prompts=1)
    convs = [bench.Conversation(key=f"c{i}", prefixes=((3, 1, 4, i),)) for i in range(2)]
    settings = {"drafter_weights": drafter_identity(drafter_dir), "top_p": 1.0}
    result = bench.run_set(dec, bench.BenchSet("toy", "toy", convs), [0.0, 1.0], settings=settings)
    fig = result["temperatures"]["1"]
    assert fig["ceilings"]["prompts"] == 1 and fig["draft_sampling"] == fig["ceilings"]["draft_sampling"]
    assert "ceilings" not in result["temperatures"]["0"]
    assert used[-2:] == [fig["draft_sampling"]] * 2  # both responses at T=1 (after the warm-up's)
    bench.write_set(tmp_path / "run" / "bench", result)
    proposal, why = ceilings.resolve_draft_sampling("auto", drafter_dir, 1.0, 1.0)
    assert proposal == fig["draft_sampling"] and "toy" in why


def test_bench_refuses_auto_without_ceilings(capsys):
    from dflashkit.cli import main

    assert main(["bench", "--drafter", "nowhere", "--ceilings", "0", "--temperatures", "0,1"]) == 2
    assert "--draft-sampling auto chooses by the ceilings" in capsys.readouterr().err
