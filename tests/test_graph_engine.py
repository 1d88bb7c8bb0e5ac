"""The graphs engine (the fused target forward, one CUDA graph per step on a GPU) decodes exactly as the
reference engine in fp32: eager with exact attention widths, with the fixed shapes a graph needs, and with its
layers through the Triton kernels (Triton's interpreter on the CPU; a second engine warm from the kernel
cache); chain and tree rounds (a kept tree path leaves the caches of a chain); ``--engine auto``."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import test_engine
from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import ReferenceEngine, make_engine, ready_engine
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.sampling import Sampling
from dflashkit.infer.speculative import autoregressive_generate, speculative_generate
from dflashkit.infer.tree import DraftTree, build_tree
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel
from test_engine import LAYERS, ScriptedDrafts, ScriptedTree, on_gpu, prompts, small_drafter

# the same module-scoped fixtures (B = 4), and the reference engine's chain rounds of N new tokens
target, drafter, reference_rounds = test_engine.target, test_engine.drafter, test_engine.reference_rounds
N = test_engine.N

B = test_engine.B
# what warm-up captures for chains, in order (the greedy round: the draft and target steps and the glue)
CHAIN_STEPS = [
    "target [1, 1]",
    f"target [1, {B}]",
    f"draft [1, {B}]",
    f"greedy round [1, {B}]",
    "next token [1, 1]",
]


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_graphs_engine_decodes_as_the_reference_engine(target, drafter, reference_rounds, fixed_shapes):
    """Greedy tokens and per-round acceptance lengths: AR, the real drafter, and scripted drafts (every
    acceptance length, every crop). One engine serves every prompt and both loops."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=fixed_shapes)
    for key, (ar, dyn, scripted) in reference_rounds.items():
        prompt = list(key)
        assert autoregressive_generate(target, prompt, N, engine=engine).tokens == ar.tokens
        ours = speculative_generate(target, drafter, prompt, N, engine=engine)
        assert ours.tokens == dyn.tokens == ar.tokens and ours.accept_lengths == dyn.accept_lengths
        g = speculative_generate(
            target, drafter, prompt, N, engine=ScriptedDrafts(engine, prompt + ar.tokens)
        )
        assert g.tokens == ar.tokens
        assert g.accept_lengths == scripted.accept_lengths
        assert set(g.accept_lengths[:-1]) == set(range(1, B + 1))


def test_a_lazy_target_serves_the_graphs_engine_without_its_model(target, drafter, reference_rounds):
    """The serving commands load the target lazily: the graphs engine decodes from its weights file alone,
    token for token and round for round as with the model loaded, and the transformers model is never
    built (NOTES: most of a target's load is importing it)."""
    lazy = TargetModel.load("embedded", lazy=True)
    engine = GraphEngine(lazy, drafter, capacity=64, graphs=False, fixed_shapes=True, tree_budget=6)
    for key, (ar, dyn, _) in reference_rounds.items():
        prompt = list(key)
        assert autoregressive_generate(lazy, prompt, N, engine=engine).tokens == ar.tokens
        ours = speculative_generate(lazy, drafter, prompt, N, engine=engine)
        assert ours.tokens == dyn.tokens and ours.accept_lengths == dyn.accept_lengths
        trees = speculative_generate(lazy, drafter, prompt, N, engine=engine, tree_budget=6)
        assert trees.tokens == ar.tokens
    assert lazy.lazy


def test_graphs_engine_draft_and_verify_logits_match_the_reference_engine(target, drafter):
    """The drafter's logits (context written from the prompt, then from a verified block, with a rejected
    tail) and the target's block logits agree with the reference engine's to fp32 rounding."""
    prompt = torch.tensor([prompts(11)[0]])
    ref, ours = ReferenceEngine(target, drafter), GraphEngine(target, drafter, capacity=48, graphs=False)
    (ours_logits, ours_ctx), (ref_logits, ref_ctx) = ours.prefill(prompt), ref.prefill(prompt)
    torch.testing.assert_close(ours_logits, ref_logits, atol=1e-3, rtol=1e-4)
    for anchor in (17, 923):
        assert ours_ctx.end == ref_ctx.end
        torch.testing.assert_close(
            ours.draft(ours_ctx, anchor), ref.draft(ref_ctx, anchor), atol=1e-3, rtol=1e-4
        )
        block = torch.tensor([[anchor, 5, 6, 7]])
        ours_v, ref_v = ours.verify(block), ref.verify(block)
        torch.testing.assert_close(ours_v.logits, ref_v.logits, atol=1e-3, rtol=1e-4)
        # the anchor and one draft accepted; two rejected
        ours_ctx, ref_ctx = ours.keep(ours_v, [0, 1]), ref.keep(ref_v, [0, 1])
        torch.testing.assert_close(ours_ctx.features, ref_ctx.features, atol=5e-3, rtol=1e-4)


