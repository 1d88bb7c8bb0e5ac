"""The drafter in git against the formats and attention of the serving engines; writes benchmarks/results/interop.json.

- ``speculators_roundtrip``: benchmarks/drafters/embedded-gpu-more converted z-lab -> speculators -> z-lab ->
  speculators (with the embedded target): every body tensor bit for bit, the speculators configs identical and
  the z-lab configs equal in meaning (`read_checkpoint`'s DrafterConfig).
- ``missing_fields``: what vLLM's and SGLang's DFlash loaders read that the converted z-lab folder lacks
  (`dflashkit.model.serving`); ``missing_fields_in_git`` the same for the folder as committed.
- ``sliding_window_max_abs_diff``: the same weights with sliding layers (window ``--window`` on layers 0 and
  1): the training forward (eager) against a re-implementation, written here from the state dict, of how
  vLLM runs a DFlash block (block by block over the context before its anchor; a sliding layer causal with
  the window (W - 1, 0) over positions), in float64 on the embedded target's features of one prompt (the
  drafter builds its RoPE tables in float32, so the difference stays near 1e-6).
  ``..._bidirectional_sliding`` is the same with the rule dflashkit trained with before 2026-12-07 (sliding
  layers bidirectional inside the block).

    PYTHONPATH=src python benchmarks/interop.py          # CPU, under a minute
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoTokenizer

from dflashkit.attention.backends import AttentionMask
from dflashkit.attention.masks import BlockLayout, dense_mask
from dflashkit.model.checkpoint import (
    SPECULATORS_TARGET_WEIGHTS,
    convert_checkpoint,
    load_drafter,
    read_checkpoint,
)
from dflashkit.model.drafter import build_block_masks
from dflashkit.model.serving import missing_fields
from dflashkit.target.hf import TargetModel

ROOT = Path(__file__).resolve().parents[1]
DRAFTER = ROOT / "benchmarks" / "drafters" / "embedded-gpu-more"
RESULTS = ROOT / "benchmarks" / "results" / "interop.json"
PROMPT = (
    "Speculative decoding lets a small drafter propose several tokens that the large model then checks in one "
    "pass; a block-diffusion drafter proposes a whole block at once from the target's hidden states."
)


def roundtrip(target: TargetModel, work: Path) -> tuple[bool, Path]:
    s1 = convert_checkpoint(DRAFTER, work / "s1", "speculators", target=target)
    z2 = convert_checkpoint(s1, work / "z2", "zlab", target=target)
    s3 = convert_checkpoint(z2, work / "s3", "speculators", target=target)
    body = {k: v for k, v in load_file(str(DRAFTER / "model.safetensors")).items()}
    z2t, s1t, s3t = (load_file(str(f / "model.safetensors")) for f in (z2, s1, s3))
    tensors = (
        set(z2t) == set(body)
        and all(torch.equal(z2t[k], body[k]) for k in body)
        and set(s1t) == set(s3t) == set(body) | set(SPECULATORS_TARGET_WEIGHTS[:2])
        and all(torch.equal(s1t[k], s3t[k]) for k in s1t)
    )
    configs = json.loads((s1 / "config.json").read_text()) == json.loads((s3 / "config.json").read_text())
    meaning = read_checkpoint(z2)[0] == read_checkpoint(s1)[0] == read_checkpoint(s3)[0]
    original = read_checkpoint(DRAFTER)[0]
    same_drafter = original.model_copy(update={"target": None, "mask_token": None}) == read_checkpoint(z2)[
        0
    ].model_copy(update={"target": None, "mask_token": None})
    return bool(tensors and configs and meaning and same_drafter), z2


def engine_reference(sd: dict, c, feats, ctx_pos, embeds, blk_pos, window: int) -> torch.Tensor:
    """One block [B, H] as vLLM computes it, in float64: keys are the context rows (features
    [S, n*H] at ctx_pos) and the block's rows at blk_pos; a sliding layer sees q - window < p <= q."""
    sd = {k: v.double() for k, v in sd.items()}
    D, hq, hkv = c.head_dim, c.num_attention_heads, c.num_key_value_heads
    inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D)

    def rms(x, w):
        return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    def rope(x, pos):  # x [T, heads, D], neox halves
        ang = pos.double()[:, None] * inv_freq[None]
        cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * cos + torch.cat([-x2, x1], -1) * sin

    ctx = rms(feats.double() @ sd["fc.weight"].T, sd["hidden_norm.weight"])
    pos = torch.cat([ctx_pos, blk_pos])
    h = embeds.double()
    for i, kind in enumerate(c.layer_types):
        p = f"layers.{i}."
        x = rms(h, sd[p + "input_layernorm.weight"])
        src = torch.cat([ctx, x])
        q = rms(
            (x @ sd[p + "self_attn.q_proj.weight"].T).view(len(x), hq, D), sd[p + "self_attn.q_norm.weight"]
        )
        k = rms(
            (src @ sd[p + "self_attn.k_proj.weight"].T).view(len(src), hkv, D),
            sd[p + "self_attn.k_norm.weight"],
        )
        v = (src @ sd[p + "self_attn.v_proj.weight"].T).view(len(src), hkv, D)
        q, k = rope(q, blk_pos), rope(k, pos)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(D)
        if kind == "sliding_attention":
            qq, pp = blk_pos[:, None], pos[None, :]
            scores = scores.masked_fill(~((pp <= qq) & (qq - pp < window)), float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(x), hq * D)
        h = h + out @ sd[p + "self_attn.o_proj.weight"].T
        y = rms(h, sd[p + "post_attention_layernorm.weight"])
        h = (
            h
            + (F.silu(y @ sd[p + "mlp.gate_proj.weight"].T) * (y @ sd[p + "mlp.up_proj.weight"].T))
            @ sd[p + "mlp.down_proj.weight"].T
        )
    return rms(h, sd["norm.weight"])


