"""Decode engines: the reference engine's rounds (the scripted drafts every engine test compares against),
rows beyond the valid length of the drafter's fixed-shape cache are never read, a verified tree's accepted
path leaves the caches of a chain; the engine names (earlier releases' said or refused in one line) and
``--layers auto``'s recorded choice. The graphs engine against the reference: tests/test_graph_engine.py."""

import pytest
import torch

from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import ReferenceEngine, make_engine
from dflashkit.infer.round import separate_round
from dflashkit.infer.speculative import autoregressive_generate, speculative_generate
from dflashkit.infer.tree import DraftTree
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.embedded import MASK_TOKEN_ID
from dflashkit.target.hf import TargetModel

B = 4
LAYERS = [1, 15, 27]
POISON = 1e4  # what stale rows are filled with: were one ever read, outputs would change beyond any tolerance


@pytest.fixture(scope="module")
def target():
    return TargetModel.load("embedded")


def small_drafter(target):
    """A one-layer drafter of block B reading LAYERS, seeded: the drafter of every engine test."""
    cfg = config_for_target(
        target.config, num_layers=1, block_size=B, mask_token_id=MASK_TOKEN_ID, target_layer_ids=LAYERS
    )
    torch.manual_seed(1)
    return DFlashDrafter(cfg).to(target.device).eval()


def on_gpu():
    """The embedded target on CUDA and its small drafter (the GPU tests)."""
    gpu = TargetModel.load("embedded", device="cuda")
    return gpu, small_drafter(gpu)


@pytest.fixture(scope="module")
def drafter(target):
    return small_drafter(target)


def prompts(*lengths):
    return [
        torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in lengths
    ]


class ScriptedDrafts:
    """An engine whose drafts are the reference continuation for the first k slots and a wrong token
    after, with k cycling 0 .. B-1 over the rounds, so that every acceptance length and every crop
    occurs. The real drafter pass still runs (its cache fills and is overwritten as usual)."""

    def __init__(self, engine, continuation):
        self.engine, self.continuation, self.rounds = engine, continuation, 0
        self.name, self.target, self.drafter = engine.name, engine.target, engine.drafter

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def round(self, anchor, s, gen, tree_budget=None):  # the separate calls, through this object's own
        return separate_round(self, anchor, s, gen, tree_budget)

    def draft(self, context, anchor):
        logits = self.engine.draft(context, anchor)
        start = context.end
        k, self.rounds = self.rounds % B, self.rounds + 1
        right = self.continuation[start + 1 : start + B]
        tokens = [right[i] if i < k and i < len(right) else 7 for i in range(B - 1)]
        scripted = torch.zeros_like(logits)
        scripted[torch.arange(B - 1), tokens] = 1.0
        return scripted


class ScriptedTree(ScriptedDrafts):
    """Drafts for tree rounds: for the first k slots (k cycling 0 .. B-1 over the rounds) the reference
    token ranks second, after a wrong token, so accepted branches run through nodes that are not the
    tree's first ones and their cache rows must move. Records every kept path."""

    def __init__(self, engine, continuation):
        super().__init__(engine, continuation)
        self.paths = []

    def draft(self, context, anchor):
        logits = self.engine.draft(context, anchor)
        start = context.end
        k, self.rounds = self.rounds % B, self.rounds + 1
        right = self.continuation[start + 1 : start + B]
        scripted = torch.full_like(logits, -30.0)
        for i in range(B - 1):
            wrong = 7 if i >= len(right) or right[i] != 7 else 8
            scripted[i, wrong] = 0.0
            if i < k and i < len(right):
                scripted[i, right[i]] = -0.2
        return scripted

    def keep(self, verified, path):
        self.paths.append(list(path))
        return self.engine.keep(verified, path)


