"""Drafters that serving engines load and serve as trained: folders speculators wrote itself convert both
ways bit for bit, written configs carry every field vLLM's and SGLang's DFlash loaders read (and
`check-serving` names what a folder lacks), and sliding-window layers compute what vLLM computes."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflashkit.attention.masks import BlockLayout
from dflashkit.cli import main
from dflashkit.errors import CheckpointError
from dflashkit.model import checkpoint as ckpt
from dflashkit.model.checkpoint import convert_checkpoint, load_drafter, read_checkpoint
from dflashkit.model.drafter import build_block_masks
from dflashkit.model.serving import missing_fields
from test_checkpoint import ZLAB_CONFIG, draft_once, zlab_weights
from test_drafter import naive_forward, random_drafter, tiny_config, training_inputs

HUB_ID = "Org/tiny-target"

# config.json as speculators' DFlashSpeculatorConfig.save_pretrained writes it (speculators c05b95b,
# src/speculators/models/dflash/config.py): transformer_layer_config is Qwen3Config.to_diff_dict(), so
# keys at their Qwen3 default (rms_norm_eps, max_position_embeddings, rope, hidden_act, ...) are absent,
# and nothing records the target's layer count.
SPECULATORS_CONFIG = {
    "architectures": ["DFlashSpeculator"],
    "speculators_model_type": "dflash",
    "speculators_version": "0.9.0",
    "transformer_layer_config": {
        "model_type": "qwen3",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "vocab_size": 101,
        "layer_types": ["sliding_attention", "full_attention"],
        "use_sliding_window": True,
        "sliding_window": 3,
        "transformers_version": "4.57.1",
    },
    "draft_vocab_size": 101,
    "block_size": 4,
    "target_hidden_size": None,
    "aux_hidden_state_layer_ids": [2, 6],
    "mask_token_id": 100,
    "sliding_window_non_causal": False,
    "sample_from_anchor": False,
    "speculators_config": {
        "algorithm": "dflash",
        "proposal_methods": [
            {
                "proposal_type": "greedy",
                "speculative_tokens": 3,
                "verifier_accept_k": 1,
                "accept_tolerance": 0.0,
            }
        ],
        "default_proposal_method": "greedy",
        "verifier": {"name_or_path": HUB_ID, "architectures": ["Qwen3ForCausalLM"]},
    },
}


class TinyTarget:
    """What `convert_checkpoint` asks of a target, for an 8-layer target of hidden size 32 and 101 tokens."""

    hidden_size, num_layers, vocab_size = 32, 8, 101

    def __init__(self, hub_id=HUB_ID):
        self.hub_id = hub_id

    def identity(self):
        return {
            "name": "tiny",
            "path": "/nowhere/tiny",
            "num_layers": 8,
            "hash": "abc",
            "hub_id": self.hub_id,
        }

    def mask_token_text(self, mask_token_id):
        return f"<tok{mask_token_id}>"

    def embed_weight(self):
        return torch.ones(101, 32)

    def lm_head_weight(self):
        return torch.full((101, 32), 2.0)


@pytest.fixture
def speculators_dir(tmp_path):
    """A DFlash folder as speculators writes it: body tensors plus the verifier's embedding and head."""
    d = tmp_path / "speculators-drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(SPECULATORS_CONFIG, indent=2))
    weights = zlab_weights(
        {**SPECULATORS_CONFIG["transformer_layer_config"], "dflash_config": ZLAB_CONFIG["dflash_config"]}
    )
    weights |= {
        "embed_tokens.weight": torch.randn(101, 32).bfloat16(),
        "lm_head.weight": torch.randn(101, 32).bfloat16(),
    }
    save_file(weights, str(d / "model.safetensors"), {"format": "pt"})
    return d


