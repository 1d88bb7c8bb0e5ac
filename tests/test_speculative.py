"""The draft/verify loop: greedy losslessness, statistical losslessness of both sampling rules and of tree
rounds, cache cropping, EOS inside an accepted block, and prompts longer than a sliding drafter's window."""

import math

import pytest
import torch

from dflashkit.infer.sampling import probabilities
from dflashkit.infer.speculative import Sampling, Stopper, autoregressive_generate, speculative_generate
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel


def make_tiny_target(folder, vocab_size=12, seed=0, scale=1.0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with (
        torch.no_grad()
    ):  # sharper distributions than the default init, so tokens repeat and blocks get accepted
        model.lm_head.weight.mul_(scale)
    model.save_pretrained(folder)
    return TargetModel.load(folder)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    target = make_tiny_target(tmp_path_factory.mktemp("tiny"), scale=8.0)
    cfg = config_for_target(
        target.config, num_layers=1, block_size=4, mask_token_id=11, target_layer_ids=[0, 2]
    )
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).eval()
    return target, drafter


class OracleDrafter(torch.nn.Module):
    """A 'drafter' whose drafts are what the target would generate greedily (so every block is fully
    accepted): proves that the loop commits whole blocks and crops correctly."""

    def __init__(self, target, config, continuation):
        super().__init__()
        self.config = config
        self.target = target
        self.continuation = continuation  # the full greedy sequence (prompt + new tokens)

    def new_cache(self):
        return None

    def draft(self, new_feats, new_pos, block_embeds, block_positions, cache, backend):
        B = self.config.block_size
        start = int(block_positions[0, 0])
        want = self.continuation[start + 1 : start + B]
        want = want + [0] * (B - 1 - len(want))
        # hidden states whose lm_head argmax is `want`: use the lm_head rows themselves (scaled up)
        w = self.target.lm_head_weight()
        h = torch.zeros(1, B, w.shape[1])
        h[0, 1:] = w[want] * 50
        return h


def test_greedy_is_lossless_with_an_untrained_drafter(tiny):
    target, drafter = tiny
    for seed in range(4):
        prompt = torch.randint(0, 10, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ar = autoregressive_generate(target, prompt, 30)
        spec = speculative_generate(target, drafter, prompt, 30)
        assert spec.tokens == ar.tokens
        assert all(1 <= t <= 4 for t in spec.accept_lengths)


def test_full_acceptance_commits_whole_blocks_and_crops(tiny):
    target, drafter = tiny
    prompt = [1, 2, 3, 4, 5]
    ar = autoregressive_generate(target, prompt, 25)
    oracle = OracleDrafter(target, drafter.config, prompt + ar.tokens)
    spec = speculative_generate(target, oracle, prompt, 25)
    assert spec.tokens == ar.tokens
    # every round but the last accepts the whole block: B-1 drafts + the bonus token
    assert spec.accept_lengths[:-1] == [4] * (len(spec.accept_lengths) - 1)
    assert len(spec.accept_lengths) == math.ceil((25 - 1) / 4)


def test_eos_inside_an_accepted_block_stops_there(tiny):
    target, drafter = tiny
    prompt = [1, 2, 3, 4, 5]
    ar = autoregressive_generate(target, prompt, 25)
    eos = ar.tokens[6]  # a token the target produces mid-block
    first = ar.tokens.index(eos)
    oracle = OracleDrafter(target, drafter.config, prompt + ar.tokens)
    spec = speculative_generate(target, oracle, prompt, 25, stopper=Stopper([eos]))
    assert spec.tokens == ar.tokens[: first + 1] and spec.stopped == "eos"
    ar_stop = autoregressive_generate(target, prompt, 25, stopper=Stopper([eos]))
    assert ar_stop.tokens == spec.tokens


@pytest.mark.parametrize("budget", [1, 4, 16, 40])
def test_greedy_tree_rounds_are_lossless(tiny, budget):
    target, drafter = tiny
    for seed in range(4):
        prompt = torch.randint(0, 10, (7 + seed,), generator=torch.Generator().manual_seed(seed)).tolist()
        ar = autoregressive_generate(target, prompt, 30)
        spec = speculative_generate(target, drafter, prompt, 30, tree_budget=budget)
        assert spec.tokens == ar.tokens
        assert all(1 <= t <= 4 for t in spec.accept_lengths)


def test_full_acceptance_of_a_tree_commits_whole_blocks(tiny):
    target, drafter = tiny
    prompt = [1, 2, 3, 4, 5]
    ar = autoregressive_generate(target, prompt, 25)
    oracle = OracleDrafter(target, drafter.config, prompt + ar.tokens)
    spec = speculative_generate(target, oracle, prompt, 25, tree_budget=6)
    assert spec.tokens == ar.tokens
    assert spec.accept_lengths[:-1] == [4] * (len(spec.accept_lengths) - 1)


def test_prompt_longer_than_a_sliding_window(tiny, tmp_path):
    target, drafter = tiny
    cfg = drafter.config.updated(sliding_window=6, layer_types=["sliding_attention"])
    torch.manual_seed(2)
    sliding = DFlashDrafter(cfg).eval()
    prompt = list(range(10)) * 3  # 30 tokens, window 6
    ar = autoregressive_generate(target, prompt, 20)
    spec = speculative_generate(target, sliding, prompt, 20)
    assert spec.tokens == ar.tokens


def test_top_p_keeps_the_smallest_nucleus():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.8))
    assert torch.allclose(p, torch.tensor([0.5, 0.3, 0.0, 0.0]) / 0.8)
    p = probabilities(logits, Sampling(temperature=1.0, top_p=0.81))
    assert p[2] > 0 and p[3] == 0


