"""The drafter: shapes, an independent naive implementation, training forward == block-by-block
inference through the draft cache, masks per layer type, RoPE against transformers, config checks."""

import math

import pytest
import torch
import torch.nn.functional as F

from dflashkit.attention.backends import AttentionMask
from dflashkit.attention.masks import BlockLayout, dense_mask
from dflashkit.errors import ConfigError
from dflashkit.model.config import DrafterConfig, default_target_layer_ids, make_config
from dflashkit.model.drafter import DFlashDrafter, DraftCache, Rotary, build_block_masks

BACKENDS = ["eager", "sdpa"]


def tiny_config(**over) -> DrafterConfig:
    fields = dict(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=97,
        block_size=4,
        target_layer_ids=[1, 3, 4],
        num_target_layers=6,
        mask_token_id=5,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
    )
    fields.update(over)
    return make_config(**fields)


def random_drafter(config: DrafterConfig, seed: int = 0) -> DFlashDrafter:
    torch.manual_seed(seed)
    d = DFlashDrafter(config)
    with torch.no_grad():  # norms away from 1 so that a wrong norm weight shows
        for name, p in d.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2)
    return d.eval()


def reference_masks(config, layout, backend):
    """Masks straight from the dense reference (independent of the flex/preflight machinery)."""
    out = {}
    for t in set(config.layer_types):
        sliding = t == "sliding_attention"
        m = dense_mask(layout, window=config.sliding_window if sliding else None, causal_in_block=sliding)
        out[t] = AttentionMask(backend, dense=m, rows_visible=m.any(-1, keepdim=True))
    return out


# --- an independent naive implementation: loops and plain matmuls --------------------------------


def naive_visible(anchors, doc_ids, B, window=None):
    """visible[b][q][kv] by the DFlash rule, written out with loops. A sliding layer (``window``) is causal
    sliding-window attention over positions: slot k (at a + k) sees slot k2 (at a + k2) iff
    k - window < k2 <= k."""
    batch, N = anchors.shape
    S = doc_ids.shape[1]
    vis = torch.zeros(batch, N * B, S + N * B, dtype=torch.bool)
    for b in range(batch):
        for j in range(N):
            a = int(anchors[b, j])
            for k in range(B):
                q = j * B + k
                for s in range(S):
                    ok = s < a and doc_ids[b, s] == doc_ids[b, a] and doc_ids[b, s] >= 0
                    if window is not None:
                        ok = ok and (a + k) - s < window
                    vis[b, q, s] = ok
                for k2 in range(B):
                    vis[b, q, S + j * B + k2] = window is None or k - window < k2 <= k
    return vis