def test_graphs_engine_errors(target, drafter):
    engine = GraphEngine(target, drafter, capacity=24, graphs=False)
    with pytest.raises(
        DflashkitError, match=r"holds 24 positions, but a prompt of 13 tokens \+ max_new_tokens 10"
    ):
        speculative_generate(target, drafter, prompts(13)[0], 10, engine=engine)
    with pytest.raises(ValueError, match="take 1 or 4 tokens"):
        engine.verify(torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(DflashkitError, match=r"built without a tree budget: build it with tree_budget=N"):
        speculative_generate(target, drafter, prompts(5)[0], 4, engine=engine, tree_budget=4)
    small = GraphEngine(target, drafter, capacity=24, graphs=False, tree_budget=2)
    with pytest.raises(DflashkitError, match=r"a round of 5 needs 28: build it with capacity >= 28"):
        speculative_generate(target, drafter, prompts(13)[0], 10, engine=small, tree_budget=4)
    with pytest.raises(
        DflashkitError, match=r"trees of up to 2 drafted nodes, got 3: build it with tree_budget=3"
    ):
        speculative_generate(target, drafter, prompts(5)[0], 4, engine=small, tree_budget=3)
    small.prefill(torch.tensor([prompts(5)[0]]))
    with pytest.raises(ValueError, match=r"a chain keeps its first tokens, not the path \[0, 2\]"):
        small.keep(small.verify(torch.tensor([[1, 2, 3, 4]])), [0, 2])
    if not torch.cuda.is_available():
        with pytest.raises(DflashkitError, match="needs the target on a GPU"):
            GraphEngine(target, drafter, capacity=24, graphs=True)
    assert isinstance(make_engine("graphs", target, drafter, capacity=24), GraphEngine)
    engine, warm = ready_engine("graphs", target, drafter, capacity=24)
    assert isinstance(engine, GraphEngine) and warm == {}  # the CPU: eager, nothing to capture


def test_triton_layers_keep_one_kernel_cache_per_shape(target, drafter, tmp_path, monkeypatch):
    """--layers triton: the decoder kernels' binaries in a file under $DFLASHKIT_CACHE/compile (the name earlier
    releases gave it), one per target, drafter shape and capacity; torch layers keep none."""
    from dflashkit.infer import graph_engine

    monkeypatch.setenv("DFLASHKIT_CACHE", str(tmp_path))
    engine = make_engine("graphs", target, drafter, capacity=24, layers="triton")
    assert isinstance(engine, GraphEngine) and engine.layers == "triton" and not engine.graphs  # the CPU
    path = Path(engine.kernel_cache)
    assert path.parent == tmp_path / "compile" and path.name.endswith(".cache.triton")
    assert make_engine("graphs", target, drafter, capacity=24, layers="triton").kernel_cache == path
    assert make_engine("graphs", target, drafter, capacity=32, layers="triton").kernel_cache != path
    assert (
        make_engine("graphs", target, None, capacity=24, layer_ids=[1], layers="triton").kernel_cache != path
    )
    assert engine._target_fn is graph_engine.kernel_target_step
    torch_layers = make_engine("graphs", target, drafter, capacity=24)
    assert torch_layers.kernel_cache is None and torch_layers._target_fn is graph_engine.target_step
    with pytest.raises(DflashkitError, match="choose torch or triton"):
        GraphEngine(target, drafter, capacity=24, layers="cuda")  # type: ignore[arg-type]


def test_graphs_engine_builds_trees_into_its_tree_step(target, drafter):
    """The engine's build is the tree module's, written into the tree step's inputs (verify_tree then
    copies nothing); another budget is built eagerly."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=True, tree_budget=6)
    gen = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(B - 1, target.vocab_size, generator=gen) * 3, dim=-1)
    tree = engine.build_tree(900, probs, 6)
    assert torch.equal(tree.nodes, build_tree(900, probs, 6).nodes)
    assert tree.nodes.data_ptr() == engine._tree_inputs.data_ptr()
    assert torch.equal(engine.build_tree(900, probs, 3).nodes, build_tree(900, probs, 3).nodes)
    assert engine._tree_inputs.data_ptr() == tree.nodes.data_ptr() and torch.equal(
        tree.nodes, build_tree(900, probs, 6).nodes
    ), "an eager build of another budget left the engine's tree alone"


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["torch", "triton"])
def test_graphs_engine_replays_cuda_graphs_on_gpu(layers):
    """On CUDA (fp32, so the attention is the masked reference over the whole capacity): each step shape
    is captured once at warm-up and replayed after; the same greedy output and acceptance lengths as the
    reference engine, with scripted drafts (every acceptance length and crop), with either layers."""
    gpu, d = on_gpu()
    engine = GraphEngine(gpu, d, capacity=128, layers=layers)
    warmed = engine.warm_up()
    assert list(warmed) == CHAIN_STEPS and len(engine.steps) == 5
    for prompt in prompts(5, 13, 40):
        ar = autoregressive_generate(gpu, prompt, 48, layer_ids=LAYERS)
        assert autoregressive_generate(gpu, prompt, 48, engine=engine).tokens == ar.tokens
        ref = speculative_generate(
            gpu, d, prompt, 48, engine=ScriptedDrafts(ReferenceEngine(gpu, d), prompt + ar.tokens)
        )
        ours = speculative_generate(gpu, d, prompt, 48, engine=ScriptedDrafts(engine, prompt + ar.tokens))
        assert ours.tokens == ref.tokens == ar.tokens and ours.accept_lengths == ref.accept_lengths
    assert len(engine.steps) == 5, "a step was captured after warm-up"


FIXED_TREE = DraftTree.of([900, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4])  # padded to an engine's budget


def tree_step_replays(engine: GraphEngine, eager: GraphEngine, prompt: list[int], tol: float) -> None:
    """After the prompt, ``engine``'s tree step over ``FIXED_TREE`` gives ``eager``'s logits and features
    within ``tol``."""
    for e in (engine, eager):
        e.prefill(torch.tensor([prompt], device="cuda"))
    ours, theirs = engine.verify_tree(FIXED_TREE), eager.verify_tree(FIXED_TREE)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=tol, rtol=tol)
    torch.testing.assert_close(ours.features, theirs.features, atol=tol, rtol=tol)


@pytest.mark.gpu
@pytest.mark.parametrize("layers", ["torch", "triton"])
def test_graphs_engine_replays_the_tree_step_on_gpu(layers):
    """On CUDA in fp32: warm-up captures the tree step [1, N+1] and the keep step beside the chain's steps; the replayed tree step gives the
    eager step's logits and features, and tree rounds (scripted: rows moved; and the real drafter) decode as
    autoregressive decoding with the eager engine's acceptance lengths; nothing is captured after warm-up but
    a sampled tree round (at T > 0, on its first call), which commits the eager engine's tokens for a seed."""
    gpu, d = on_gpu()
    budget = 10
    engine = GraphEngine(gpu, d, capacity=128, tree_budget=budget, layers=layers)
    eager = GraphEngine(gpu, d, capacity=128, graphs=False, fixed_shapes=True, tree_budget=budget)
    warmed = engine.warm_up()
    n = budget + 1
    tree_steps = [
        f"tree build [{n} nodes]",
        f"target tree [1, {n}]",
        f"tree walk [{n} nodes]",
        f"tree keep [{n} rows]",
        f"greedy tree round [{n} nodes]",
    ]
    assert list(warmed) == CHAIN_STEPS + tree_steps
    assert len(engine.steps) == 10
    tree_step_replays(engine, eager, prompts(9)[0], tol=1e-4)
    for seed in range(3):  # the replayed build: the eager build's tree
        probs = torch.softmax(torch.randn(B - 1, gpu.vocab_size, device="cuda") * (2 + seed), dim=-1)
        assert torch.equal(engine.build_tree(900, probs, budget).nodes, build_tree(900, probs, budget).nodes)
    for prompt in prompts(5, 40):
        ar = autoregressive_generate(gpu, prompt, 32, layer_ids=LAYERS)
        runs = {}
        for name, e in (("graphs", engine), ("eager", eager)):
            script = ScriptedTree(e, prompt + ar.tokens)
            scripted = speculative_generate(gpu, d, prompt, 32, engine=script, tree_budget=budget)
            real = speculative_generate(gpu, d, prompt, 32, engine=e, tree_budget=budget)
            assert scripted.tokens == real.tokens == ar.tokens, name
            assert any(p != list(range(len(p))) for p in script.paths), name
            runs[name] = (scripted.accept_lengths, real.accept_lengths)
        assert runs["graphs"] == runs["eager"]
    assert len(engine.steps) == 10, "a step was captured after warm-up"
    # at T > 0: the sampled tree round, captured on its first call, commits the eager engine's tokens for a seed
    s = Sampling(temperature=0.7, seed=5)
    prompt = prompts(40)[0]
    sampled = [
        speculative_generate(gpu, d, prompt, 32, s, engine=e, tree_budget=budget) for e in (engine, eager)
    ]
    assert sampled[0].tokens == sampled[1].tokens and sampled[0].accept_lengths == sampled[1].accept_lengths
    assert len(engine.steps) == 11, "the sampled tree round: one step more"


@pytest.mark.gpu
def test_bf16_tree_rounds_are_captured_on_gpu():
    """On CUDA in bf16 (FlashAttention for the chain's steps; the tree step's one masked SDPA, ``_tree_plan``):
    warm-up captures the tree step and the greedy tree round, and the replayed steps give the very tokens and
    acceptance lengths of the same steps run uncaptured."""
    gpu = TargetModel.load("embedded", dtype=torch.bfloat16, device="cuda")
    d = small_drafter(gpu).to(torch.bfloat16)
    budget = 10
    engine = GraphEngine(gpu, d, capacity=128, tree_budget=budget)
    eager = GraphEngine(gpu, d, capacity=128, graphs=False, fixed_shapes=True, tree_budget=budget)
    assert engine.attention == "flash"
    assert f"greedy tree round [{budget + 1} nodes]" in engine.warm_up()
    tree_step_replays(engine, eager, prompts(40)[0], tol=2e-2)
    for prompt in prompts(5, 40):
        ours = speculative_generate(gpu, d, prompt, 32, engine=engine, tree_budget=budget)
        theirs = speculative_generate(gpu, d, prompt, 32, engine=eager, tree_budget=budget)
        assert (ours.tokens, ours.accept_lengths) == (theirs.tokens, theirs.accept_lengths)


def test_auto_engine_is_the_fastest_lossless_one(target):
    """--engine auto: the graphs engine for a supported family, on a GPU and on the CPU; the reference engine
    for any other target (the layers: tests/test_engine.py); --help spells the same choices as the engine
    module (without importing torch)."""
    from dflashkit.commands.infer import EARLIER_ENGINES, ENGINE_CHOICES, LAYER_CHOICES
    from dflashkit.infer import engine

    assert engine.ENGINE_CHOICES == ENGINE_CHOICES and engine.LAYER_CHOICES == LAYER_CHOICES
    assert set(EARLIER_ENGINES) == set(engine.RENAMED) | set(engine.RETIRED)
    assert engine.resolve_engine("auto", target) == "graphs"
    on_gpu = SimpleNamespace(device=torch.device("cuda"), config=target.config, dtype=torch.bfloat16)
    assert engine.resolve_engine("auto", on_gpu) == "graphs"
    other = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(model_type="gpt2"))
    assert engine.resolve_engine("auto", other) == "reference"
    assert engine.resolve_engine("reference", target) == "reference"


