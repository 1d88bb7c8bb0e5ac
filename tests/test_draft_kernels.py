"""The drafter's step through the decoder kernels (``dflashkit.infer.kernels.draft``; on the CPU in Triton's
interpreter, which conftest turns on): after a prompt's context and over rounds whose context rows and blocks
overlap as a decode's do, its drafted slots' logits equal the graphs engine's draft step's in float32; a
drafter the kernels cannot run is refused by name."""

import pytest
import torch

pytest.importorskip("triton")

from dflashkit.infer.graph_engine import draft_step  # noqa: E402
from dflashkit.infer.kernels.decoder import interpreting  # noqa: E402
from dflashkit.infer.kernels.draft import (  # noqa: E402
    draft_kernels,
    kernel_draft_step,
    unsupported_drafter,
    write_context,
    write_prompt_context,
)
from dflashkit.model.config import config_for_target  # noqa: E402
from dflashkit.model.drafter import DFlashDrafter, RMSNorm  # noqa: E402
from dflashkit.target.slot_decoder import DecoderWeights  # noqa: E402
from test_kernels import tiny_model  # noqa: E402

B = 8
DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not interpreting(), reason="Triton's interpreter is off (a GPU machine)"),
    ),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def drafter_of(model, **update) -> DFlashDrafter:
    """A two-layer drafter of the tiny target reading its layers 0 and 1, its norms not all ones (so that a
    kernel reading one for another would show it)."""
    cfg = config_for_target(
        model.config, num_layers=2, block_size=B, mask_token_id=300, target_layer_ids=[0, 1]
    ).model_copy(update=update)
    torch.manual_seed(4)
    drafter = DFlashDrafter(cfg).eval()
    with torch.no_grad():
        for m in drafter.modules():
            if isinstance(m, RMSNorm):
                m.weight.uniform_(0.5, 1.5)
    return drafter


@pytest.mark.parametrize("device", DEVICES)
def test_the_draft_step_through_the_kernels_gives_the_draft_steps_logits(device):
    model = tiny_model().to(device)
    w = DecoderWeights.from_hf(model)
    drafter = drafter_of(model).to(device)
    capacity, prompt = 64, 20
    dk = draft_kernels(drafter, w, capacity)
    cache = drafter.new_static_cache(capacity)
    gen = torch.Generator().manual_seed(5)
    features = torch.randn(1, prompt, 2 * w.embed.shape[1], generator=gen).to(device)
    drafter.write_context(features, torch.arange(prompt, device=device)[None], cache)
    write_context(dk, features, torch.zeros(1, dtype=torch.long, device=device))
    offsets = torch.arange(B, device=device)[None]
    # (context rows from, block from): the first round (its rows at the anchor, masked), then rounds that
    # kept 3 drafts, none and 6, each writing the last block's rows as context
    for row_start, block_start in [
        (prompt, prompt),
        (prompt, prompt + 4),
        (prompt + 4, prompt + 5),
        (27, 34),
    ]:
        rows = torch.randn(1, B, features.shape[-1], generator=gen).to(device)
        block = torch.full((1, B), 300, device=device)
        block[0, 0] = int(torch.randint(5, 290, (1,), generator=gen))
        at = (torch.tensor([row_start], device=device), torch.tensor([block_start], device=device))
        ref = torch.full((B - 1, w.vocab_size), float("nan"), device=device)
        draft_step(drafter, cache, w.embed, w.lm_head, rows, at[0], block, at[1], offsets, ref)
        out = torch.full_like(ref, float("nan"))
        kernel_draft_step(dk, rows, at[0], block, at[1], out)
        torch.testing.assert_close(out, ref, atol=5e-5, rtol=1e-5)


def test_drafters_the_kernels_cannot_run_are_named():
    model = tiny_model()
    assert unsupported_drafter(drafter_of(model)) is None
    sliding = drafter_of(model, layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    assert unsupported_drafter(sliding) == "sliding-window layers"
    with pytest.raises(ValueError, match=r"cannot run this drafter \(sliding-window layers\)"):
        draft_kernels(sliding, DecoderWeights.from_hf(model), 32)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_prompts_context_is_written_without_a_kernel_as_the_kernel_writes_it(device, dtype, monkeypatch):
    """A prompt's context rows come in any count: written through plain torch ops (no kernel, so no program
    compiled per row tile mid-generation), they are the keys and values the qkv kernel writes, up to the
    order of sums (float32) or one rounding (bf16)."""
    from dflashkit.infer.kernels import decoder as kernels

    model = tiny_model().to(device, dtype)
    w = DecoderWeights.from_hf(model)
    drafter = drafter_of(model).to(device, dtype)
    gen = torch.Generator().manual_seed(7)
    features = torch.randn(1, 37, 2 * w.embed.shape[1], generator=gen).to(device, dtype)
    by_kernel = draft_kernels(drafter, w, 64)
    write_context(by_kernel, features, torch.zeros(1, dtype=torch.long, device=device))
    by_torch = draft_kernels(drafter, w, 64)

    def no_kernel():
        raise AssertionError("a prompt's context launched a kernel")

    monkeypatch.setattr(kernels, "_compiled", no_kernel)
    write_prompt_context(by_torch, features)
    tol = dict(atol=2e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.05, rtol=0.02)
    for i in range(len(w.layers)):
        for got, want in (
            (by_torch.cache.k[i], by_kernel.cache.k[i]),
            (by_torch.cache.v[i], by_kernel.cache.v[i]),
        ):
            torch.testing.assert_close(got[0, :37].float(), want[0, :37].float(), **tol)
            assert not got[0, 37:].any()  # nothing written past the prompt


@pytest.mark.parametrize("device", DEVICES)
def test_the_draft_step_through_the_kernels_in_bf16_stays_near_the_draft_step(device):
    """bf16 (the served dtype): the kernels round where the drafter's forward rounds, up to the rotation (in
    float32 there, in bf16 with bf16 angles in the drafter's forward), so the drafted slots' logits stay
    within bf16's error and the same tokens win: the tree and chain rounds draft what they would."""
    model = tiny_model().to(device, torch.bfloat16)
    w = DecoderWeights.from_hf(model)
    drafter = drafter_of(model).to(device, torch.bfloat16)
    dk = draft_kernels(drafter, w, 64)
    cache = drafter.new_static_cache(64)
    gen = torch.Generator().manual_seed(6)
    features = torch.randn(1, 20, 2 * w.embed.shape[1], generator=gen).to(device, torch.bfloat16)
    drafter.write_context(features, torch.arange(20, device=device)[None], cache)
    write_context(dk, features, torch.zeros(1, dtype=torch.long, device=device))
    rows = torch.randn(1, B, features.shape[-1], generator=gen).to(device, torch.bfloat16)
    block = torch.full((1, B), 300, device=device)
    block[0, 0] = 17
    at = torch.tensor([20], device=device), torch.tensor([24], device=device)  # rows from 20, block from 24
    offsets = torch.arange(B, device=device)[None]
    ref = torch.empty(B - 1, w.vocab_size, device=device)
    draft_step(drafter, cache, w.embed, w.lm_head, rows, at[0], block, at[1], offsets, ref)
    out = torch.empty_like(ref)
    kernel_draft_step(dk, rows, at[0], block, at[1], out)
    assert (out - ref).abs().max() < 0.05 * ref.abs().max()
    assert (out.argmax(-1) == ref.argmax(-1)).float().mean() >= 6 / 7