def naive_forward(d: DFlashDrafter, feats, embeds, ctx_pos, blk_pos, visible_by_type):
    c = d.config
    sd = {k: v.double() for k, v in d.state_dict().items()}
    D, Hq, Hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv_freq = [1.0 / c.rope_theta ** (2 * i / D) for i in range(D // 2)]

    def rms(x, w):
        return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, pos):  # x [T, D]; rotate each pair (x[i], x[i + D/2]) by pos * inv_freq[i]
        out = x.clone()
        for t in range(x.shape[0]):
            for i in range(D // 2):
                ang = float(pos[t]) * inv_freq[i]
                x1, x2 = x[t, i], x[t, i + D // 2]
                out[t, i] = x1 * math.cos(ang) - x2 * math.sin(ang)
                out[t, i + D // 2] = x2 * math.cos(ang) + x1 * math.sin(ang)
        return out

    feats, h = feats.double(), embeds.double()
    ctx = rms(feats @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    for li in range(c.num_hidden_layers):
        p = f"layers.{li}."
        visible = visible_by_type[c.layer_types[li]]
        x = rms(h, sd[p + "input_layernorm.weight"])
        attn = torch.zeros_like(h)
        for b in range(h.shape[0]):
            src = torch.cat([ctx[b], x[b]])
            pos = torch.cat([ctx_pos[b], blk_pos[b]])
            q = (x[b] @ sd[p + "self_attn.q_proj.weight"].T).view(-1, Hq, D)
            k = (src @ sd[p + "self_attn.k_proj.weight"].T).view(-1, Hkv, D)
            v = (src @ sd[p + "self_attn.v_proj.weight"].T).view(-1, Hkv, D)
            q = rms(q, sd[p + "self_attn.q_norm.weight"])
            k = rms(k, sd[p + "self_attn.k_norm.weight"])
            q = torch.stack([rope(q[:, hh], blk_pos[b]) for hh in range(Hq)], 1)
            k = torch.stack([rope(k[:, hh], pos) for hh in range(Hkv)], 1)
            out = torch.zeros(q.shape[0], Hq, D, dtype=torch.float64)
            for qi in range(q.shape[0]):
                idx = visible[b, qi].nonzero().flatten()
                for hh in range(Hq):
                    g = hh // (Hq // Hkv)
                    scores = (k[idx, g] @ q[qi, hh]) / math.sqrt(D)
                    out[qi, hh] = torch.softmax(scores, 0) @ v[idx, g]
            attn[b] = out.reshape(q.shape[0], Hq * D) @ sd[p + "self_attn.o_proj.weight"].T
        h = h + attn
        y = rms(h, sd[p + "post_attention_layernorm.weight"])
        mlp = F.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T)
        h = h + mlp @ sd[p + "mlp.down_proj.weight"].T
    return rms(h, sd["norm.weight"])


def training_inputs(config, anchors, doc_ids, seed=1):
    """Random features/embeddings for one batch and the block positions implied by the anchors."""
    g = torch.Generator().manual_seed(seed)
    batch, S = doc_ids.shape
    B = config.block_size
    feats = torch.randn(batch, S, config.num_context_features, generator=g)
    embeds = torch.randn(batch, anchors.shape[1] * B, config.hidden_size, generator=g)
    # positions restart in every document (packed rows)
    ctx_pos = torch.zeros(batch, S, dtype=torch.long)
    for b in range(batch):
        for s in range(1, S):
            ctx_pos[b, s] = 0 if doc_ids[b, s] != doc_ids[b, s - 1] else ctx_pos[b, s - 1] + 1
    blk_pos = (torch.gather(ctx_pos, 1, anchors)[:, :, None] + torch.arange(B)).reshape(batch, -1)
    return feats, embeds, ctx_pos, blk_pos


ANCHORS = torch.tensor([[2, 5, 9], [1, 4, 11]])
DOCS = torch.tensor([[0] * 14, [0] * 7 + [1] * 7])  # row 1 packs two documents


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_naive_implementation(backend):
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    d = random_drafter(config)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, config.block_size)
    with torch.no_grad():
        got = d(feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout, backend), backend)
    visible = {
        "full_attention": naive_visible(ANCHORS, DOCS, config.block_size),
        "sliding_attention": naive_visible(ANCHORS, DOCS, config.block_size, window=3),
    }
    want = naive_forward(d, feats, embeds, ctx_pos, blk_pos, visible)
    assert got.shape == (2, 3 * config.block_size, config.hidden_size) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sliding", [False, True])
def test_training_forward_equals_block_by_block_drafting(backend, sliding):
    """The training mask, RoPE positions and the draft cache agree: every training block equals an
    inference `draft` over the same context rows (cache grown row by row, and grown then cropped)."""
    over = dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4) if sliding else {}
    config = tiny_config(**over)
    d = random_drafter(config, seed=3)
    B = config.block_size
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS, seed=4)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, B)
    with torch.no_grad():
        train = d(feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout, backend), backend)
        for b in range(ANCHORS.shape[0]):
            doc_start = int((DOCS[b] == DOCS[b, ANCHORS[b, 0]]).nonzero()[0])
            grown = d.new_cache()
            fed = doc_start
            for j in range(ANCHORS.shape[1]):
                a = int(ANCHORS[b, j])
                if DOCS[b, a] != DOCS[b, doc_start]:  # a new document: a fresh cache
                    doc_start = int((DOCS[b] == DOCS[b, a]).nonzero()[0])
                    grown, fed = d.new_cache(), doc_start
                blk = slice(j * B, (j + 1) * B)
                out = d.draft(
                    feats[b : b + 1, fed:a],
                    ctx_pos[b : b + 1, fed:a],
                    embeds[b : b + 1, blk],
                    blk_pos[b : b + 1, blk],
                    grown,
                    backend,
                )
                fed = a
                assert len(grown) == a - doc_start  # context rows only: the block was not kept
                torch.testing.assert_close(out[0], train[b, blk], rtol=1e-5, atol=1e-5)

                # the same block after caching the whole document and cropping back to the anchor
                doc_end = int((DOCS[b] == DOCS[b, a]).nonzero()[-1]) + 1
                full = d.new_cache()
                d.draft(
                    feats[b : b + 1, doc_start:doc_end],
                    ctx_pos[b : b + 1, doc_start:doc_end],
                    embeds[b : b + 1, blk],
                    blk_pos[b : b + 1, blk],
                    full,
                    backend,
                )
                full.crop(a - doc_start)
                empty = feats[b : b + 1, :0]
                out2 = d.draft(
                    empty,
                    ctx_pos[b : b + 1, :0],
                    embeds[b : b + 1, blk],
                    blk_pos[b : b + 1, blk],
                    full,
                    backend,
                )
                torch.testing.assert_close(out2[0], train[b, blk], rtol=1e-5, atol=1e-5)


