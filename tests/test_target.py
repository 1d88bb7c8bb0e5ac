"""The target adapter: features equal HF hidden_states[id+1] (last layer pre-norm), labels, the
decode-loop step with a croppable cache, identity, Qwen2/Qwen3 folders, and the embedded mask token."""

import os
from types import SimpleNamespace

import pytest
import torch

from dflashkit.errors import DflashkitError
from dflashkit.target.embedded import MASK_TOKEN, MASK_TOKEN_ID, embedded_dir
from dflashkit.target.hf import TargetModel, default_mask_token_id, identity_of_folder

IDS = [1, 8, 14, 29]  # 29 is the last layer: its raw output, not HF's normed last hidden state


@pytest.fixture(scope="module")
def target():
    return TargetModel.load("embedded")


@pytest.fixture(scope="module")
def tokens():
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, 49152, (2, 24), generator=g)


@pytest.fixture(scope="module")
def reference(target, tokens):
    with torch.no_grad():
        return target.model(tokens, output_hidden_states=True)


def test_loading_changes_nothing_process_wide(monkeypatch):
    """Loading reads local folders only (never the hub), without setting HF_HUB_OFFLINE for the process."""
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    before = dict(os.environ)
    TargetModel.load("embedded")
    assert dict(os.environ) == before


def test_embedded_target_loads_offline_with_its_shape(target):
    assert (target.num_layers, target.hidden_size, target.vocab_size) == (30, 576, 49152)
    assert target.dtype == torch.float32 and target.device.type == "cpu"
    assert not any(p.requires_grad for p in target.model.parameters())


def test_features_are_layer_outputs_in_id_order(target, tokens, reference):
    feats, labels = target.features(tokens, layer_ids=IDS)
    hs = reference.hidden_states
    assert feats.shape == (2, 24, len(IDS) * 576) and labels.shape == (2, 24) and labels.dtype == torch.long
    for n, i in enumerate(IDS[:-1]):
        assert torch.equal(feats[..., n * 576 : (n + 1) * 576], hs[i + 1])
    last = feats[..., -576:]
    assert not torch.allclose(last, hs[30])  # HF's last entry is after the final norm...
    torch.testing.assert_close(target.decoder.norm(last), hs[30])  # ...of exactly this raw output
    assert torch.equal(labels, reference.logits.argmax(-1))


def test_label_options(target, tokens, reference):
    _, logits = target.features(tokens, layer_ids=[3], labels="logits")
    torch.testing.assert_close(logits, reference.logits)
    _, chunked = target.features(tokens, layer_ids=[3], chunk=5)
    assert torch.equal(chunked, reference.logits.argmax(-1))
    feats, none = target.features(tokens, layer_ids=[3], labels="none")
    assert none is None and torch.equal(feats, reference.hidden_states[4])
    with pytest.raises(ValueError, match="out of range"):
        target.features(tokens, layer_ids=[30])


def test_padding_mask_is_respected(target, tokens):
    mask = torch.ones_like(tokens)
    mask[1, :5] = 0  # left padding on row 1
    feats, _ = target.features(tokens, mask, layer_ids=[2])
    with torch.no_grad():
        ref = target.model(tokens, attention_mask=mask, output_hidden_states=True).hidden_states[3]
    torch.testing.assert_close(feats[:, :, :], ref)


def test_embed_and_lm_head_are_the_targets(target, tokens, reference):
    assert torch.equal(target.embed(tokens), reference.hidden_states[0])
    torch.testing.assert_close(target.lm_head(reference.hidden_states[30]), reference.logits)