def test_the_drafters_fixed_shape_cache_reads_the_rows_before_the_anchor_and_the_blocks_own(target, drafter):
    feats, _ = target.features(torch.tensor([prompts(16)[0]]), layer_ids=LAYERS, labels="none")
    embeds = target.embed(torch.tensor([[5] + [MASK_TOKEN_ID] * (B - 1)]))
    block_positions = torch.arange(11, 11 + B)[None]
    with torch.no_grad():
        ref = drafter.draft(
            feats[:, :11], torch.arange(11)[None], embeds, block_positions, drafter.new_cache()
        )
        cache = drafter.new_static_cache(24)
        drafter.write_context(feats, torch.arange(16)[None], cache)  # rows 11..15: rejected drafts' features
        for k, v in zip(cache.keys, cache.values, strict=True):
            k[:, :, 11:] = POISON
            v[:, :, 11:] = POISON
        out = drafter.draft_block(embeds, block_positions, cache)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


# New tokens per generation in the decode tests: scripted rounds commit 1, 2, 3, 4, 1, 2 tokens after the
# prefill's one, so every acceptance length occurs and the last round is cut by the length limit.
N = 13


@pytest.fixture(scope="module")
def reference_rounds(target, drafter):
    """Per prompt (5 and 13 tokens): the autoregressive generation, and the reference engine's rounds with the
    real drafter and with scripted drafts (every acceptance length, every crop): the references the other
    engines must equal, made once per module."""
    out = {}
    for prompt in prompts(5, 13):
        ar = autoregressive_generate(target, prompt, N, layer_ids=LAYERS)
        real = speculative_generate(target, drafter, prompt, N)
        scripted = speculative_generate(
            target,
            drafter,
            prompt,
            N,
            engine=ScriptedDrafts(ReferenceEngine(target, drafter), prompt + ar.tokens),
        )
        assert real.tokens == scripted.tokens == ar.tokens
        assert set(scripted.accept_lengths[:-1]) == set(range(1, B + 1))
        assert 1 + sum(scripted.accept_lengths) > N  # the last round was cut short
        out[tuple(prompt)] = (ar, real, scripted)
    return out


@pytest.mark.parametrize("budget", [3, 10])
def test_tree_rounds_decode_as_autoregressive_on_the_reference_engine(
    target, drafter, reference_rounds, budget
):
    """Greedy tree rounds give the autoregressive tokens, for scripted trees (accepted branches off the first
    nodes: rows moved) and for the real drafter."""
    for key, (ar, _, _) in reference_rounds.items():
        prompt = list(key)
        script = ScriptedTree(ReferenceEngine(target, drafter), prompt + ar.tokens)
        g = speculative_generate(target, drafter, prompt, N, engine=script, tree_budget=budget)
        assert g.tokens == ar.tokens
        # a budget of 3 holds one right node (second after a wrong one), a budget of 10 two levels of them
        assert max(g.accept_lengths) == (2 if budget == 3 else 3)
        assert any(p != list(range(len(p))) for p in script.paths), "no accepted branch needed its rows moved"
        real = speculative_generate(target, drafter, prompt, N, engine="reference", tree_budget=budget)
        assert real.tokens == ar.tokens


