"""Decode engines: the static engine (preallocated caches, fixed-shape steps) decodes exactly as the dynamic
one, eager and compiled; rows beyond the valid length of either static cache are never read; a verified
tree's accepted path leaves the caches of a chain, on both engines; their errors."""

import pytest
import torch

from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import DynamicEngine, StaticEngine, make_engine
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


def test_static_target_cache_never_reads_rows_beyond_the_valid_length(target):
    ids = torch.tensor([prompts(20)[0]])
    positions = torch.arange(20)[None]
    ref_logits, ref_feats = target.forward_step(ids, target.new_cache(), LAYERS)
    cache = target.new_static_cache(32)
    with torch.no_grad():
        target.walk(ids[:, :12], positions[:, :12], cache, LAYERS)
        target.walk(ids[:, 12:20], positions[:, 12:20], cache, LAYERS)  # a block of 8 ...
        for layer in cache.hf.layers:  # ... of which 5 were rejected: poison every row from 15 on
            layer.keys[:, :, 15:] = POISON
            layer.values[:, :, 15:] = POISON
        logits, feats = target.walk(ids[:, 15:20], positions[:, 15:20], cache, LAYERS)  # crop = start at 15
    torch.testing.assert_close(logits, ref_logits[0, 15:], atol=1e-3, rtol=1e-4)
    torch.testing.assert_close(feats, ref_feats[:, 15:], atol=5e-3, rtol=1e-4)


def test_static_draft_cache_reads_the_rows_before_the_anchor_and_the_blocks_own(target, drafter):
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
def dynamic_rounds(target, drafter):
    """Per prompt (5 and 13 tokens): the autoregressive generation, and the dynamic engine's rounds with the
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
            engine=ScriptedDrafts(DynamicEngine(target, drafter), prompt + ar.tokens),
        )
        assert real.tokens == scripted.tokens == ar.tokens
        assert set(scripted.accept_lengths[:-1]) == set(range(1, B + 1))
        assert 1 + sum(scripted.accept_lengths) > N  # the last round was cut short
        out[tuple(prompt)] = (ar, real, scripted)
    return out


def test_static_engine_decodes_as_the_dynamic_engine(target, drafter, dynamic_rounds):
    """Greedy tokens and per-round acceptance lengths are the same, for the real drafter (every round
    rejects) and for scripted drafts (every acceptance length, every crop); AR too. One static engine
    serves every prompt and both loops."""
    static = StaticEngine(target, drafter, capacity=64)
    for key, (ar, dyn, scripted) in dynamic_rounds.items():
        prompt = list(key)
        assert autoregressive_generate(target, prompt, N, engine=static).tokens == ar.tokens
        sta = speculative_generate(target, drafter, prompt, N, engine=static)
        assert sta.tokens == dyn.tokens == ar.tokens
        assert sta.accept_lengths == dyn.accept_lengths
        g = speculative_generate(
            target, drafter, prompt, N, engine=ScriptedDrafts(static, prompt + ar.tokens)
        )
        assert g.tokens == ar.tokens
        assert g.accept_lengths == scripted.accept_lengths
        assert set(g.accept_lengths[:-1]) == set(range(1, B + 1))


def test_static_engine_errors(target, drafter):
    static = StaticEngine(target, drafter, capacity=24)
    with pytest.raises(
        DflashkitError, match=r"holds 24 positions, but a prompt of 13 tokens \+ max_new_tokens 10"
    ):
        speculative_generate(target, drafter, prompts(13)[0], 10, engine=static)
    with pytest.raises(ValueError, match="take 1 or 4 tokens"):
        static.verify(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(DflashkitError, match="another target or drafter"):
        speculative_generate(target, drafter, [1, 2], 4, engine=StaticEngine(target, capacity=24))
    with pytest.raises(DflashkitError, match="unknown decode engine 'fast'"):
        make_engine("fast", target)
    with pytest.raises(DflashkitError, match="sdpa or eager backend"):
        StaticEngine(target, drafter, capacity=24, backend="flex")


def test_a_step_that_does_not_compile_ends_in_one_line(target, drafter, monkeypatch):
    from torch._dynamo.exc import TorchDynamoException

    from dflashkit.runtime.compile import is_frozen

    static = StaticEngine(target, drafter, capacity=24, compile=True)

    def fails(*args):
        raise TorchDynamoException("graph break in a decoder layer\nmore detail")

    monkeypatch.setattr(static._target_step, "_compiled", fails)  # as torch.compile would raise
    with pytest.raises(
        DflashkitError,
        match=r"target step failed to compile .*graph break in a decoder layer\); turn compiling off "
        r"\(--engine dynamic\)",
    ):
        static.warm_up()
    assert not is_frozen() and not static._warm


def test_static_engine_refuses_targets_it_cannot_walk(tmp_path):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=16,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=0,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with pytest.raises(
        DflashkitError, match=r"sliding-window layers; the static decode engine .* \(--engine dynamic\)"
    ):
        StaticEngine(TargetModel.load(tmp_path), capacity=16)


def graphs(engine):
    """Compiled graphs of the engine's steps (a frozen region raises rather than compile; this says so too)."""
    return engine._target_step.graphs(), engine._draft_step.graphs()


