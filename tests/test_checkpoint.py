"""Checkpoints: the z-lab layout exactly, round trips, zlab <-> speculators conversion, atomic writes,
clear errors, and `dflashkit init` on the embedded target."""

import json
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflashkit.cli import main
from dflashkit.errors import CheckpointError
from dflashkit.model import checkpoint as ckpt
from dflashkit.model.checkpoint import convert_checkpoint, load_drafter, read_checkpoint, save_drafter
from dflashkit.model.drafter import DFlashDrafter

# A config.json as a transformers-4 era z-lab export writes it: top-level rope_theta, torch_dtype,
# block_size inside dflash_config, and Qwen3 keys this toolkit does not interpret.
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 48,
    "layer_types": ["full_attention", "full_attention"],
    "max_position_embeddings": 40960,
    "max_window_layers": 28,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 101,
    "dflash_config": {"block_size": 4, "mask_token_id": 100, "target_layer_ids": [1, 5]},
}


def zlab_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random bf16 weights under the z-lab names, written out by hand (not from our model)."""
    g = torch.Generator().manual_seed(seed)
    H, D = config["hidden_size"], config["head_dim"]
    hq, hkv, inter = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    n = len(config["dflash_config"]["target_layer_ids"])

    def r(*shape, norm=False):
        t = torch.rand(*shape, generator=g) + 0.5 if norm else torch.randn(*shape, generator=g) * 0.2
        return t.to(torch.bfloat16)

    w = {"fc.weight": r(H, n * H), "hidden_norm.weight": r(H, norm=True), "norm.weight": r(H, norm=True)}
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        w |= {
            p + "input_layernorm.weight": r(H, norm=True),
            p + "post_attention_layernorm.weight": r(H, norm=True),
            p + "self_attn.q_proj.weight": r(hq * D, H),
            p + "self_attn.k_proj.weight": r(hkv * D, H),
            p + "self_attn.v_proj.weight": r(hkv * D, H),
            p + "self_attn.o_proj.weight": r(H, hq * D),
            p + "self_attn.q_norm.weight": r(D, norm=True),
            p + "self_attn.k_norm.weight": r(D, norm=True),
            p + "mlp.gate_proj.weight": r(inter, H),
            p + "mlp.up_proj.weight": r(inter, H),
            p + "mlp.down_proj.weight": r(H, inter),
        }
    return w


@pytest.fixture
def zlab_dir(tmp_path):
    d = tmp_path / "zlab-drafter"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(ZLAB_CONFIG, indent=2))
    save_file(zlab_weights(ZLAB_CONFIG), str(d / "model.safetensors"), {"format": "pt"})
    return d


def draft_once(drafter: DFlashDrafter, seed: int = 0) -> torch.Tensor:
    """One inference block over 9 random context rows, and a two-block training forward."""
    c = drafter.config
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(1, 9, c.num_context_features, generator=g)
    embeds = torch.randn(1, 2 * c.block_size, c.hidden_size, generator=g)
    B = c.block_size
    with torch.no_grad():
        a = drafter.draft(
            feats,
            torch.arange(9)[None],
            embeds[:, :B],
            torch.arange(9, 9 + B)[None],
            drafter.new_cache(),
            "sdpa",
        )
        b = drafter(feats, embeds, torch.arange(9)[None], torch.arange(2 * B)[None] + 3, None, "eager")
    return torch.cat([a, b], dim=1)


def equivalent(a: dict, b: dict) -> bool:
    """Configs equal up to where block_size and RoPE are spelled (both spellings are written)."""
    return read_config(a) == read_config(b)


def read_config(d: dict):
    return ckpt.config_from_zlab(d) if ckpt.detect_layout(d) == "zlab" else ckpt.config_from_speculators(d)


def test_zlab_checkpoint_loads_and_saves_back_identically(zlab_dir, tmp_path):
    drafter = load_drafter(zlab_dir)
    c = drafter.config
    assert (c.block_size, c.mask_token_id, c.target_layer_ids, c.num_target_layers) == (4, 100, [1, 5], 8)
    assert c.rope_theta == 1e6 and c.rope_scaling is None
    assert c.extra["bos_token_id"] == 151643 and c.extra["max_window_layers"] == 28
    out = draft_once(drafter)

    saved = save_drafter(drafter, tmp_path / "resaved")
    original = load_file(str(zlab_dir / "model.safetensors"))
    again = load_file(str(saved / "model.safetensors"))
    assert set(again) == set(original)
    for k in original:
        assert again[k].dtype == torch.bfloat16 and torch.equal(again[k], original[k]), k

    written = json.loads((saved / "config.json").read_text())
    assert equivalent(written, ZLAB_CONFIG)
    for key, value in ZLAB_CONFIG.items():  # every key of the source survives, block_size moves up
        if key not in ("dflash_config", "torch_dtype", "rope_theta", "auto_map"):
            assert written[key] == value, key
    assert "auto_map" not in written  # it named a dflash.py the folder does not ship
    assert written["block_size"] == 4 and written["rope_theta"] == 1e6
    assert written["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert written["dtype"] == written["torch_dtype"] == "bfloat16"
    torch.testing.assert_close(draft_once(load_drafter(saved)), out, rtol=0, atol=0)


def test_written_config_is_the_zlab_layout(tmp_path):
    drafter = load_drafter_from(ZLAB_CONFIG, tmp_path)
    saved = save_drafter(drafter, tmp_path / "out")
    d = json.loads((saved / "config.json").read_text())
    assert d["architectures"] == ["DFlashDraftModel"] and d["model_type"] == "qwen3"
    assert "auto_map" not in d
    assert d["dflash_config"] == {"mask_token_id": 100, "target_layer_ids": [1, 5], "block_size": 4}
    assert d["block_size"] == 4 and d["num_target_layers"] == 8 and d["tie_word_embeddings"] is False
    with safe_open(str(saved / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert {f.get_slice(k).get_dtype() for k in names} == {"BF16"}
    assert "fc.weight" in names and "layers.1.mlp.down_proj.weight" in names
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in names)

    # transformers reads it as a Qwen3 config, and its decoder layers have our layer weight names
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer

    hf = Qwen3Config.from_pretrained(saved)
    assert hf.num_hidden_layers == 2 and hf.dflash_config["mask_token_id"] == 100
    assert hf.rope_parameters["rope_theta"] == 1e6
    hf_layer = {f"layers.0.{k}": tuple(v.shape) for k, v in Qwen3DecoderLayer(hf, 0).state_dict().items()}
    ours = {k: tuple(v.shape) for k, v in drafter.state_dict().items() if k.startswith("layers.0.")}
    assert ours == hf_layer


def load_drafter_from(config: dict, tmp_path, name="src"):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    save_file(zlab_weights(config), str(d / "model.safetensors"))
    return load_drafter(d)


def test_zlab_to_speculators_to_zlab(zlab_dir, tmp_path):
    out = draft_once(load_drafter(zlab_dir))
    spec = convert_checkpoint(zlab_dir, tmp_path / "spec", "speculators")
    d = json.loads((spec / "config.json").read_text())
    assert d["speculators_model_type"] == "dflash" and d["architectures"] == ["DFlashSpeculator"]
    assert d["aux_hidden_state_layer_ids"] == [2, 6] and d["block_size"] == 4 and d["mask_token_id"] == 100
    assert d["draft_vocab_size"] == 101 and d["transformer_layer_config"]["model_type"] == "qwen3"
    sc = d["speculators_config"]
    assert sc["algorithm"] == "dflash" and sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert set(sc) == {"algorithm", "proposal_methods", "default_proposal_method", "verifier"}
    torch.testing.assert_close(draft_once(load_drafter(spec)), out, rtol=0, atol=0)

    back = convert_checkpoint(spec, tmp_path / "back", "zlab")
    original = load_file(str(zlab_dir / "model.safetensors"))
    again = load_file(str(back / "model.safetensors"))
    assert set(again) == set(original) and all(torch.equal(again[k], original[k]) for k in original)
    assert equivalent(json.loads((back / "config.json").read_text()), ZLAB_CONFIG)
    torch.testing.assert_close(draft_once(load_drafter(back)), out, rtol=0, atol=0)


def test_round_trip_of_a_trained_drafter_in_fp32_and_bf16(tmp_path):
    drafter = load_drafter_from(ZLAB_CONFIG, tmp_path)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 1e-3)  # no longer bf16-representable
    fp32 = load_drafter(save_drafter(drafter, tmp_path / "fp32", dtype=torch.float32))
    assert all(
        torch.equal(a, b)
        for a, b in zip(drafter.state_dict().values(), fp32.state_dict().values(), strict=True)
    )
    torch.testing.assert_close(draft_once(fp32), draft_once(drafter), rtol=0, atol=0)
    bf16 = load_drafter(save_drafter(drafter, tmp_path / "bf16"))
    rounded = DFlashDrafter(drafter.config)
    rounded.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in drafter.state_dict().items()})
    torch.testing.assert_close(draft_once(bf16), draft_once(rounded), rtol=0, atol=0)


def test_reads_transformers5_rope_and_sliding_layers(tmp_path):
    config = {k: v for k, v in ZLAB_CONFIG.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    config |= {
        "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0},
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 3,
        "use_sliding_window": True,
        "block_size": 4,
        "dflash_config": {"mask_token_id": 7, "target_layer_ids": [1, 5]},
    }
    drafter = load_drafter_from(config, tmp_path)
    c = drafter.config
    assert c.rope_theta == 5e5 and c.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    assert c.layer_types == ["sliding_attention", "full_attention"] and c.sliding_window == 3
    saved = save_drafter(drafter, tmp_path / "out")
    d = json.loads((saved / "config.json").read_text())
    assert d["rope_parameters"] == {"rope_theta": 5e5, "rope_type": "linear", "factor": 2.0}
    assert d["rope_scaling"] == {"rope_type": "linear", "factor": 2.0} and d["use_sliding_window"] is True
    back = convert_checkpoint(
        convert_checkpoint(saved, tmp_path / "s", "speculators"), tmp_path / "z", "zlab"
    )
    assert read_checkpoint(back)[0] == c
    torch.testing.assert_close(draft_once(load_drafter(back)), draft_once(drafter), rtol=0, atol=0)


def test_mismatched_target_names_both_values(zlab_dir):
    with pytest.raises(CheckpointError, match=r"hidden size: drafter 32, target 64"):
        load_drafter(zlab_dir, SimpleNamespace(hidden_size=64, num_layers=8, vocab_size=101))
    with pytest.raises(CheckpointError, match=r"vocabulary: drafter 101, target 200"):
        load_drafter(zlab_dir, SimpleNamespace(hidden_size=32, num_layers=8, vocab_size=200))
    with pytest.raises(CheckpointError, match=r"layer count: drafter made for 8, target has 4"):
        load_drafter(zlab_dir, SimpleNamespace(hidden_size=32, num_layers=4, vocab_size=101))
    assert load_drafter(zlab_dir, SimpleNamespace(hidden_size=32, num_layers=8, vocab_size=101)) is not None


def test_malformed_checkpoints_fail_clearly(zlab_dir, tmp_path):
    weights = load_file(str(zlab_dir / "model.safetensors"))
    cases = {
        "missing": ({k: v for k, v in weights.items() if k != "norm.weight"}, "missing norm.weight"),
        "prefixed": ({f"model.{k}": v for k, v in weights.items()}, "unexpected model."),
        "shape": (
            weights | {"fc.weight": torch.zeros(32, 96, dtype=torch.bfloat16)},
            r"fc.weight has shape \[32, 96\]",
        ),
        "pruned": (weights | {"t2d": torch.zeros(3, dtype=torch.bool)}, "pruned draft vocabulary"),
    }
    for name, (w, message) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(ZLAB_CONFIG))
        save_file(w, str(d / "model.safetensors"))
        with pytest.raises(CheckpointError, match=message):
            load_drafter(d)
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        load_drafter(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        load_drafter(tmp_path / "empty")
    bad = tmp_path / "bias"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(ZLAB_CONFIG | {"attention_bias": True}))
    with pytest.raises(CheckpointError, match="biases are not supported"):
        load_drafter(bad)


def test_writes_are_atomic(zlab_dir, tmp_path, monkeypatch):
    drafter = load_drafter(zlab_dir)
    dst = save_drafter(drafter, tmp_path / "ckpt")
    before = (dst / "model.safetensors").read_bytes()

    def broken_save(tensors, path, metadata=None):
        with open(path, "wb") as f:
            f.write(b"half a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", broken_save)
    with pytest.raises(OSError, match="disk full"):
        save_drafter(drafter, dst)
    assert (dst / "model.safetensors").read_bytes() == before  # the old checkpoint is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "zlab-drafter"]  # no temp folder left
    monkeypatch.undo()
    with torch.no_grad():
        drafter.norm.weight.fill_(2.0)
    save_drafter(drafter, dst)  # replacing a checkpoint swaps the whole folder
    assert load_drafter(dst).norm.weight.eq(2.0).all()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "zlab-drafter"]


def test_convert_command(zlab_dir, tmp_path, capsys):
    assert main(["convert", str(zlab_dir), str(tmp_path / "spec"), "--to", "speculators"]) == 0
    assert main(["convert", str(tmp_path / "spec"), str(tmp_path / "z"), "--to", "zlab"]) == 0
    assert equivalent(json.loads((tmp_path / "z" / "config.json").read_text()), ZLAB_CONFIG)
    assert main(["convert", str(zlab_dir), str(tmp_path / "z"), "--to", "zlab"]) == 2  # exists, no --force
    assert "already exists" in capsys.readouterr().err


def test_init_on_the_embedded_target_then_draft_save_load(tmp_path, capsys):
    from dflashkit.target.embedded import MASK_TOKEN_ID
    from dflashkit.target.hf import TargetModel

    out = tmp_path / "init"
    assert (
        main(["init", "--target", "embedded", "--out", str(out), "--layers", "2", "--block-size", "4"]) == 0
    )
    assert "2 layers, block size 4" in capsys.readouterr().out
    target = TargetModel.load("embedded")
    drafter = load_drafter(out, target)
    c = drafter.config
    assert c.hidden_size == 576 and c.num_target_layers == 30 and c.vocab_size == 49152
    assert c.target_layer_ids == [1, 27] and c.mask_token_id == MASK_TOKEN_ID and c.block_size == 4
    assert c.num_attention_heads == 9 and c.num_key_value_heads == 3 and c.rope_theta == 1e5
    assert c.target["hash"] == target.identity()["hash"]

    ids = torch.tensor([[1, 9690, 198, 19556, 905, 17, 2, 198, 1, 520, 9531, 198]])
    feats, labels = target.features(ids, layer_ids=c.target_layer_ids)
    anchor = ids.shape[1] - 1
    block = torch.tensor([[int(labels[0, anchor])] + [c.mask_token_id] * (c.block_size - 1)])

    def one_block(d):
        with torch.no_grad():
            h = d.draft(
                feats[:, :anchor],
                torch.arange(anchor)[None],
                target.embed(block),
                torch.arange(anchor, anchor + c.block_size)[None],
                d.new_cache(),
                "sdpa",
            )
        return target.lm_head(h)

    logits = one_block(drafter)
    assert logits.shape == (1, 4, 49152) and torch.isfinite(logits).all()
    again = load_drafter(save_drafter(drafter, tmp_path / "saved"), target)
    assert torch.equal(one_block(again), logits)

    # speculators layout with the target's embedding and head, which our loader leaves aside
    spec = convert_checkpoint(out, tmp_path / "spec", "speculators", target=target)
    w = load_file(str(spec / "model.safetensors"))
    assert torch.equal(w["embed_tokens.weight"], target.embed_weight().to(torch.bfloat16))
    verifier = json.loads((spec / "config.json").read_text())["speculators_config"]["verifier"]
    assert verifier["architectures"] == ["LlamaForCausalLM"] and verifier["name_or_path"]
    assert torch.equal(one_block(load_drafter(spec, target)), logits)


def test_drafter_for_another_target_is_refused(zlab_dir):
    from dflashkit.target.hf import TargetModel

    with pytest.raises(
        CheckpointError, match=r"hidden size: drafter 32, target 576.*vocabulary: drafter 101, target 49152"
    ):
        load_drafter(zlab_dir, TargetModel.load("embedded"))