def test_invalid_blocks_give_zero_attention_and_do_not_disturb_others():
    config = tiny_config()
    d = random_drafter(config)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)
    valid = torch.tensor([[True, False, True], [True, True, True]])
    layout_all = BlockLayout(ANCHORS, torch.ones_like(valid), DOCS, config.block_size)
    layout_pad = BlockLayout(ANCHORS, valid, DOCS, config.block_size)
    with torch.no_grad():
        a = d(feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout_all, "sdpa"), "sdpa")
        b = d(feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout_pad, "sdpa"), "sdpa")
    B = config.block_size
    keep = torch.ones(2, 3 * B, dtype=torch.bool)
    keep[0, B : 2 * B] = False
    torch.testing.assert_close(a[keep], b[keep])
    assert torch.isfinite(b).all()


def test_gradients_reach_every_parameter():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    d = random_drafter(config).train()
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, config.block_size)
    d(
        feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout, "sdpa"), "sdpa"
    ).square().mean().backward()
    for name, p in d.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_build_block_masks_gives_the_reference_masks():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, config.block_size)
    got = build_block_masks(config, layout, "sdpa")
    want = reference_masks(config, layout, "sdpa")
    assert set(got) == {"full_attention", "sliding_attention"}
    for t in got:
        assert torch.equal(got[t].dense, want[t].dense)


def test_sliding_drafter_refuses_a_single_mask():
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    d = random_drafter(config)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, config.block_size)
    single = reference_masks(config, layout, "sdpa")["full_attention"]
    with pytest.raises(ValueError, match="one mask per layer type"):
        d(feats, embeds, ctx_pos, blk_pos, single, "sdpa")


def test_shapes_and_dtypes_in_bf16():
    config = tiny_config()
    d = random_drafter(config).to(torch.bfloat16)
    B = config.block_size
    cache = d.new_cache()
    out = d.draft(
        torch.randn(1, 7, config.num_context_features),  # fp32 features are cast to the drafter's dtype
        torch.arange(7)[None],
        torch.randn(1, B, config.hidden_size, dtype=torch.bfloat16),
        torch.arange(7, 7 + B)[None],
        cache,
        "sdpa",
    )
    assert out.shape == (1, B, config.hidden_size) and out.dtype == torch.bfloat16
    assert len(cache) == 7 and cache.keys[0].shape == (1, config.num_key_value_heads, 7, config.head_dim)
    assert cache.keys[0].dtype == torch.bfloat16
    with pytest.raises(ValueError, match="crop"):
        cache.crop(8)