def assert_decodes_as_dynamic(target, drafter, static, prompt, n):
    """On `static`: AR gives the dynamic AR tokens; scripted drafts (every acceptance length and crop) give
    the dynamic engine's tokens and acceptance lengths; the real drafter gives its acceptance lengths."""
    ar = autoregressive_generate(target, prompt, n, layer_ids=LAYERS)
    assert autoregressive_generate(target, prompt, n, engine=static).tokens == ar.tokens
    reference = prompt + ar.tokens
    dyn = speculative_generate(
        target, drafter, prompt, n, engine=ScriptedDrafts(DynamicEngine(target, drafter), reference)
    )
    sta = speculative_generate(target, drafter, prompt, n, engine=ScriptedDrafts(static, reference))
    assert sta.tokens == dyn.tokens == ar.tokens and sta.accept_lengths == dyn.accept_lengths
    real = speculative_generate(target, drafter, prompt, n)
    assert (
        speculative_generate(target, drafter, prompt, n, engine=static).accept_lengths == real.accept_lengths
    )


@pytest.mark.cpu_compile  # `make compile-test`: ~4 minutes; on a GPU the compiled steps are tested captured
def test_compiled_static_engine_decodes_chains_and_trees_as_the_dynamic_engine(target, drafter):
    """torch.compile of each step shape (the default mode on the CPU), warmed up then frozen, one engine for
    both kinds of round (each compile costs ~a minute on the CPU): chain rounds give the dynamic engine's
    tokens and acceptance lengths; the tree step compiles once for its node budget, and tree rounds (branches
    off the first nodes, rows moved) decode as autoregressive decoding; nothing compiles after warm-up (it
    would raise)."""
    from dflashkit.runtime.compile import is_frozen

    static = StaticEngine(target, drafter, capacity=48, compile=True, tree_budget=6)
    warmed = static.warm_up()
    assert list(warmed) == ["target [1, 1]", f"target [1, {B}]", f"draft [1, {B}]", "target tree [1, 7]"]
    assert not is_frozen()
    warm = (*graphs(static), static._tree_step.graphs())
    prompt = prompts(9)[0]
    assert_decodes_as_dynamic(target, drafter, static, prompt, 16)  # each step frozen while it runs
    ar = autoregressive_generate(target, prompt, 16, layer_ids=LAYERS)
    script = ScriptedTree(static, prompt + ar.tokens)
    g = speculative_generate(target, drafter, prompt, 16, engine=script, tree_budget=6)
    assert g.tokens == ar.tokens and max(g.accept_lengths) >= 2
    assert any(p != list(range(len(p))) for p in script.paths)
    assert (*graphs(static), static._tree_step.graphs()) == warm, "compiled after warm-up"
    assert not is_frozen()


@pytest.mark.gpu
def test_static_engine_replays_cuda_graphs_on_gpu():
    """On CUDA the compiled steps are CUDA graphs (mode reduce-overhead): the same greedy output and
    acceptance lengths as the dynamic engine (fp32), no compile and no skipped CUDA graph after warm-up,
    over prompts of several lengths and every acceptance length."""
    from torch._dynamo.utils import counters

    gpu, d = on_gpu()
    static = StaticEngine(gpu, d, capacity=128, compile=True)
    assert static.mode == "reduce-overhead"
    static.warm_up()
    warm, skips = graphs(static), counters["inductor"]["cudagraph_skips"]
    for prompt in prompts(5, 13, 40):
        assert_decodes_as_dynamic(gpu, d, static, prompt, 48)
    assert graphs(static) == warm, "compiled after warm-up"
    assert counters["inductor"]["cudagraph_skips"] == skips == 0, "a step ran without its CUDA graph"