def test_tree_budget_auto_takes_trees_where_they_were_measured_faster():
    """--tree-budget auto: trees of 15 for greedy rounds on the graphs engine's Triton layers with a block of at
    most 16 (where they served faster than the chain side by side), the chain everywhere else; a number is
    taken as given."""
    from dflashkit.infer.engine import AUTO_TREE_BUDGET, resolve_tree_budget

    assert AUTO_TREE_BUDGET == 15
    assert resolve_tree_budget(None, "graphs", "triton", 8, 0.0) == 15
    assert resolve_tree_budget(None, "graphs", "triton", 4, 0.0) == 15
    assert resolve_tree_budget(None, "graphs", "triton", 8, 1.0) == 0  # sampled: the chain
    assert resolve_tree_budget(None, "graphs", "triton", 16, 0.0) == 15  # measured: trees pay at block 16 too
    assert resolve_tree_budget(None, "graphs", "triton", 32, 0.0) == 0  # a block not measured
    for engine, layers in (("graphs", "torch"), ("reference", "torch")):
        assert resolve_tree_budget(None, engine, layers, 8, 0.0) == 0
    assert resolve_tree_budget(0, "graphs", "triton", 8, 0.0) == 0
    assert resolve_tree_budget(31, "reference", "torch", 16, 1.0) == 31


