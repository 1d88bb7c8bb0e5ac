"""The graphs engine (the fused target forward, one CUDA graph per step on a GPU) decodes exactly as the
dynamic engine in fp32: eager with exact attention widths, and with the fixed shapes a graph needs."""

import pytest
import torch

import test_engine
from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import DynamicEngine, make_engine, ready_engine
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.speculative import autoregressive_generate, speculative_generate
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.embedded import MASK_TOKEN_ID
from dflashkit.target.hf import TargetModel
from test_engine import LAYERS, ScriptedDrafts, prompts

target, drafter = test_engine.target, test_engine.drafter  # the same module-scoped fixtures (B = 4)

B = test_engine.B


@pytest.mark.parametrize("fixed_shapes", [False, True])
def test_graphs_engine_decodes_as_the_dynamic_engine(target, drafter, fixed_shapes):
    """Greedy tokens and per-round acceptance lengths: AR, the real drafter, and scripted drafts (every
    acceptance length, every crop). One engine serves every prompt and both loops."""
    engine = GraphEngine(target, drafter, capacity=64, graphs=False, fixed_shapes=fixed_shapes)
    for prompt in prompts(5, 13):
        ar = autoregressive_generate(target, prompt, 20, layer_ids=LAYERS)
        assert autoregressive_generate(target, prompt, 20, engine=engine).tokens == ar.tokens
        dyn = speculative_generate(target, drafter, prompt, 20)
        ours = speculative_generate(target, drafter, prompt, 20, engine=engine)
        assert ours.tokens == dyn.tokens == ar.tokens and ours.accept_lengths == dyn.accept_lengths
        scripted = {}
        for name, e in (("dynamic", DynamicEngine(target, drafter)), ("graphs", engine)):
            g = speculative_generate(
                target, drafter, prompt, 20, engine=ScriptedDrafts(e, prompt + ar.tokens)
            )
            assert g.tokens == ar.tokens
            scripted[name] = g.accept_lengths
        assert scripted["graphs"] == scripted["dynamic"]
        assert set(scripted["graphs"][:-1]) == set(range(1, B + 1))


def test_graphs_engine_draft_and_verify_logits_match_the_dynamic_engine(target, drafter):
    """The drafter's logits (context written from the prompt, then from a verified block, with a rejected
    tail) and the target's block logits agree with the dynamic engine's to fp32 rounding."""
    prompt = torch.tensor([prompts(11)[0]])
    ref, ours = DynamicEngine(target, drafter), GraphEngine(target, drafter, capacity=48, graphs=False)
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
    with pytest.raises(DflashkitError, match=r"verifies chains only.*\(--engine dynamic or static\)"):
        speculative_generate(target, drafter, prompts(5)[0], 4, engine=engine, tree_budget=4)
    if not torch.cuda.is_available():
        with pytest.raises(DflashkitError, match="needs the target on a GPU"):
            GraphEngine(target, drafter, capacity=24, graphs=True)
    assert isinstance(make_engine("graphs", target, drafter, capacity=24), GraphEngine)
    engine, warm = ready_engine("graphs", target, drafter, capacity=24)
    assert isinstance(engine, GraphEngine) and warm == {}  # the CPU: eager, nothing to capture


@pytest.mark.gpu
def test_graphs_engine_replays_cuda_graphs_on_gpu():
    """On CUDA (fp32, so the attention is the masked reference over the whole capacity): each step shape
    is captured once at warm-up and replayed after; the same greedy output and acceptance lengths as the
    dynamic engine, with scripted drafts (every acceptance length and crop)."""
    gpu = TargetModel.load("embedded", device="cuda")
    cfg = config_for_target(
        gpu.config, num_layers=1, block_size=B, mask_token_id=MASK_TOKEN_ID, target_layer_ids=LAYERS
    )
    torch.manual_seed(1)
    d = DFlashDrafter(cfg).cuda().eval()
    engine = GraphEngine(gpu, d, capacity=128)
    warmed = engine.warm_up()
    assert list(warmed) == ["target [1, 1]", f"target [1, {B}]", f"draft [1, {B}]"] and len(engine.steps) == 3
    for prompt in prompts(5, 13, 40):
        ar = autoregressive_generate(gpu, prompt, 48, layer_ids=LAYERS)
        assert autoregressive_generate(gpu, prompt, 48, engine=engine).tokens == ar.tokens
        ref = speculative_generate(
            gpu, d, prompt, 48, engine=ScriptedDrafts(DynamicEngine(gpu, d), prompt + ar.tokens)
        )
        ours = speculative_generate(gpu, d, prompt, 48, engine=ScriptedDrafts(engine, prompt + ar.tokens))
        assert ours.tokens == ref.tokens == ar.tokens and ours.accept_lengths == ref.accept_lengths
    assert len(engine.steps) == 3, "a step was captured after warm-up"


def test_auto_engine_is_the_fastest_lossless_one(target):
    """--engine auto: the graphs engine on a GPU, the dynamic engine on the CPU; --help spells the same
    choices as the engine module (without importing torch)."""
    from dflashkit.commands.infer import ENGINE_CHOICES
    from dflashkit.infer.engine import ENGINE_CHOICES as choices
    from dflashkit.infer.engine import resolve_engine

    assert choices == ENGINE_CHOICES
    assert resolve_engine("auto", target) == ("graphs" if target.device.type == "cuda" else "dynamic")
    assert resolve_engine("static", target) == "static"