def sliding_diffs(target: TargetModel, window: int) -> tuple[float, float]:
    base = load_drafter(DRAFTER, target)
    kinds = ["sliding_attention"] * 2 + ["full_attention"] * (base.config.num_hidden_layers - 2)
    config = base.config.updated(layer_types=kinds, sliding_window=window)
    drafter = type(base)(config)
    drafter.load_state_dict(base.state_dict())
    drafter = drafter.double().eval()
    B = config.block_size
    tok = AutoTokenizer.from_pretrained(target.path, local_files_only=True)
    ids = torch.tensor([tok(PROMPT)["input_ids"]])
    S = ids.shape[1]
    anchors = torch.tensor([[S // 3, S // 2, S - B - 1]])
    with torch.no_grad():
        feats, _ = target.features(ids, layer_ids=config.target_layer_ids, labels="none")
        block_ids = torch.full((1, anchors.shape[1] * B), config.mask_token_id)
        block_ids[0, ::B] = ids[0, anchors[0]]
        embeds = target.embed(block_ids).double()
    feats = feats.double()
    ctx_pos = torch.arange(S)[None]
    blk_pos = (anchors[:, :, None] + torch.arange(B)).reshape(1, -1)
    layout = BlockLayout(
        anchors, torch.ones_like(anchors, dtype=torch.bool), torch.zeros(1, S, dtype=torch.long), B
    )
    sd = drafter.state_dict()
    want = torch.cat(
        [
            engine_reference(
                sd,
                config,
                feats[0, :a],
                ctx_pos[0, :a],
                embeds[0, j * B : (j + 1) * B],
                blk_pos[0, j * B : (j + 1) * B],
                window,
            )
            for j, a in enumerate(anchors[0].tolist())
        ]
    )
    with torch.no_grad():
        ours = drafter(feats, embeds, ctx_pos, blk_pos, build_block_masks(config, layout, "eager"), "eager")[
            0
        ]
        m = dense_mask(layout, window=window)  # sliding layers bidirectional inside the block
        old = {**build_block_masks(config, layout, "eager")}
        old["sliding_attention"] = AttentionMask("eager", dense=m, rows_visible=m.any(-1, keepdim=True))
        before = drafter(feats, embeds, ctx_pos, blk_pos, old, "eager")[0]
    return float((ours - want).abs().max()), float((before - want).abs().max())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--window", type=int, default=8, help="sliding window of the sliding layers (default 8)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args()
    torch.manual_seed(0)
    target = TargetModel.load("embedded")
    with tempfile.TemporaryDirectory() as tmp:
        ok, z2 = roundtrip(target, Path(tmp))
        missing = missing_fields(z2)
    diff, before = sliding_diffs(target, args.window)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    result = {
        "speculators_roundtrip": ok,
        "missing_fields": missing,
        "missing_fields_in_git": missing_fields(DRAFTER),
        "sliding_window_max_abs_diff": diff,
        "sliding_window_max_abs_diff_bidirectional_sliding": before,
        "sliding_window": args.window,
        "drafter": str(DRAFTER.relative_to(ROOT)),
        "date": datetime.date.today().isoformat(),
        "device": "cpu, float64 (the drafter's RoPE tables float32, as it builds them)",
        "commit": commit.stdout.strip(),
    }
    tmp_out = args.out.with_suffix(".tmp")
    tmp_out.write_text(json.dumps(result, indent=2) + "\n")
    tmp_out.replace(args.out)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