def _exact_two_token_distribution(target, prompt, s):
    """P(t1, t2) of the target alone, enumerated exactly."""
    logits = target.model(torch.tensor([prompt])).logits[0, -1]
    p1 = probabilities(logits, s)
    V = p1.shape[0]
    joint = torch.zeros(V, V, dtype=torch.float64)
    for t1 in range(V):
        if p1[t1] == 0:
            continue
        l2 = target.model(torch.tensor([prompt + [t1]])).logits[0, -1]
        joint[t1] = p1[t1].double() * probabilities(l2, s).double()
    return joint


def _two_token_p_value(target, drafter, rule, tree_budget=None, n=1500):
    """p-value of the chi-square goodness of fit of the first two generated tokens, over n seeds, against
    the target's own exactly enumerated distribution."""
    prompt = [3, 1, 4, 1, 5]
    s = Sampling(temperature=1.0, top_p=0.95, rule=rule)
    with torch.no_grad():
        joint = _exact_two_token_distribution(target, prompt, s)
    counts = torch.zeros_like(joint)
    accepted = 0
    for seed in range(n):
        s.seed = seed
        g = speculative_generate(target, drafter, prompt, 2, s, tree_budget=tree_budget)
        counts[g.tokens[0], g.tokens[1]] += 1
        accepted += sum(t - 1 for t in g.accept_lengths)
    assert accepted > 0, "the test must exercise accepted drafts"
    expected = joint * n
    keep = expected >= 5  # pool the rare cells
    rare_obs, rare_exp = counts[~keep].sum(), expected[~keep].sum()
    obs = torch.cat([counts[keep], rare_obs[None]])
    exp = torch.cat([expected[keep], rare_exp[None]])
    assert float(counts[joint == 0].sum()) == 0, "a token outside the nucleus was produced"
    chi2 = float(((obs - exp) ** 2 / exp.clamp_min(1e-9)).sum())
    dof = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0), torch.tensor(chi2 / 2.0)))


@pytest.mark.parametrize("rule", ["exact", "rejection"])
def test_sampling_is_lossless_statistically(tiny, rule):
    """The first two generated tokens, over many seeds, follow the target's own distribution
    (chi-square goodness of fit against the exactly enumerated distribution)."""
    target, drafter = tiny
    p_value = _two_token_p_value(target, drafter, rule)
    assert p_value > 1e-3, f"{rule}: p={p_value:.2e}"


def test_tree_sampling_is_lossless_statistically(tiny):
    """Tree rounds at T > 0 (the target samples at every node, the walk follows its samples): the first two
    tokens follow the target's own distribution."""
    target, drafter = tiny
    p_value = _two_token_p_value(target, drafter, "exact", tree_budget=5)
    assert p_value > 1e-3, f"tree: p={p_value:.2e}"


def test_the_tree_test_catches_a_walk_that_is_not_exact(tiny, monkeypatch):
    """The same test fails a walk that takes the drafter's best child whenever the target's sample is not
    among the children: the harness can see a wrong tree rule."""
    from dflashkit.infer import tree
    from dflashkit.infer.engine import ReferenceEngine

    def biased(self, t, choices):
        path, committed = tree.accepted_path(t, choices)
        if len(path) == 1 and t.children[0]:
            best = min(t.children[0].values())  # node 1: the drafter's best first token
            return [0, best], [t.tokens[best], committed[0]]
        return path, committed

    monkeypatch.setattr(ReferenceEngine, "walk", biased)  # the engine the harness decodes on
    target, drafter = tiny
    assert _two_token_p_value(target, drafter, "exact", tree_budget=5) < 1e-6


def test_rejection_rule_accepts_more_than_exact_match(tiny):
    target, drafter = tiny
    prompt = [3, 1, 4, 1, 5]
    means = {}
    for rule in ("exact", "rejection"):
        taus = []
        for seed in range(150):
            g = speculative_generate(
                target, drafter, prompt, 12, Sampling(temperature=1.0, rule=rule, seed=seed)
            )
            taus += g.accept_lengths
        means[rule] = sum(taus) / len(taus)
    assert means["rejection"] > means["exact"], means
