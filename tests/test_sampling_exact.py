"""Exactness at T > 0, statistically: the decode loop's own rounds (`round._chain_round` with each
proposal, `round._tree_round` by sample-and-match) commit tokens distributed as the target's, and two
biased rules fail the same test (a tree walked by min(1, p/q) on the drafter's top-k marginals, as
warpfront/hipfire PR #483 does, and a chain that keeps every draft).

The target and drafter are tables on a vocabulary of 4 (`TableEngine`): the target's distribution of the next
token depends on the last two tokens, the drafter's per slot on the anchor alone (a marginal that cannot
know the tokens drafted before it), so the two differ and a wrong rule shows. The loop
(`speculative_generate`) runs on it unchanged; the first three tokens after the prefill's are counted over
many seeds and compared with the target's own joint distribution, enumerated exactly (chi-square, cells
expecting fewer than 5 pooled, as tests/test_bench.py's helper does)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from dflashkit.infer import round as rounds
from dflashkit.infer.round import Context, Round, Verified, separate_round
from dflashkit.infer.sampling import Sampling, probabilities, propose, race
from dflashkit.infer.speculative import speculative_generate
from dflashkit.infer.tree import DraftTree, accepted_path, build_tree
from test_bench import _chi_square_p

V, B = 4, 4  # vocabulary, block (3 drafted slots)
PROMPT = [1, 2]
TOKENS = 3  # tokens counted after the prefill's


def _table(seed: int, rows: int, scale: float) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * scale


TARGET = _table(0, V * V, 1.5)  # logits of the next token after (a, b): row a * V + b
DRAFTER = _table(1, V * (B - 1), 1.5)  # logits of slot k after anchor a: row a * (B - 1) + k


def target_logits(prefix: list[int]) -> torch.Tensor:
    return TARGET[prefix[-2] * V + prefix[-1]]


class TableEngine:
    """The decode engine's calls (`dflashkit.infer.engine`) over the tables: the cache is the list of kept
    tokens; a verified row is the target's logits after its node's branch; features are empty."""

    name = "table"

    def __init__(self) -> None:
        self.target = SimpleNamespace(device=torch.device("cpu"))
        self.drafter = SimpleNamespace(config=SimpleNamespace(block_size=B))
        self.cache: list[int] = []
        self.branches: list[list[int]] = []
        self.context: Context | None = None

    def reserve(self, prompt_len: int, max_new_tokens: int, width: int | None = None) -> None:
        pass

    def _context(self, n: int) -> Context:
        self.context = Context(torch.zeros(1, n, 1), len(self.cache) - n)
        return self.context

    def round(
        self, anchor: int, s: Sampling, gen: torch.Generator | None, tree_budget: int | None = None
    ) -> Round:
        return separate_round(self, anchor, s, gen, tree_budget)  # the loop's own separate calls

    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, Context]:
        self.cache = prompt[0].tolist()
        return target_logits(self.cache), self._context(len(self.cache))

    def draft(self, context: Context, anchor: int) -> torch.Tensor:
        return DRAFTER[anchor * (B - 1) : (anchor + 1) * (B - 1)]

    def _verified(self, branches: list[list[int]]) -> Verified:
        self.branches = branches
        logits = torch.stack([target_logits(self.cache + b) for b in branches])
        return Verified(logits, torch.zeros(1, len(branches), 1), len(self.cache))

    def verify(self, ids: torch.Tensor) -> Verified:
        block = ids[0].tolist()
        return self._verified([block[: i + 1] for i in range(len(block))])

    def build_tree(self, anchor: int, probs: torch.Tensor, budget: int) -> DraftTree:
        return build_tree(anchor, probs, budget)

    def verify_tree(self, tree: DraftTree) -> Verified:
        tokens, parents = tree.tokens, tree.parents
        branches: list[list[int]] = []
        for i, token in enumerate(tokens):
            branches.append((branches[parents[i]] if parents[i] >= 0 else []) + [token])
        return self._verified(branches)

    def walk(self, tree: DraftTree, choices: torch.Tensor) -> tuple[list[int], list[int]]:
        return accepted_path(tree, choices)

    def keep(self, verified: Verified, path: list[int]) -> Context:
        self.cache += self.branches[path[-1]]
        return self._context(len(path))


def target_joint(s: Sampling) -> torch.Tensor:
    """P(t1, t2, t3) of the target's own tokens after the prefill's t0 (summed over t0), exactly."""
    joint = torch.zeros((V,) * TOKENS, dtype=torch.float64)
    for seq in itertools.product(range(V), repeat=TOKENS + 1):
        p, prefix = 1.0, list(PROMPT)
        for t in seq:
            p *= float(probabilities(target_logits(prefix), s)[t])
            prefix.append(t)
        joint[seq[1:]] += p
    return joint


def decode_p_value(s: Sampling, trials: int, tree_budget: int | None = None) -> float:
    """p-value of the chi-square fit of the first three tokens after the prefill's, decoded over ``trials``
    seeds by the loop on `TableEngine`, to the target's joint; the rounds must accept drafts."""
    counts = torch.zeros((V,) * TOKENS, dtype=torch.float64)
    accepted = 0
    engine = TableEngine()
    for seed in range(trials):
        s.seed = seed
        g = speculative_generate(
            engine.target, engine.drafter, PROMPT, TOKENS + 1, s, engine=engine, tree_budget=tree_budget
        )
        counts[tuple(g.tokens[1 : TOKENS + 1])] += 1
        accepted += sum(t - 1 for t in g.accept_lengths)
    assert accepted > trials // 4, "the test must exercise accepted drafts"
    return _chi_square_p(counts.flatten(), target_joint(s).flatten() * trials)