@pytest.mark.parametrize("budget", [3, 10])
def test_tree_rounds_decode_as_autoregressive_on_both_engines(target, drafter, dynamic_rounds, budget):
    """Greedy tree rounds give the autoregressive tokens on both engines, with the same acceptance lengths,
    for scripted trees (accepted branches off the first nodes: rows moved) and for the real drafter."""
    static = StaticEngine(target, drafter, capacity=64, tree_budget=budget)
    for key, (ar, _, _) in dynamic_rounds.items():
        prompt = list(key)
        scripted = {}
        for name, engine in (("dynamic", DynamicEngine(target, drafter)), ("static", static)):
            script = ScriptedTree(engine, prompt + ar.tokens)
            g = speculative_generate(target, drafter, prompt, N, engine=script, tree_budget=budget)
            assert g.tokens == ar.tokens, name
            scripted[name] = (g, script.paths)
        (dyn, paths), (sta, _) = scripted["dynamic"], scripted["static"]
        # a budget of 3 holds one right node (second after a wrong one), a budget of 10 two levels of them
        assert sta.accept_lengths == dyn.accept_lengths and max(dyn.accept_lengths) == (
            2 if budget == 3 else 3
        )
        assert any(p != list(range(len(p))) for p in paths), "no accepted branch needed its rows moved"
        for engine in ("dynamic", static):
            real = speculative_generate(target, drafter, prompt, N, engine=engine, tree_budget=budget)
            assert real.tokens == ar.tokens


def test_a_kept_tree_path_leaves_the_caches_of_a_chain(target, drafter):
    """Verify a tree, keep a branch that is not the first nodes: target cache rows, logits and the drafter's
    next context equal those of verifying that branch as a chain, on both engines."""
    prompt = torch.tensor([prompts(9)[0]])
    #  0 - 1 - 2
    #   \- 3 - 4 - 5     the kept branch: 0, 3, 4, 5
    tree = DraftTree.of([900, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4])
    path, branch = [0, 3, 4, 5], torch.tensor([[900, 41, 42, 43]])
    for make in (lambda: DynamicEngine(target, drafter), lambda: StaticEngine(target, drafter, capacity=32)):
        engine, reference = make(), make()
        with torch.no_grad():
            engine.prefill(prompt)
            verified = engine.verify_tree(tree)
            context = engine.keep(verified, path)
            reference.prefill(prompt)
            chain = reference.verify(branch)  # B = 4 tokens: a target step of both engines
        torch.testing.assert_close(verified.logits[path], chain.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(context.features, chain.features, atol=1e-4, rtol=1e-4)
        assert (context.start, context.end) == (9, 13)
        n = 9 + len(path)
        for mine, theirs in zip(_kv(engine), _kv(reference), strict=True):
            torch.testing.assert_close(mine[:, :, :n], theirs[:, :, :n], atol=1e-5, rtol=1e-5)
        assert (len(engine._tcache) if isinstance(engine, DynamicEngine) else engine._length) == n


def _kv(engine):
    return [t for layer in engine._tcache.hf.layers for t in (layer.keys, layer.values)]


def test_keep_refuses_what_the_caches_cannot_hold(target, drafter):
    engine = DynamicEngine(target, drafter)
    engine.prefill(torch.tensor([prompts(6)[0]]))
    first = engine.verify(torch.tensor([[1, 2, 3, 4]]))
    with pytest.raises(ValueError, match="starts at node 0 and increases"):
        engine.keep(first, [0, 2, 1])
    with pytest.raises(ValueError, match="starts at node 0 and increases"):
        engine.keep(first, [1, 2])
    engine.keep(first, [0, 1])
    with pytest.raises(ValueError, match="the Verified of the last verify"):
        engine.keep(first, [0])


def test_the_static_engine_names_the_transformers_it_was_tested_on():
    """pyproject.toml declares the tested range; a transformers whose StaticCache lacks what the static engine
    reads is refused in one line naming it."""
    import re
    from pathlib import Path

    from dflashkit.target import hf

    low, high = hf.TESTED_TRANSFORMERS
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert re.search(rf'"transformers>={re.escape(low)},<5\.{int(high.split(".")[1]) + 1}"', pyproject)

    class Layer:  # no cumulative_length
        pass

    class Cache:
        layers = [Layer()]

        def early_initialization(self, *args):
            pass

    with pytest.raises(
        DflashkitError, match=r"transformers 5\.17-5\.24, which transformers .* \(--engine dynamic\)"
    ):
        hf._check_static_cache(Cache())