N_TREE = 12  # new tokens per tree generation


@pytest.fixture(scope="module")
def reference_tree_rounds(target, drafter):
    """Per node budget: the autoregressive tokens, and the reference engine's tree rounds (scripted and with
    the real drafter) of one prompt: the references of every graphs-engine variant."""
    prompt = prompts(9)[0]
    ar = autoregressive_generate(target, prompt, N_TREE, layer_ids=LAYERS).tokens
    out = {}
    for budget in (3, 10):
        script = ScriptedTree(ReferenceEngine(target, drafter), prompt + ar)
        scripted = speculative_generate(target, drafter, prompt, N_TREE, engine=script, tree_budget=budget)
        real = speculative_generate(target, drafter, prompt, N_TREE, tree_budget=budget)
        assert scripted.tokens == real.tokens == ar
        out[budget] = (scripted.accept_lengths, real.accept_lengths)
    return prompt, ar, out


@pytest.mark.parametrize("fixed_shapes", [False, True])
@pytest.mark.parametrize("budget", [3, 10])
def test_graphs_engine_tree_rounds_decode_as_autoregressive(
    target, drafter, reference_tree_rounds, budget, fixed_shapes
):
    """Greedy tree rounds on the graphs engine give the autoregressive tokens with the reference engine's
    acceptance lengths, for scripted trees (accepted branches off the tree's first nodes: rows moved) and
    for the real drafter; one engine serves both loops."""
    prompt, ar, reference = reference_tree_rounds
    engine = GraphEngine(
        target, drafter, capacity=48, graphs=False, fixed_shapes=fixed_shapes, tree_budget=budget
    )
    script = ScriptedTree(engine, prompt + ar)
    scripted = speculative_generate(target, drafter, prompt, N_TREE, engine=script, tree_budget=budget)
    real = speculative_generate(target, drafter, prompt, N_TREE, engine=engine, tree_budget=budget)
    assert scripted.tokens == real.tokens == ar
    assert (scripted.accept_lengths, real.accept_lengths) == reference[budget]
    # a budget of 3 holds one right node (second after a wrong one), a budget of 10 two levels of them
    assert max(scripted.accept_lengths) == (2 if budget == 3 else 3)
    assert any(p != list(range(len(p))) for p in script.paths), "no accepted branch needed its rows moved"


def script_fused_drafts(engine: GraphEngine, continuation: list[int]) -> None:
    """``ScriptedTree``'s drafts inside the engine's own draft step, on the device (no host read, as a
    captured step must): after the real draft, the drafted slots' logits become the scripted ones for the
    block at ``_block_start``, so a fused tree round (one step) accepts the same branches, rows moved."""
    real, B = engine._draft_step, engine.block_size
    padded = torch.tensor(continuation + [0] * 2 * B)
    rounds = torch.zeros(1, dtype=torch.long)
    slots = torch.arange(B - 1)

    def scripted() -> None:
        real()
        k = rounds % B
        rounds.add_(1)
        at = engine._block_start + 1 + slots
        right = padded.index_select(0, at)
        wrong = torch.where(right != 7, 7, 8)
        logits = torch.full_like(engine._draft_logits, -30.0)
        logits.scatter_(1, wrong[:, None], 0.0)
        shown = (slots < k) & (at < len(continuation))
        logits.scatter_(1, right[:, None], torch.where(shown, -0.2, -30.0)[:, None])
        engine._draft_logits.copy_(logits)

    engine._draft_step = scripted  # type: ignore[method-assign]