def test_forward_step_with_cache_and_crop(target, tokens, reference):
    hs = reference.hidden_states
    row = tokens[:1]
    cache = target.new_cache()
    logits, feats = target.forward_step(row[:, :10], cache, [1, 8], all_logits=False)
    assert len(cache) == 10 and logits.shape == (1, 1, 49152) and feats.shape == (1, 10, 1152)
    torch.testing.assert_close(logits[:, 0], reference.logits[:1, 9], rtol=1e-4, atol=1e-4)
    logits, feats = target.forward_step(row[:, 10:16], cache, [1, 8])  # a verify pass of 6 tokens
    torch.testing.assert_close(logits, reference.logits[:1, 10:16], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(
        feats, torch.cat([hs[2][:1, 10:16], hs[9][:1, 10:16]], -1), rtol=1e-4, atol=1e-4
    )
    cache.crop(12)  # two of the six were rejected
    assert len(cache) == 12
    logits, _ = target.forward_step(row[:, 12:20], cache, [1])
    torch.testing.assert_close(logits, reference.logits[:1, 12:20], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="crop"):
        cache.crop(21)


def test_features_are_per_thread(target, tokens):
    import threading

    results = {}

    def run(name, ids):
        results[name] = target.features(tokens, layer_ids=ids, labels="none")[0]

    threads = [threading.Thread(target=run, args=(n, ids)) for n, ids in (("a", [2]), ("b", [5, 7]))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results["a"].shape[-1] == 576 and results["b"].shape[-1] == 2 * 576


def test_identity(target):
    ident = target.identity()
    assert ident["architecture"] == "LlamaForCausalLM" and ident["num_layers"] == 30
    assert ident["hidden_size"] == 576 and ident["vocab_size"] == 49152 and len(ident["hash"]) == 64
    assert "SmolLM2" in ident["name"]
    assert identity_of_folder("embedded") == ident


def test_embedded_mask_token_is_an_unused_special_token():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir())
    assert tok.convert_ids_to_tokens(MASK_TOKEN_ID) == MASK_TOKEN
    assert MASK_TOKEN_ID in tok.all_special_ids or MASK_TOKEN in tok.get_added_vocab()
    chat = tok.apply_chat_template(
        [
            {"role": "user", "content": "Write some code, please."},
            {"role": "assistant", "content": "print(1)"},
        ],
        tokenize=True,
    )
    chat = chat["input_ids"] if isinstance(chat, dict) or hasattr(chat, "keys") else chat
    assert MASK_TOKEN_ID not in chat
    assert MASK_TOKEN_ID not in tok("empty output <empty output> empty_output").input_ids
    assert default_mask_token_id("embedded", 49152) == MASK_TOKEN_ID


def tiny_folder(tmp_path, kind: str, vocab_size: int = 256):
    """A randomly initialised HF model of the given family, saved as a folder."""
    from transformers import AutoModelForCausalLM, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}[kind]
    config = cls(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    folder = tmp_path / kind
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_folders(tmp_path, kind):
    folder = tiny_folder(tmp_path, kind)
    t = TargetModel.load(folder)
    ids = torch.randint(0, 256, (1, 12))
    feats, labels = t.features(ids, layer_ids=[1, 4, 5])
    with torch.no_grad():
        out = t.model(ids, output_hidden_states=True)
    hs = out.hidden_states
    assert torch.equal(feats[..., :64], torch.cat([hs[2], hs[5]], -1))
    torch.testing.assert_close(t.decoder.norm(feats[..., 64:]), hs[6])
    assert torch.equal(labels, out.logits.argmax(-1))
    assert t.identity()["architecture"].startswith(kind.capitalize())
    assert identity_of_folder(folder) == t.identity()

    bf16 = TargetModel.load(folder, dtype=torch.bfloat16)
    f16, _ = bf16.features(ids, layer_ids=[1])
    assert f16.dtype == torch.bfloat16
    torch.testing.assert_close(f16.float(), hs[2], rtol=0.05, atol=0.05)


def test_identity_hash_follows_the_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    folder = tiny_folder(tmp_path, "qwen3")
    before = identity_of_folder(folder)["hash"]
    w = load_file(str(folder / "model.safetensors"))
    w["model.norm.weight"] = w["model.norm.weight"] * 2
    save_file(w, str(folder / "model.safetensors"), {"format": "pt"})
    assert identity_of_folder(folder)["hash"] != before


def test_mask_token_for_a_folder_with_free_embedding_rows(tmp_path):
    from transformers import AutoTokenizer

    folder = tiny_folder(tmp_path, "qwen3", vocab_size=49160)
    AutoTokenizer.from_pretrained(embedded_dir()).save_pretrained(folder)
    assert default_mask_token_id(folder, 49160) == 49152  # the first row past the tokenizer


def test_not_a_model_folder(tmp_path):
    with pytest.raises(DflashkitError, match="not an HF model folder"):
        TargetModel.load(tmp_path)


@pytest.mark.gpu
def test_embedded_target_and_drafter_on_gpu():
    from dflashkit.model.config import config_for_target
    from dflashkit.model.drafter import DFlashDrafter

    cpu = TargetModel.load("embedded")
    gpu = TargetModel.load("embedded", dtype=torch.bfloat16, device="cuda")
    ids = torch.randint(0, 49152, (1, 64))
    f_cpu, _ = cpu.features(ids, layer_ids=[1, 15])
    f_gpu, labels = gpu.features(ids.cuda(), layer_ids=[1, 15])
    assert f_gpu.device.type == "cuda" and f_gpu.dtype == torch.bfloat16 and labels.device.type == "cuda"
    rel = (f_gpu.float().cpu() - f_cpu).norm() / f_cpu.norm()
    assert rel < 0.05
    config = config_for_target(cpu.config, num_layers=2, block_size=8, mask_token_id=MASK_TOKEN_ID)
    d = DFlashDrafter(config).cuda().to(torch.bfloat16)
    block = gpu.embed(torch.full((1, 8), MASK_TOKEN_ID, device="cuda"))
    h = d.draft(
        f_gpu[:, :40],
        torch.arange(40, device="cuda")[None],
        block,
        torch.arange(40, 48, device="cuda")[None],
        d.new_cache(),
        "sdpa",
    )
    assert gpu.lm_head(h).shape == (1, 8, 49152)


def weights_equal(a, b) -> bool:
    """Every tensor and shape of two DecoderWeights equal (the layers' fused projections included)."""
    fields = ("input_norm", "qkv", "qkv_bias", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down")

    def same(x, y) -> bool:
        return (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y))

    return (
        all(same(getattr(a, f), getattr(b, f)) for f in ("embed", "norm", "lm_head", "rotary"))
        and all(
            same(getattr(la, f), getattr(lb, f))
            for la, lb in zip(a.layers, b.layers, strict=True)
            for f in fields
        )
        and (a.heads, a.kv_heads, a.head_dim, a.eps) == (b.heads, b.kv_heads, b.head_dim, b.eps)
    )


@pytest.mark.parametrize("kind", ["embedded", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_lazy_target_reads_the_weights_the_model_holds(tmp_path, kind, dtype):
    """``load(lazy=True)`` reads the weights file and config.json alone: the decoder's weights equal the
    transformers model's tensor for tensor (Llama tied; Qwen2's biases; Qwen3's head norms, untied), and so
    do the shape, device, dtype, identity and what ends a reply; the model is built on its first use only."""
    from dflashkit.data.regenerate import eos_token_ids

    spec = "embedded" if kind == "embedded" else tiny_folder(tmp_path, kind)
    loaded = TargetModel.load(spec, dtype=dtype)
    lazy = TargetModel.load(spec, dtype=dtype, lazy=True)
    assert lazy.lazy and not loaded.lazy
    assert weights_equal(lazy.decoder_weights(96), loaded.decoder_weights(96))
    assert (lazy.device, lazy.dtype, lazy.num_layers, lazy.hidden_size, lazy.vocab_size) == (
        loaded.device,
        loaded.dtype,
        loaded.num_layers,
        loaded.hidden_size,
        loaded.vocab_size,
    )
    assert lazy.identity() == loaded.identity()
    tok = SimpleNamespace(eos_token_id=7)
    assert eos_token_ids(lazy, tok) == eos_token_ids(loaded.model, tok)
    assert lazy.lazy  # none of that built the model
    ids = torch.randint(0, 200, (1, 9), generator=torch.Generator().manual_seed(0))
    assert torch.equal(lazy.features(ids, layer_ids=[1, 3])[0], loaded.features(ids, layer_ids=[1, 3])[0])
    assert not lazy.lazy and lazy._state is None  # built on first use; the tensors read ahead let go
    assert weights_equal(lazy.decoder_weights(96), loaded.decoder_weights(96))


def test_a_folder_the_weights_file_cannot_build_loads_its_model(tmp_path):
    """A rotary scaling (or anything ``DecoderWeights.from_state`` does not build exactly) loads the model at
    once under ``lazy=True``, as without it."""
    import json

    folder = tiny_folder(tmp_path, "qwen3")
    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {**config.get("rope_parameters", {}), "rope_type": "linear", "factor": 2.0}
    config.setdefault("rope_parameters", {}).setdefault("rope_theta", 10000.0)
    (folder / "config.json").write_text(json.dumps(config))
    assert not TargetModel.load(folder, lazy=True).lazy


def test_a_lazy_load_of_a_damaged_folder_says_what_is_wrong(tmp_path):
    """A weights file that lacks a layer's tensor, one that is not a safetensors file, and a config.json that
    is not JSON: each one clear error naming the file, never a KeyError from deep inside the load."""
    from safetensors.torch import load_file, save_file

    folder = tiny_folder(tmp_path, "qwen3")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.2.mlp.up_proj.weight"]
    save_file(weights, str(folder / "model.safetensors"), {"format": "pt"})
    with pytest.raises(DflashkitError, match=r"lack 1 tensors .*model.layers.2.mlp.up_proj.weight"):
        TargetModel.load(folder, lazy=True)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(DflashkitError, match=r"cannot read .*model.safetensors .*damaged"):
        TargetModel.load(folder, lazy=True)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(DflashkitError, match=r"config.json is not a JSON object"):
        TargetModel.load(folder, lazy=True)