def test_draft_cache_append_and_crop():
    cache = DraftCache(2)
    for layer in range(2):
        cache.append(layer, torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4))
    cache.append_positions(torch.arange(3)[None])
    k, _ = cache.append(0, torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    cache.append(1, torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 2, 4))
    cache.append_positions(torch.arange(3, 5)[None])
    assert k.shape[2] == 5 and len(cache) == 5
    cache.crop(3)
    assert len(cache) == 3 and all(
        t.shape[2] == 3 and bool((t == 1).all()) for t in cache.keys + cache.values
    )
    assert cache.positions.tolist() == [[0, 1, 2]]


@pytest.mark.parametrize(
    "scaling",
    [
        None,
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_matches_transformers(scaling):
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = tiny_config(rope_scaling=scaling, max_position_embeddings=256)
    hf = Qwen3Config(
        hidden_size=32,
        num_attention_heads=4,
        head_dim=8,
        max_position_embeddings=256,
        rope_parameters={"rope_theta": 10000.0, **(scaling or {"rope_type": "default"})},
    )
    pos = torch.tensor([[0, 3, 17, 200]])
    want_cos, want_sin = Qwen3RotaryEmbedding(hf)(torch.zeros(1, dtype=torch.float32), pos)
    cos, sin = Rotary(config)(pos, torch.float32)
    torch.testing.assert_close(cos, want_cos)
    torch.testing.assert_close(sin, want_sin)


def test_default_target_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert default_target_layer_ids(30, 1) == [15]
    assert default_target_layer_ids(30, 5) == [round(1 + i * 26 / 4) for i in range(5)]


@pytest.mark.parametrize(
    "over, message",
    [
        (dict(block_size=1), "block_size must be at least 2"),
        (dict(num_key_value_heads=3), "divisible"),
        (dict(target_layer_ids=[1, 6]), r"out of range .* 6 layers"),
        (dict(target_layer_ids=[3, 1]), "strictly increasing"),
        (dict(mask_token_id=97), "outside the vocabulary"),
        (dict(layer_types=["sliding_attention", "full_attention"]), "sliding_window"),
        (dict(layer_types=["full_attention"]), "layer_types has 1 entries"),
        (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "not supported"),
    ],
)
def test_config_validation_errors(over, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**over)


def test_updated_config_is_validated_again():
    config = tiny_config()
    assert config.updated(block_size=8).block_size == 8
    with pytest.raises(ConfigError, match="out of range"):
        config.updated(target_layer_ids=[1, 9])


def test_target_mismatches_name_both_values():
    config = tiny_config()
    assert config.target_mismatches(hidden_size=32, num_layers=6, vocab_size=97) == []
    problems = config.target_mismatches(hidden_size=64, num_layers=4, vocab_size=100)
    assert "drafter 32, target 64" in problems[0]
    assert "drafter 97, target 100" in problems[1]
    assert "made for 6, target has 4" in problems[2]


@pytest.mark.slow
def test_flex_backend_matches_sdpa_on_cpu():
    """The drafter through the compiled flex path (one compile, forward only on the CPU)."""
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    d = random_drafter(config)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)
    layout = BlockLayout(ANCHORS, torch.ones_like(ANCHORS, dtype=torch.bool), DOCS, config.block_size)
    with torch.no_grad():
        flex = d(feats, embeds, ctx_pos, blk_pos, build_block_masks(config, layout, "flex"), "flex")
        sdpa = d(feats, embeds, ctx_pos, blk_pos, reference_masks(config, layout, "sdpa"), "sdpa")
    torch.testing.assert_close(flex, sdpa, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
def test_flex_forward_and_backward_match_sdpa_on_gpu():
    config = tiny_config(
        hidden_size=128, head_dim=32, layer_types=["sliding_attention", "full_attention"], sliding_window=3
    )
    layout = BlockLayout(
        ANCHORS.cuda(), torch.ones_like(ANCHORS, dtype=torch.bool).cuda(), DOCS.cuda(), config.block_size
    )
    inputs = [t.cuda() for t in training_inputs(config, ANCHORS, DOCS)]
    grads = {}
    outs = {}
    for backend in ("flex", "sdpa"):
        d = random_drafter(config).cuda()
        masks = build_block_masks(config, layout, backend)
        outs[backend] = d(*inputs, masks, backend)
        outs[backend].square().mean().backward()
        grads[backend] = {n: p.grad for n, p in d.named_parameters()}
    torch.testing.assert_close(outs["flex"], outs["sdpa"], rtol=1e-3, atol=1e-3)
    for n in grads["sdpa"]:
        torch.testing.assert_close(grads["flex"][n], grads["sdpa"][n], rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_compiled_layers_match_eager_and_new_anchors_do_not_recompile():
    """train.compile runs each layer as one compiled region (one graph for all layers); a new step's
    anchors (a new block mask of the same shape) reuse it after the freeze, and the output matches."""
    from dflashkit.model import drafter as drafter_module
    from dflashkit.runtime.compile import frozen_compiles

    config = tiny_config()
    d = random_drafter(config)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, ANCHORS, DOCS)

    def run(anchors, compiled):
        layout = BlockLayout(anchors, torch.ones_like(anchors, dtype=torch.bool), DOCS, config.block_size)
        d.compiled_regions = compiled
        with torch.no_grad():
            return d(feats, embeds, ctx_pos, blk_pos, build_block_masks(config, layout, "flex"), "flex")

    try:
        torch.testing.assert_close(run(ANCHORS, True), run(ANCHORS, False), rtol=1e-4, atol=1e-4)
        assert drafter_module.LAYER_REGION.graphs() == 1  # both layers, one graph
        other = torch.tensor([[1, 6, 8], [2, 3, 10]])
        with frozen_compiles():
            got = run(other, True)  # would raise CompileAfterWarmupError if the new mask recompiled
        torch.testing.assert_close(got, run(other, False), rtol=1e-4, atol=1e-4)
        assert drafter_module.LAYER_REGION.graphs() == 1
    finally:
        d.compiled_regions = False


@pytest.mark.gpu
def test_compiled_layers_forward_and_backward_match_eager_on_gpu():
    config = tiny_config(hidden_size=128, head_dim=32)
    layout = BlockLayout(
        ANCHORS.cuda(), torch.ones_like(ANCHORS, dtype=torch.bool).cuda(), DOCS.cuda(), config.block_size
    )
    inputs = [t.cuda() for t in training_inputs(config, ANCHORS, DOCS)]
    outs, grads = {}, {}
    for compiled in (False, True):
        d = random_drafter(config).cuda()
        d.compiled_regions = compiled
        outs[compiled] = d(*inputs, build_block_masks(config, layout, "flex"), "flex")
        outs[compiled].square().mean().backward()
        grads[compiled] = {n: p.grad for n, p in d.named_parameters()}
    torch.testing.assert_close(outs[True], outs[False], rtol=1e-4, atol=1e-4)
    for n in grads[False]:
        torch.testing.assert_close(grads[True][n], grads[False][n], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("sliding", [False, True])
def test_static_draft_block_equals_draft_over_the_same_context(sliding):
    """``draft_block`` over a ``StaticDraftCache`` (the block's keys written into its own rows, one mask over
    the cache) equals ``draft`` over a DraftCache of the same context rows, with a sliding layer's window
    too; the rows at and past the anchor hold stale values (a rejected block's), which it must not read."""
    over = dict(layer_types=["sliding_attention", "full_attention"], sliding_window=3) if sliding else {}
    config = tiny_config(**over)
    d = random_drafter(config, seed=5)
    B, anchor = config.block_size, 9
    gen = torch.Generator().manual_seed(6)
    feats = torch.randn(1, 16, len(config.target_layer_ids) * config.hidden_size, generator=gen)
    embeds = torch.randn(1, B, config.hidden_size, generator=gen)
    block_positions = torch.arange(anchor, anchor + B)[None]
    with torch.no_grad():
        want = d.draft(feats[:, :anchor], torch.arange(anchor)[None], embeds, block_positions, d.new_cache())
        cache = d.new_static_cache(20)
        d.write_context(feats, torch.arange(16)[None], cache)  # rows 9..15: a rejected block's features
        for k, v in zip(cache.keys, cache.values, strict=True):
            k[:, :, anchor + B :] = 1e4  # past the block: never read
            v[:, :, anchor + B :] = 1e4
        got = d.draft_block(embeds, block_positions, cache)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