def record_step_keys(engine: GraphEngine, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The kind of every step ``engine`` runs from now on (the first part of its key), in order."""
    keys: list[str] = []
    run = engine.steps.run
    monkeypatch.setattr(engine.steps, "run", lambda key, step: (keys.append(str(key[0])), run(key, step)))
    return keys


@pytest.mark.parametrize("fixed_shapes", [False, True])
@pytest.mark.parametrize("budget", [3, 10])
def test_greedy_tree_rounds_as_one_step_keep_branches_as_the_reference_engine(
    target, drafter, reference_tree_rounds, budget, fixed_shapes, monkeypatch
):
    """The graphs engine's greedy tree round as one step (draft, build, verify, walk, keep and the next
    round's state on the device) decodes as autoregressive decoding with the reference engine's acceptance
    lengths, for scripted drafts whose accepted branches are not the tree's first nodes (rows moved) and
    for the real drafter; it ran as the one step, never the separate calls."""
    prompt, ar, reference = reference_tree_rounds
    engine = GraphEngine(
        target, drafter, capacity=48, graphs=False, fixed_shapes=fixed_shapes, tree_budget=budget
    )
    assert engine.fuses_rounds(budget) and not engine.fuses_rounds(budget + 1)
    keys = record_step_keys(engine, monkeypatch)
    real = speculative_generate(target, drafter, prompt, N_TREE, engine=engine, tree_budget=budget)
    script_fused_drafts(engine, prompt + ar)
    scripted = speculative_generate(target, drafter, prompt, N_TREE, engine=engine, tree_budget=budget)
    assert scripted.tokens == real.tokens == ar
    assert (scripted.accept_lengths, real.accept_lengths) == reference[budget]
    assert max(scripted.accept_lengths) == (2 if budget == 3 else 3)  # branches off the first nodes
    assert set(keys) == {"tree round"}, set(keys)


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_greedy_rounds_as_one_step_equal_the_separate_calls(target, drafter, fixed_shapes, monkeypatch):
    """The graphs engine's greedy round as one step (draft, verify, accept and the next round's state on
    the device) gives the tokens and acceptance lengths of the draft, verify and keep calls (one engine for
    both, each generation after the other's), with a length limit that cuts the last round."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=fixed_shapes)
    keys = record_step_keys(engine, monkeypatch)
    for prompt in prompts(11):
        out = {}
        for fused in (True, False):
            engine.fused_rounds = fused
            keys.clear()
            out[fused] = speculative_generate(target, drafter, prompt, 19, engine=engine)
            assert ("round" in keys) == fused and ("draft" in keys) != fused
        assert out[True].tokens == out[False].tokens
        assert out[True].accept_lengths == out[False].accept_lengths
    assert out[True].tokens == autoregressive_generate(target, prompt, 19, layer_ids=LAYERS).tokens


@pytest.mark.parametrize(("top_p", "draft_sampling"), [(1.0, "marginal"), (0.9, "marginal"), (1.0, "argmax")])
def test_sampled_rounds_as_one_step_equal_the_separate_calls(
    target, drafter, top_p, draft_sampling, monkeypatch
):
    """At T > 0 under the rejection rule the graphs engine's chain round as one step (draft, the drafts raced
    from the drafter's distribution, verify, accept, the next round's state, on the device) commits, for a
    seed, the tokens of the draft, verify and keep calls: both draw the round's noise first, in one order
    (`sampling.rejection_noise`). The calls' rule is held to the target's distribution by
    test_speculative's chi-square tests."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=True)
    keys = record_step_keys(engine, monkeypatch)
    accepted = 0
    for prompt in prompts(11)[:3]:
        for seed in (0, 1):
            out = {}
            for fused in (True, False):
                engine.fused_rounds = fused
                keys.clear()
                # a high temperature: the random drafter's drafts are accepted often (both distributions flat)
                s = Sampling(20.0, top_p, "rejection", seed, draft_sampling)
                out[fused] = speculative_generate(target, drafter, prompt, 19, s, engine=engine)
                assert ("sampled round" in keys) == fused and ("draft" in keys) != fused
            assert out[True].tokens == out[False].tokens
            assert out[True].accept_lengths == out[False].accept_lengths
            accepted += sum(t - 1 for t in out[True].accept_lengths)
    # the random drafter's argmax is a token the flat target rarely draws: argmax rounds mostly reject
    assert accepted > 0 or draft_sampling == "argmax", "the test must exercise accepted drafts"
    # another temperature is another captured step; the exact rule and greedy decoding take their own ways
    engine.fused_rounds = True
    with pytest.raises(DflashkitError, match="rejection rule"):
        engine.sampled_round(None, Sampling(temperature=1.0, rule="exact"), None)


def test_sampled_tree_rounds_as_one_step_equal_the_separate_calls(target, drafter, monkeypatch):
    """At T > 0 a tree round as one step (draft, the tree built from the drafter's distributions at that
    temperature, verify, the target's draw at every node, walk, keep, the next round's state, on the device)
    commits, for a seed, the tokens of the draft, build, verify, walk and keep calls: both draw the target's
    noise at every node from the seed's generator, in one order (`sampling.choose`'s). Scripted drafts (the
    greedy continuation ranked second in the first slots) at a low temperature, so that branches are taken.
    The exact rule a tree takes is held to the target's distribution by test_speculative's tests."""
    budget = 8
    accepted = 0
    for prompt in prompts(11, 6):
        ar = autoregressive_generate(target, prompt, 17, layer_ids=LAYERS).tokens
        for seed in (0, 1):
            out = {}
            for fused in (True, False):
                engine = GraphEngine(
                    target, drafter, capacity=64, graphs=False, fixed_shapes=True, tree_budget=budget
                )
                engine.fused_rounds = fused
                keys = record_step_keys(engine, monkeypatch)
                script_fused_drafts(engine, prompt + ar)
                s = Sampling(temperature=0.3, seed=seed)
                out[fused] = speculative_generate(
                    target, drafter, prompt, 17, s, engine=engine, tree_budget=budget
                )
                assert ("sampled tree round" in keys) == fused and ("draft" in keys) != fused
            assert out[True].tokens == out[False].tokens
            assert out[True].accept_lengths == out[False].accept_lengths
            accepted += sum(t - 1 for t in out[True].accept_lengths)
    assert accepted > 0, "the test must exercise accepted nodes"
    with pytest.raises(DflashkitError, match="sampled tree round as one step at T > 0"):
        engine.sampled_round(None, Sampling(), None, tree=True)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_autoregressive_tokens_as_one_step_equal_verify_and_choose(target, drafter, temperature, monkeypatch):
    """The graphs engine's autoregressive step (the target step and the next token's choice on the device)
    gives, for a seed, the tokens of a verify call and the host's choice (one engine for both)."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=True)
    keys = record_step_keys(engine, monkeypatch)
    for prompt in prompts(11)[:2]:
        for top_p in (1.0, 0.9):
            out = {}
            for fused in (True, False):
                engine.fused_rounds = fused
                keys.clear()
                s = Sampling(temperature=temperature, top_p=top_p, seed=3)
                out[fused] = autoregressive_generate(target, prompt, 17, s, engine=engine).tokens
                assert ("next token" in keys) == fused and ("target" in keys) != fused
            assert out[True] == out[False]
    if temperature == 0:
        assert out[True] == autoregressive_generate(target, prompt, 17, layer_ids=LAYERS).tokens