def test_speculators_folder_without_target_layer_count_names_the_flag(speculators_dir, tmp_path, capsys):
    with pytest.raises(CheckpointError, match=r"no num_target_layers .* pass --target TARGET"):
        read_checkpoint(speculators_dir)
    assert main(["convert", str(speculators_dir), str(tmp_path / "out"), "--to", "zlab"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--target" in err[0] and not (tmp_path / "out").exists()


def test_speculators_written_folder_converts_both_ways_bit_exact(speculators_dir, tmp_path):
    config, tensors, layout = read_checkpoint(speculators_dir, num_target_layers=8)
    assert layout == "speculators" and config.target_layer_ids == [1, 5] and config.num_target_layers == 8
    assert (config.rms_norm_eps, config.max_position_embeddings) == (1e-6, 32768)  # Qwen3Config defaults
    assert config.layer_types == ["sliding_attention", "full_attention"] and config.sliding_window == 3
    out = draft_once(load_drafter(speculators_dir, TinyTarget()))

    zlab = convert_checkpoint(speculators_dir, tmp_path / "zlab", "zlab", target=TinyTarget())
    back = convert_checkpoint(zlab, tmp_path / "back", "speculators")  # no target needed any more
    original = load_file(str(speculators_dir / "model.safetensors"))
    for folder in (zlab, back):
        again = load_file(str(folder / "model.safetensors"))
        body = {k for k in original if k not in ckpt.SPECULATORS_TARGET_WEIGHTS}
        assert set(again) == body and all(torch.equal(again[k], original[k]) for k in body), folder
        torch.testing.assert_close(draft_once(load_drafter(folder)), out, rtol=0, atol=0)

    sliding = missing_fields(zlab)  # vLLM windows sliding layers; SGLang's DFlash model has no window
    assert sliding["vllm"] == [] and [f.split(" (")[0] for f in sliding["sglang"]] == [
        "full_attention layer_types"
    ]
    d = json.loads((back / "config.json").read_text())
    for key in ("speculators_model_type", "architectures", "draft_vocab_size", "block_size", "mask_token_id"):
        assert d[key] == SPECULATORS_CONFIG[key], key
    assert d["aux_hidden_state_layer_ids"] == [2, 6] and d["sample_from_anchor"] is False
    assert d["sliding_window_non_causal"] is False
    sc = d["speculators_config"]
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3 and sc["verifier"]["name_or_path"] == HUB_ID
    body = d["transformer_layer_config"]
    for key, value in SPECULATORS_CONFIG["transformer_layer_config"].items():
        if key != "transformers_version":
            assert body[key] == value, key
    assert "max_window_layers" not in body  # a default filled in on reading is not written out as a key
    assert ckpt.config_from_speculators(d) == ckpt.config_from_speculators(
        SPECULATORS_CONFIG, num_target_layers=8
    ).model_copy(update={"target": TinyTarget().identity(), "mask_token": "<tok100>"})


def test_written_configs_carry_every_field_the_engines_read(tmp_path):
    src = tmp_path / "old"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(ZLAB_CONFIG))  # an export with auto_map and no mask text
    save_file(zlab_weights(ZLAB_CONFIG), str(src / "model.safetensors"))
    old = missing_fields(src)
    assert "dflash.py (auto_map names it; drop auto_map or ship the file)" in old["vllm"]
    assert any(f.startswith("dflash_config.mask_token ") for f in old["sglang"])
    assert (
        "num_lookahead_tokens" in old["vllm"]
        and "eagle_aux_hidden_state_layer_ids (older vLLM)" in old["vllm"]
    )

    zlab = convert_checkpoint(src, tmp_path / "zlab", "zlab", target=TinyTarget())
    assert missing_fields(zlab) == {"vllm": [], "sglang": []}
    d = json.loads((zlab / "config.json").read_text())
    assert "auto_map" not in d and d["num_lookahead_tokens"] == 3
    assert d["eagle_aux_hidden_state_layer_ids"] == [2, 6]
    assert d["dflash_config"] == {
        "mask_token_id": 100,
        "mask_token": "<tok100>",
        "target_layer_ids": [1, 5],
        "block_size": 4,
    }

    spec = convert_checkpoint(zlab, tmp_path / "spec", "speculators")
    assert missing_fields(spec)["vllm"] == []
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == HUB_ID  # portable; the local path stays a hint in dflashkit_target
    nameless = convert_checkpoint(src, tmp_path / "nameless", "speculators", target=TinyTarget(hub_id=None))
    assert any("name_or_path" in f for f in missing_fields(nameless)["vllm"])


def test_init_on_the_embedded_target_is_ready_to_serve(tmp_path, capsys):
    out = tmp_path / "init"
    assert (
        main(["init", "--target", "embedded", "--out", str(out), "--layers", "1", "--block-size", "4"]) == 0
    )
    d = json.loads((out / "config.json").read_text())
    assert d["dflash_config"]["mask_token"] == "<empty_output>" and d["dflash_config"]["mask_token_id"] == 16
    assert d["dflashkit_target"]["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert missing_fields(out) == {"vllm": [], "sglang": []}
    spec = convert_checkpoint(out, tmp_path / "spec", "speculators")
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_check_serving_command(tmp_path, capsys):
    src = tmp_path / "old"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    save_file(zlab_weights(ZLAB_CONFIG), str(src / "model.safetensors"))
    assert main(["check-serving", str(src)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "sglang misses" in err[0] and "dflash_config.mask_token" in err[0]
    zlab = convert_checkpoint(src, tmp_path / "zlab", "zlab", target=TinyTarget())
    assert main(["check-serving", str(zlab)]) == 0
    assert "every field" in capsys.readouterr().out


def test_a_causality_override_that_differs_from_ours_is_refused(tmp_path):
    cfg = {**ZLAB_CONFIG, "dflash_config": {**ZLAB_CONFIG["dflash_config"], "causal": True}}
    with pytest.raises(CheckpointError, match="causality override"):
        ckpt.config_from_zlab(cfg)
    sliding = {**ZLAB_CONFIG, "layer_types": ["sliding_attention"] * 2, "sliding_window": 8}
    with pytest.raises(CheckpointError, match="causality override"):
        ckpt.config_from_zlab({**sliding, "is_causal": False})
    assert ckpt.config_from_zlab({**cfg, "dflash_config": {**cfg["dflash_config"], "causal": False}})


# --- sliding layers: the serving engines' rule, re-implemented here -------------------------------


def engine_visible(ctx_pos, blk_pos, anchors, B, window):
    """visible[b][q][key] as vLLM's attention runs a DFlash block: keys are the cached context
    rows before the anchor and the block's own rows, all at their positions. A full layer sees them all
    (non-causal); a sliding layer is causal with FlashAttention's window (W - 1, 0): key position p is seen
    from query position q iff q - W < p <= q. Written from positions alone, block by block."""
    batch, S = ctx_pos.shape
    N = anchors.shape[1]
    vis = torch.zeros(batch, N * B, S + N * B, dtype=torch.bool)
    for b in range(batch):
        for j in range(N):
            a = int(anchors[b, j])
            keys = [(s, int(ctx_pos[b, s])) for s in range(a)]  # one document: rows before the anchor
            keys += [(S + j * B + i, int(blk_pos[b, j * B + i])) for i in range(B)]
            for k in range(B):
                q = int(blk_pos[b, j * B + k])
                for col, p in keys:
                    vis[b, j * B + k, col] = window is None or (q - window < p <= q)
    return vis


@pytest.mark.parametrize("backend", ["eager", "sdpa"])
def test_sliding_layers_compute_what_vllm_computes(backend):
    config = tiny_config(layer_types=["sliding_attention", "full_attention"], sliding_window=3)
    d = random_drafter(config)
    anchors = torch.tensor([[3, 6, 10]])
    docs = torch.zeros(1, 14, dtype=torch.long)
    feats, embeds, ctx_pos, blk_pos = training_inputs(config, anchors, docs)
    B = config.block_size
    visible = {
        "full_attention": engine_visible(ctx_pos, blk_pos, anchors, B, None),
        "sliding_attention": engine_visible(ctx_pos, blk_pos, anchors, B, 3),
    }
    want = naive_forward(d, feats, embeds, ctx_pos, blk_pos, visible)
    layout = BlockLayout(anchors, torch.ones_like(anchors, dtype=torch.bool), docs, B)
    with torch.no_grad():  # training forward, and drafting block by block as at inference
        trained = d(feats, embeds, ctx_pos, blk_pos, build_block_masks(config, layout, backend), backend)
        drafted = [
            d.draft(
                feats[:, :a],
                ctx_pos[:, :a],
                embeds[:, j * B : (j + 1) * B],
                blk_pos[:, j * B : (j + 1) * B],
                d.new_cache(),
                backend,
            )
            for j, a in enumerate(anchors[0].tolist())
        ]
    torch.testing.assert_close(trained.double(), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(drafted, dim=1).double(), want, rtol=1e-5, atol=1e-5)
