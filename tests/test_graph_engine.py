"""The graphs engine (the fused target forward, one CUDA graph per step on a GPU) decodes exactly as the
dynamic engine in fp32: eager with exact attention widths, with the fixed shapes a graph needs, and with
its steps compiled (warmed up once, nothing compiled after, a second engine warm from the portable cache)."""

import pytest
import torch

from dflashkit.errors import DflashkitError
from dflashkit.infer.engine import DynamicEngine, make_engine, ready_engine
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.speculative import autoregressive_generate, speculative_generate
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.embedded import MASK_TOKEN_ID
from dflashkit.target.hf import TargetModel
from test_engine import LAYERS, ScriptedDrafts, prompts

B = 4


@pytest.fixture(scope="module")
def target():
    return TargetModel.load("embedded")


@pytest.fixture(scope="module")
def drafter(target):
    cfg = config_for_target(
        target.config, num_layers=1, block_size=B, mask_token_id=MASK_TOKEN_ID, target_layer_ids=LAYERS
    )
    torch.manual_seed(1)
    return DFlashDrafter(cfg).eval()


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
    engine = GraphEngine(gpu, d, capacity=128, compile=False)
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


def test_graphs_engine_compiles_on_a_gpu_only(target, drafter):
    """The default: compiled steps with graphs (a GPU), eager on the CPU (a compile there costs minutes);
    a compiled engine runs fixed shapes; an eager CPU engine's warm-up is a no-op that compiled nothing."""
    engine = GraphEngine(target, drafter, capacity=24)
    assert not engine.compiled and not engine.graphs and not engine.fixed_shapes
    warmed = engine.warm_up()
    assert warmed == {} and not warmed.cache_warm and warmed.compiled == 0
    assert GraphEngine(target, drafter, capacity=24, compile=True).fixed_shapes
    with pytest.raises(DflashkitError, match="runs fixed shapes"):
        GraphEngine(target, drafter, capacity=24, compile=True, fixed_shapes=False)


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


def decodes_as_dynamic(target, drafter, engine, layers):
    """AR tokens, the real drafter's rounds, and scripted drafts (every acceptance length) as the dynamic
    engine's, token for token."""
    for n in (5, 13):
        prompt = torch.randint(5, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
        ar = autoregressive_generate(target, prompt, 20, layer_ids=layers)
        assert autoregressive_generate(target, prompt, 20, engine=engine).tokens == ar.tokens
        dyn = speculative_generate(target, drafter, prompt, 20)
        ours = speculative_generate(target, drafter, prompt, 20, engine=engine)
        assert ours.tokens == dyn.tokens == ar.tokens and ours.accept_lengths == dyn.accept_lengths
        scripted = [
            speculative_generate(target, drafter, prompt, 20, engine=ScriptedDrafts(e, prompt + ar.tokens))
            for e in (DynamicEngine(target, drafter), engine)
        ]
        assert scripted[0].tokens == scripted[1].tokens == ar.tokens
        assert scripted[0].accept_lengths == scripted[1].accept_lengths
        assert set(scripted[1].accept_lengths[:-1]) == set(range(1, B + 1))


@pytest.mark.slow
def test_compiled_graphs_engine_decodes_as_the_dynamic_engine(tmp_path):
    """compile=True on the CPU (the compiled steps run without graphs): warm-up compiles each step shape
    once and writes the portable cache; greedy tokens and acceptance lengths equal the dynamic engine's;
    nothing compiles after warm-up (a step that would is an error); a second engine, after dynamo's
    caches are cleared and with an empty Inductor cache, warms from the portable file alone."""
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    from dflashkit.infer import graph_engine
    from dflashkit.runtime.compile import CompileAfterWarmupError, is_frozen

    tiny = tiny_target(tmp_path / "target")
    layers = [0, 2]
    cfg = config_for_target(tiny.config, num_layers=1, block_size=B, mask_token_id=511, target_layer_ids=layers)
    torch.manual_seed(1)
    d = DFlashDrafter(cfg).eval()
    cache = tmp_path / "graphs.cache"
    engine = GraphEngine(tiny, d, capacity=64, graphs=False, compile=True, compile_cache=cache)
    warmed = engine.warm_up()
    assert list(warmed) == ["target [1, 1]", f"target [1, {B}]", f"draft [1, {B}]"] and not is_frozen()
    assert warmed.compiled == 3 and not warmed.cache_warm and cache.is_file()
    regions = (graph_engine.TARGET_STEP, graph_engine.DRAFT_STEP)
    graphs = [r.graphs() for r in regions]
    assert graphs == [2, 1]
    decodes_as_dynamic(tiny, d, engine, layers)
    assert [r.graphs() for r in regions] == graphs, "compiled after warm-up"
    engine._kv_len = lambda t: engine.capacity - 1  # a step shape that was never warmed
    with pytest.raises(CompileAfterWarmupError, match="target step would compile after warm-up"):
        engine.verify(torch.zeros(1, 1, dtype=torch.long))
    assert not is_frozen()

    with temporary_cache_dir(str(tmp_path / "empty-inductor-cache")):
        torch._dynamo.reset()
        second = GraphEngine(tiny, d, capacity=64, graphs=False, compile=True, compile_cache=cache)
        rewarmed = second.warm_up()
        assert rewarmed.cache_loaded and rewarmed.cache_warm and rewarmed.cached == 3
        decodes_as_dynamic(tiny, d, second, layers)


@pytest.mark.gpu
def test_compiled_graphs_engine_replays_as_the_eager_graphs_engine_on_gpu():
    """On CUDA in fp32: the compiled steps, captured as CUDA graphs, replay and decode as the eager graphs
    engine (and the dynamic engine), with nothing captured or compiled after warm-up."""
    gpu = TargetModel.load("embedded", device="cuda")
    cfg = config_for_target(
        gpu.config, num_layers=1, block_size=B, mask_token_id=MASK_TOKEN_ID, target_layer_ids=LAYERS
    )
    torch.manual_seed(1)
    d = DFlashDrafter(cfg).cuda().eval()
    eager = GraphEngine(gpu, d, capacity=128, compile=False)
    fused = GraphEngine(gpu, d, capacity=128)
    assert fused.compiled and fused.graphs and not eager.compiled
    eager.warm_up()
    warmed = fused.warm_up()
    assert list(warmed) == ["target [1, 1]", f"target [1, {B}]", f"draft [1, {B}]"] and len(fused.steps) == 3
    for prompt in prompts(5, 13, 40):
        ar = autoregressive_generate(gpu, prompt, 48, layer_ids=LAYERS)
        for engine in (eager, fused):
            assert autoregressive_generate(gpu, prompt, 48, engine=engine).tokens == ar.tokens
        ref, ours = (
            speculative_generate(gpu, d, prompt, 48, engine=ScriptedDrafts(e, prompt + ar.tokens))
            for e in (eager, fused)
        )
        assert ours.tokens == ref.tokens == ar.tokens and ours.accept_lengths == ref.accept_lengths
        real = [speculative_generate(gpu, d, prompt, 48, engine=e) for e in (eager, fused)]
        assert real[0].tokens == real[1].tokens and real[0].accept_lengths == real[1].accept_lengths
    context = eager.prefill(torch.tensor([prompts(11)[0]], device="cuda"))[1]
    fused.prefill(torch.tensor([prompts(11)[0]], device="cuda"))
    torch.testing.assert_close(fused.draft(context, 17), eager.draft(context, 17), atol=1e-3, rtol=1e-4)
    assert len(fused.steps) == 3, "a step was captured after warm-up"