class NoHostRead(TorchDispatchMode):
    """Fails on any op that reads a tensor's value on the host (a sync, which ends a CUDA graph capture)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in (torch.ops.aten._local_scalar_dense.default, torch.ops.aten.item.default):
            raise AssertionError(f"{func} reads the device on the host inside a captured step")
        return func(*args, **(kwargs or {}))


def test_graphs_engine_steps_never_read_the_device_on_the_host(target, drafter, monkeypatch):
    """Every step the graphs engine captures (target steps, the tree step, build, walk, keep, draft, the
    greedy round) runs without a host read of a tensor's value: on the CPU the steps run eagerly, so this
    is the check that they would capture on a GPU (the walk's `x[0-d tensor]` did not, and only a GPU run
    showed it)."""
    engine = GraphEngine(target, drafter, capacity=48, graphs=False, fixed_shapes=True, tree_budget=10)
    ran: set[str] = set()
    run = engine.steps.run

    def checked(key: tuple, step) -> None:  # type: ignore[no-untyped-def]
        ran.add(str(key[0]))
        with NoHostRead():
            run(key, step)

    monkeypatch.setattr(engine.steps, "run", checked)
    prompt = prompts(9)[0]
    ar = autoregressive_generate(target, prompt, 12, engine=engine)
    chain = speculative_generate(target, drafter, prompt, 12, engine=engine)
    tree = speculative_generate(target, drafter, prompt, 12, engine=engine, tree_budget=10)
    script = ScriptedTree(engine, prompt + ar.tokens)  # accepted branches whose rows keep must move
    branched = speculative_generate(target, drafter, prompt, 12, engine=script, tree_budget=10)
    assert chain.tokens == tree.tokens == branched.tokens == ar.tokens
    sampled = Sampling(temperature=1.0, top_p=0.9, rule="rejection", seed=0)
    assert len(speculative_generate(target, drafter, prompt, 12, sampled, engine=engine).tokens) == 12
    engine.fused_rounds = False  # the separate calls: the target step alone
    assert speculative_generate(target, drafter, prompt, 12, engine=engine).tokens == ar.tokens
    steps = {
        "target",
        "tree",
        "build",
        "walk",
        "keep",
        "draft",
        "round",
        "tree round",
        "sampled round",
        "next token",
    }
    assert ran == steps, ran


@pytest.mark.parametrize(("fixed_shapes", "walked"), [(False, False), (True, False), (True, True)])
def test_a_kept_tree_path_on_the_graphs_engine_leaves_the_caches_of_a_chain(
    target, drafter, fixed_shapes, walked
):
    """Verify a tree smaller than the engine's budget (padding nodes), keep a branch that is not the first
    nodes: the target cache rows, the logits, the drafter's next context and its next draft equal those of
    verifying that branch as a chain. `walked`: the tree sits in the engine's own inputs (as its build
    leaves it) and the engine's walk step finds the branch and writes the row moves that keep uses."""
    prompt = torch.tensor([prompts(9)[0]])
    #  0 - 1 - 2
    #   \- 3 - 4 - 5     the kept branch: 0, 3, 4, 5
    tree = DraftTree.of([900, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4])
    path, branch = [0, 3, 4, 5], torch.tensor([[900, 41, 42, 43]])

    def make():
        return GraphEngine(
            target, drafter, capacity=32, graphs=False, fixed_shapes=fixed_shapes, tree_budget=8
        )

    engine, reference = make(), make()
    with torch.no_grad():
        engine.prefill(prompt)
        if walked:  # the tree in the engine's inputs, padded to its budget (padding nodes: their own parents)
            width = engine._tree_inputs.shape[1]
            engine._tree_inputs[:, :6].copy_(tree.nodes)
            engine._tree_inputs[:2, 6:].zero_()
            engine._tree_inputs[2, 6:].copy_(torch.arange(6, width))
            tree = DraftTree(engine._tree_inputs)
        verified = engine.verify_tree(tree)
        if walked:  # the target's choices: 41 after the root, then 42, 43 along the branch, 7 at its end
            choices = torch.zeros(engine._tree_inputs.shape[1], dtype=torch.long)
            choices[[0, 3, 4, 5]] = torch.tensor([41, 42, 43, 7])
            assert engine.walk(tree, choices) == (path, [41, 42, 43, 7])
            assert engine._moves[0, :4].tolist() == [9 + node for node in path]
            assert engine._walked == path  # keep moves the rows the walk step wrote, nothing from the host
        context = engine.keep(verified, path)
        reference.prefill(prompt)
        chain = reference.verify(branch)  # B = 4 tokens: the block step
        chain_context = reference.keep(chain, [0, 1, 2, 3])
        torch.testing.assert_close(verified.logits[path], chain.logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(context.features, chain_context.features, atol=1e-4, rtol=1e-4)
        assert (context.start, context.end) == (chain_context.start, chain_context.end) == (9, 13)
        n = 9 + len(path)
        assert engine._length == reference._length == n
        for mine, theirs in zip(
            engine.cache.k + engine.cache.v, reference.cache.k + reference.cache.v, strict=True
        ):
            torch.testing.assert_close(mine[0, :n], theirs[0, :n], atol=1e-5, rtol=1e-5)
        # the drafter reads the kept rows: the next draft, and the next target step, are a chain's
        torch.testing.assert_close(
            engine.draft(context, 17), reference.draft(chain_context, 17), atol=1e-4, rtol=1e-4
        )
        block = torch.tensor([[17, 5, 6, 7]])
        torch.testing.assert_close(
            engine.verify(block).logits, reference.verify(block).logits, atol=1e-4, rtol=1e-4
        )


def test_graphs_engine_captures_only_when_asked(target, drafter):
    """The default off a GPU: eager steps with exact attention widths, whose warm-up is a no-op; Triton layers
    run fixed shapes."""
    engine = GraphEngine(target, drafter, capacity=24)
    assert not engine.graphs and not engine.fixed_shapes and engine.layers == "torch"
    warmed = engine.warm_up()
    assert warmed == {} and warmed.kernels_loaded == 0 and not warmed.notes
    assert GraphEngine(target, drafter, capacity=24, layers="triton").fixed_shapes


def tiny_target(folder):
    """A random 4-layer Llama (vocabulary 512): compiles in seconds where the embedded target takes minutes."""
    import transformers

    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=512,
        tie_word_embeddings=True,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return TargetModel.load(folder, dtype=torch.float32)


def tiny_pair(tmp_path, drafter_layers: int = 1):
    """The tiny target, a drafter of it (one layer unless told) reading layers [0, 2] (seed 1), and those
    layers."""
    tiny = tiny_target(tmp_path / "target")
    layers = [0, 2]
    cfg = config_for_target(
        tiny.config, num_layers=drafter_layers, block_size=B, mask_token_id=511, target_layer_ids=layers
    )
    torch.manual_seed(1)
    return tiny, DFlashDrafter(cfg).eval(), layers


def test_triton_layers_decode_as_the_reference_engine(tmp_path, monkeypatch):
    """layers="triton" on the CPU, the decoder kernels in Triton's interpreter: the chain's target steps and the
    draft step through the kernels; greedy tokens and acceptance lengths, of the one-step rounds and of the
    separate calls, equal the reference engine's token for token in fp32."""
    pytest.importorskip("triton")
    # a Triton folder of this test's own: kernels another process compiled there are not this warm-up's
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    from dflashkit.infer import graph_engine

    tiny, d, layers = tiny_pair(tmp_path)
    cache = tmp_path / "engine.compile-cache.triton"
    engine = GraphEngine(tiny, d, capacity=64, graphs=False, layers="triton", kernel_cache=cache)
    assert engine._target_fn is graph_engine.kernel_target_step
    assert engine._draft_fn is graph_engine.kernel_draft_step and engine._dcache is None
    warmed = engine.warm_up()
    assert list(warmed) == CHAIN_STEPS
    # Triton's interpreter compiles nothing: the kernels' cache has nothing to hold, which is a note only
    assert any("kernels' cache not written: no compiled kernel" in n for n in warmed.notes), warmed.notes
    prompt = torch.randint(5, 500, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    ar = autoregressive_generate(tiny, prompt, 14, layer_ids=layers)
    # a one-token step in the interpreter takes ~4 s: 7 of them, then this drafter's rounds (each accepts
    # one token) over 7 as well; the scripted rounds below cover every acceptance length over all 14
    short = autoregressive_generate(tiny, prompt, 7, engine=engine).tokens
    assert short == ar.tokens[:7]
    for fused in (True, False):  # one-step rounds, then draft, verify and keep as separate calls
        engine.fused_rounds = fused
        ours, dyn = (speculative_generate(tiny, d, prompt, 7, engine=e) for e in (engine, "reference"))
        assert ours.tokens == dyn.tokens == short and ours.accept_lengths == dyn.accept_lengths
    scripted = [
        speculative_generate(tiny, d, prompt, 14, engine=ScriptedDrafts(e, prompt + ar.tokens))
        for e in (ReferenceEngine(tiny, d), engine)
    ]
    assert scripted[0].tokens == scripted[1].tokens == ar.tokens
    assert (
        scripted[0].accept_lengths == scripted[1].accept_lengths and len(set(scripted[1].accept_lengths)) > 2
    )


def test_triton_layers_tree_rounds_decode_as_autoregressive(tmp_path, monkeypatch):
    """layers="triton" with a tree budget on the CPU (the kernels in Triton's interpreter): the tree step goes
    through the decoder kernels under the tree's own mask, the build, the walk and the keep through a kernel
    each (a round's build from the drafted logits); greedy tree rounds, the real drafter's and scripted ones
    whose accepted branches move rows, decode as autoregressive decoding with the reference engine's
    acceptance lengths."""
    pytest.importorskip("triton")
    from dflashkit.infer import graph_engine

    kernel_tree_step = graph_engine.kernel_tree_step
    tiny, d, layers = tiny_pair(tmp_path)
    budget = 6
    engine = GraphEngine(tiny, d, capacity=64, graphs=False, layers="triton", tree_budget=budget)
    assert engine._walk_fn is graph_engine.kernel_walk_step
    assert engine._build_fn is graph_engine.kernel_build_step
    calls, builds, keeps = [], [], []
    monkeypatch.setattr(graph_engine, "kernel_tree_step", lambda *a: calls.append(1) or kernel_tree_step(*a))
    logits_build = graph_engine.kernel_logits_build_step
    monkeypatch.setattr(
        graph_engine, "kernel_logits_build_step", lambda *a: builds.append(1) or logits_build(*a)
    )
    kernel_keep = graph_engine.kernel_keep_step
    monkeypatch.setattr(graph_engine, "kernel_keep_step", lambda *a: keeps.append(1) or kernel_keep(*a))
    prompt = torch.randint(5, 500, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    eager = GraphEngine(tiny, d, capacity=64, graphs=False, fixed_shapes=True, tree_budget=budget)
    for e in (engine, eager):
        e.prefill(torch.tensor([prompt]))
    tree = DraftTree.of([400, 31, 32, 41, 42, 43], [-1, 0, 1, 0, 3, 4])
    ours, theirs = engine.verify_tree(tree), eager.verify_tree(tree)
    torch.testing.assert_close(ours.logits, theirs.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours.features, theirs.features, atol=1e-4, rtol=1e-4)
    assert calls, "the tree step did not go through the kernels"
    ar = autoregressive_generate(tiny, prompt, 14, layer_ids=layers).tokens
    # this drafter's rounds each accept one token (a tree round ~2.5 s in the interpreter): 7 of them; the
    # scripted rounds below take branches over all 14
    dyn = speculative_generate(tiny, d, prompt, 7, tree_budget=budget)
    real = speculative_generate(tiny, d, prompt, 7, engine=engine, tree_budget=budget)
    assert real.tokens == dyn.tokens == ar[:7] and real.accept_lengths == dyn.accept_lengths
    assert len(builds) == len(real.accept_lengths) > 0, (
        "each greedy tree round built its tree from the logits"
    )
    script = ScriptedTree(engine, prompt + ar)
    scripted = speculative_generate(tiny, d, prompt, 14, engine=script, tree_budget=budget)
    assert scripted.tokens == ar and any(p != list(range(len(p))) for p in script.paths)
    assert keeps, "the keep step did not go through its kernel"


def test_triton_layers_build_a_large_tree_with_torch(tmp_path, monkeypatch):
    """A tree whose candidate table is beyond the build kernel's one program (64 nodes below 15 slots: 29,934
    branches; its kernel did not finish compiling) is built by torch's top-k on the Triton layers: the engine
    says so by its build step, the kernel refuses such a table in words, and the tree rounds still decode as
    autoregressive decoding (the limit lowered here, so that the tiny drafter's table passes it)."""
    pytest.importorskip("triton")
    from dflashkit.infer import graph_engine
    from dflashkit.infer.kernels import tree as tree_kernels
    from dflashkit.infer.tree import tree_candidates

    big = tree_candidates(15, 49152, 64)
    assert not tree_kernels.builds(big.shape[1]) and tree_kernels.builds(
        tree_candidates(15, 49152, 32).shape[1]
    )
    with pytest.raises(ValueError, match="build this tree with tree.build_tree"):
        tree_kernels.build(
            torch.zeros(1, dtype=torch.long), torch.rand(15, 49152), big, torch.zeros(3, 65, dtype=torch.long)
        )
    tiny, d, layers = tiny_pair(tmp_path)
    budget = 6
    table = tree_candidates(d.config.block_size - 1, tiny.config.vocab_size, budget).shape[1]
    small = GraphEngine(tiny, d, capacity=64, graphs=False, layers="triton", tree_budget=budget)
    assert small._build_fn is graph_engine.kernel_build_step
    monkeypatch.setattr(tree_kernels, "MAX_BUILD_CANDIDATES", tree_kernels._block(table) // 2)
    engine = GraphEngine(tiny, d, capacity=64, graphs=False, layers="triton", tree_budget=budget)
    assert engine._build_fn is graph_engine.tree_build_step
    builds = []
    monkeypatch.setattr(
        graph_engine,
        "kernel_logits_build_step",
        lambda *a: builds.append(1),  # must not run
    )
    prompt = torch.randint(5, 500, (9,), generator=torch.Generator().manual_seed(9)).tolist()
    ar = autoregressive_generate(tiny, prompt, 4, layer_ids=layers).tokens
    out = speculative_generate(tiny, d, prompt, 4, engine=engine, tree_budget=budget)
    assert out.tokens == ar and not builds