TRIALS = 4_000


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one thread runs a trial ~2.5x faster than two contending ones."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize(
    ("rule", "draft_sampling", "top_p"),
    [
        ("rejection", "marginal", 1.0),
        ("rejection", "argmax", 1.0),
        ("rejection", "argmax", 0.8),  # the argmax outside the target's nucleus: p(x) = 0, always rejected
        ("exact", "argmax", 1.0),
    ],
)
def test_chain_rounds_keep_the_target_distribution_with_either_proposal(rule, draft_sampling, top_p):
    s = Sampling(temperature=1.0, top_p=top_p, rule=rule, draft_sampling=draft_sampling)
    assert decode_p_value(s, TRIALS) > 1e-3


@pytest.mark.parametrize("budget", [3, 6])
def test_tree_rounds_by_sample_and_match_keep_the_target_distribution(budget):
    """Trees of the drafter's top-k children (budget 6: two and three children below the root), the target
    drawing at every node under the ancestor mask and the walk following the child equal to its draw."""
    assert decode_p_value(Sampling(temperature=1.0), TRIALS, tree_budget=budget) > 1e-3


def _biased_tree_round(dec, anchor, draft_logits, budget, s, gen):
    """warpfront/hipfire PR #483's rule: the tree of the drafter's top-k marginals (no draft sampled), each
    child in turn accepted with probability min(1, p / q), the token after the walk drawn from max(0, p - q)
    (p when that is zero)."""
    q = probabilities(draft_logits, s)
    tree = dec.build_tree(anchor, q, budget)
    verified = dec.verify_tree(tree)
    p = probabilities(verified.logits, s)
    children, tokens, depths = tree.children, tree.tokens, tree.depths
    node, path = 0, [0]
    while True:
        for token, child in sorted(children[node].items(), key=lambda kv: kv[1]):
            q_child = q[depths[child] - 1]
            if float(torch.rand((), generator=gen)) < min(1.0, float(p[node, token] / q_child[token])):
                node = child
                path.append(child)
                break
        else:
            residual = (p[node] - q[depths[node]]).clamp(min=0) if depths[node] < len(q) else p[node]
            residual = residual if residual.sum() > 0 else p[node]
            bonus = int(race(residual, torch.empty(V).exponential_(generator=gen)))
            return verified, path, [tokens[i] for i in path[1:]] + [bonus]


def test_min_p_over_q_on_a_top_k_tree_fails_the_test(monkeypatch):
    monkeypatch.setattr(rounds, "_tree_round", _biased_tree_round)
    assert decode_p_value(Sampling(temperature=1.0), TRIALS, tree_budget=6) < 1e-6


def _keep_every_draft(dec, anchor, draft_logits, s, gen):
    """A chain that keeps every proposed draft, then the target's draw after them."""
    drafts, _ = propose(draft_logits, s, torch.empty(draft_logits.shape).exponential_(generator=gen))
    block = [anchor, *drafts.tolist()]
    verified = dec.verify(torch.tensor([block]))
    last = probabilities(verified.logits[-1], s)
    return verified, list(range(len(block))), block[1:] + [int(race(last, torch.empty(V).exponential_()))]


@pytest.mark.parametrize("draft_sampling", ["marginal", "argmax"])
def test_a_chain_that_keeps_every_draft_fails_the_test(monkeypatch, draft_sampling):
    monkeypatch.setattr(rounds, "_chain_round", _keep_every_draft)
    s = Sampling(temperature=1.0, rule="rejection", draft_sampling=draft_sampling)
    assert decode_p_value(s, TRIALS) < 1e-6