def test_a_kept_tree_path_leaves_the_caches_of_a_chain(target, drafter):
    """Verify a tree, keep a branch that is not the first nodes: target cache rows, logits and the drafter's
    next context equal those of verifying that branch as a chain."""
    prompt = torch.tensor([prompts(9)[0]])
    #  0 - 1 - 2
    #   \- 3 - 4 - 5     the kept branch: 0, 3, 4, 5
    tree = DraftTree.of([900, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4])
    path, branch = [0, 3, 4, 5], torch.tensor([[900, 41, 42, 43]])
    engine, reference = ReferenceEngine(target, drafter), ReferenceEngine(target, drafter)
    with torch.no_grad():
        engine.prefill(prompt)
        verified = engine.verify_tree(tree)
        context = engine.keep(verified, path)
        reference.prefill(prompt)
        chain = reference.verify(branch)  # B = 4 tokens
    torch.testing.assert_close(verified.logits[path], chain.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(context.features, chain.features, atol=1e-4, rtol=1e-4)
    assert (context.start, context.end) == (9, 13) and engine.context is context
    n = 9 + len(path)
    for mine, theirs in zip(_kv(engine), _kv(reference), strict=True):
        torch.testing.assert_close(mine[:, :, :n], theirs[:, :, :n], atol=1e-5, rtol=1e-5)
    assert len(engine._tcache) == n


def _kv(engine):
    return [t for layer in engine._tcache.hf.layers for t in (layer.keys, layer.values)]


def test_keep_refuses_what_the_caches_cannot_hold(target, drafter):
    engine = ReferenceEngine(target, drafter)
    engine.prefill(torch.tensor([prompts(6)[0]]))
    first = engine.verify(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="starts at node 0 and increases"):
        engine.keep(first, [0, 2, 1])
    with pytest.raises(ValueError, match="starts at node 0 and increases"):
        engine.keep(first, [1, 2])
    engine.keep(first, [0, 1])
    with pytest.raises(ValueError, match="the Verified of the last verify"):
        engine.keep(first, [0])


def test_engine_names_of_earlier_releases_are_said_or_refused_in_one_line(target):
    """dynamic and graphs-kernels are taken for one release, with a note naming what they are now; the retired
    engines are refused naming what to use; an unknown name lists the engines."""
    from dflashkit.infer.engine import parse_engine

    assert parse_engine("auto") == ("auto", "auto", None)
    name, layers, note = parse_engine("dynamic", "auto")
    assert (name, layers) == ("reference", "auto") and "--engine reference" in note and "this release" in note
    name, layers, note = parse_engine("graphs-kernels", "auto")
    assert (name, layers) == ("graphs", "triton") and "--engine graphs --layers triton" in note
    for retired in ("static", "graphs-compiled", "graphs-layers"):
        with pytest.raises(
            DflashkitError, match=f"the {retired} decode engine was retired.*use --engine graphs"
        ):
            parse_engine(retired)
    with pytest.raises(
        DflashkitError, match="unknown decode engine 'fast'; choose one of auto, reference, graphs"
    ):
        make_engine("fast", target)
    with pytest.raises(DflashkitError, match="unknown --layers 'cuda'"):
        parse_engine("graphs", "cuda")
    assert isinstance(make_engine("dynamic", target), ReferenceEngine)


def test_layers_auto_takes_a_recorded_measurement_else_the_rule(target, tmp_path, monkeypatch):
    """--layers auto: by the rule (torch off a GPU, and for a short run; triton for a long run on a GPU where
    the kernels run the target) until a measurement of both layers is recorded for this device and target
    shape, then the faster one, saying so; a given --layers is taken as given; the reference engine has none."""
    from unittest import mock

    from dflashkit.infer.engine import layers_key, record_layers, resolve_layers

    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    assert resolve_layers("auto", "graphs", target, long_run=True)[0] == "torch"  # the CPU
    on_gpu = mock.Mock(wraps=target, device=torch.device("cuda"), config=target.config, dtype=torch.bfloat16)
    with mock.patch("dflashkit.infer.kernels.decoder.triton_missing", return_value=None):
        layers, why = resolve_layers("auto", "graphs", on_gpu, long_run=True)
        assert layers == "triton" and "no measurement recorded" in why
        assert resolve_layers("auto", "graphs", on_gpu)[0] == "torch"  # a short run
    with mock.patch("dflashkit.infer.kernels.decoder.triton_missing", return_value="no Triton"):
        assert resolve_layers("auto", "graphs", on_gpu, long_run=True) == (
            "torch",
            "layers: torch (--layers auto: the Triton kernels cannot run here: no Triton)",
        )
    assert resolve_layers("triton", "graphs", target) == ("triton", "layers: triton (--layers triton)")
    assert resolve_layers("auto", "reference", target) == ("torch", "")
    record = record_layers(target, {"torch": 2.5, "triton": 1.9}, date="2026-12-07", commit="abc1234")
    assert record["layers"] == "triton"
    layers, why = resolve_layers("auto", "graphs", target)
    assert layers == "triton" and "torch 2.500 ms" in why and "2026-12-07 abc1234" in why
    assert "cpu | llama layers 30 hidden 576" in layers_key(target)
    record_layers(target, {"torch": 1.0, "triton": 1.9})
    assert resolve_layers("auto", "graphs", target)[0] == "torch"  # the record is replaced
    with pytest.raises(ValueError, match="the round of both layers"):
        record_layers(target, {"torch": 1.0})
