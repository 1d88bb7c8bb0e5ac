"""bf16 on a CPU: the graphs engine packs every target weight once for oneDNN (`DecoderWeights.pack_for_cpu`).
A matmul through the packed weight gives the very numbers of ``F.linear`` (and of ``addmm_`` for the residual
adds); the engine packs only where it pays (bf16, a CPU with native bf16 matmuls, eager steps), and its
steps give the very logits and tokens of the unpacked engine."""

import pytest
import torch
import torch.nn.functional as F

from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.speculative import autoregressive_generate, speculative_generate
from dflashkit.model.config import config_for_target
from dflashkit.model.drafter import DFlashDrafter
from dflashkit.target.hf import TargetModel
from dflashkit.target.slot_decoder import cpu_packing_pays, linear, pack_weight
from test_engine import LAYERS, MASK_TOKEN_ID, prompts

CPU = torch.device("cpu")
needs_bf16 = pytest.mark.skipif(
    not cpu_packing_pays(CPU, torch.bfloat16), reason="this CPU's oneDNN has no native bf16 matmul"
)


def test_packing_pays_only_for_bf16_on_a_cpu():
    assert not cpu_packing_pays(CPU, torch.float32)
    assert not cpu_packing_pays(torch.device("cuda"), torch.bfloat16)


@needs_bf16
@pytest.mark.parametrize("shape", [(1, 576), (8, 576), (2, 8, 576), (37, 576)])
def test_a_packed_matmul_gives_the_numbers_of_f_linear(shape):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).bfloat16()
    w = torch.randn(960, 576, generator=g).bfloat16()
    b = torch.randn(960, generator=g).bfloat16()
    p = pack_weight(w)
    assert torch.equal(linear(x, w, packed=p), F.linear(x, w))
    assert torch.equal(linear(x, w, b, packed=p), F.linear(x, w, b))
    assert torch.equal(linear(x, w), F.linear(x, w))  # no packed copy: F.linear itself
    # the residual add as the matmul's post-op: addmm_'s numbers
    from dflashkit.target.slot_decoder import _add_linear_

    h = torch.randn(*shape[:-1], 960, generator=g).bfloat16()
    ours, ref = x.clone(), x.clone()
    _add_linear_(ours, h, w.t().contiguous(), pack_weight(w.t().contiguous()))
    _add_linear_(ref, h, w.t().contiguous())
    assert torch.equal(ours, ref)


@pytest.fixture(scope="module")
def target16():
    return TargetModel.load("embedded", dtype=torch.bfloat16)


@needs_bf16
def test_the_bf16_graphs_engine_packs_and_decodes_as_the_unpacked_one(target16):
    cfg = config_for_target(
        target16.config, num_layers=1, block_size=4, mask_token_id=MASK_TOKEN_ID, target_layer_ids=LAYERS
    )
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg).to(dtype=torch.bfloat16).eval()
    packed = GraphEngine(target16, drafter, capacity=64)
    plain = GraphEngine(target16, drafter, capacity=64)
    plain.w.lm_head_packed = None
    for layer in plain.w.layers:
        layer.packed = {}
    assert packed.packed and packed.w.lm_head_packed is not None
    assert all(set(layer.packed) == {"qkv", "o", "gate_up", "down"} for layer in packed.w.layers)
    # the Triton kernels read plain tensors: an engine of Triton layers never packs
    assert not GraphEngine(target16, drafter, capacity=64, layers="triton").packed

    prompt = torch.tensor([prompts(13)[0]])
    (lp, cp), (lu, cu) = packed.prefill(prompt), plain.prefill(prompt)
    assert torch.equal(lp, lu)
    assert torch.equal(packed.draft(cp, 17), plain.draft(cu, 17))
    block = torch.tensor([[17, 5, 6, 7]])
    assert torch.equal(packed.verify(block).logits, plain.verify(block).logits)
    one = torch.tensor([[923]])
    assert torch.equal(packed.verify(one).logits, plain.verify(one).logits)

    # whole greedy decodes: the same tokens and acceptance lengths on either engine
    for prompt in prompts(11, 17):
        a, b = (autoregressive_generate(target16, prompt, 12, engine=e) for e in (packed, plain))
        assert a.tokens == b.tokens
        a, b = (speculative_generate(target16, drafter, prompt, 12, engine=e) for e in (packed, plain))
        assert a.tokens == b.tokens and a.accept_lengths == b.accept_lengths


@needs_bf16
def test_bf16_generation_on_a_cpu_packs_and_gives_the_unpacked_replies():
    """`prepare`'s generator (the slots backend) packs in bf16 on a CPU; its replies are the unpacked ones."""
    from dflashkit.data.generator import SlotGenerator, SlotSettings
    from test_generator import EOS, ListSource, random_requests, tiny

    model = tiny("qwen3").to(torch.bfloat16)
    requests = random_requests(9)
    settings = SlotSettings(slots=4, capacity=128, prefill_rows=3, max_chunk=16)
    replies = {}
    for packs in (True, False):
        gen = SlotGenerator.create(model, EOS, settings)
        assert gen.w.lm_head_packed is not None
        if not packs:
            gen.w.lm_head_packed = None
            for layer in gen.w.layers:
                layer.packed = {}
        source = ListSource(requests)
        gen.run(source)
        replies[packs] = source.replies
    assert replies[True] == replies[False] and len(replies[True]) == len(requests)
