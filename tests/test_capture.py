"""Offline target features (`dflashkit capture`): training from a capture equals online training,
an interrupted capture resumes to identical shards, a capture that does not belong to the run is
refused, fp8 storage stays within its error bound, and verification catches a corrupted shard."""

import json
import shutil

import pytest
import torch

from dflashkit.config import load_config
from dflashkit.data.features import (
    CaptureSettings,
    FeatureStore,
    bytes_per_token,
    capture_features,
    dequantize_fp8,
    quantize_fp8,
    verify_features,
)
from dflashkit.errors import ConfigError, DataError
from dflashkit.target.packed import target_pass
from dflashkit.train import trainer
from dflashkit.train.sources import feature_source

# Two target layers of 576 at T=96: 2321 B per token in bf16, 4625 B in fp32 (one row per shard at
# this size in fp32, two in bf16).
SHARD_MB = 0.45


def tiny_config(data_dir, out_dir, **over):
    base = {
        "target.dtype": "float32",
        "data.dir": str(data_dir),
        "run.out_dir": str(out_dir),
        "drafter.layers": 1,
        "drafter.block_size": 4,
        "drafter.num_target_layers": 2,
        "train.max_steps": 4,
        "train.max_len": 96,
        "train.num_anchors": 12,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.log_every": 1,
        "train.eval_every": 2,
        "train.save_every": 4,
        "train.chunk_blocks": 4,
    }
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def quiet():
    from rich.console import Console

    return Console(quiet=True)


def capture(cfg, out, dtype="float32", **kw):
    return capture_features(
        cfg, CaptureSettings(out=out, dtype=dtype, shard_mb=SHARD_MB), progress=False, **kw
    )


@pytest.fixture(scope="module")
def fp32_capture(tiny_dataset, tmp_path_factory):
    out = tmp_path_factory.mktemp("capture-fp32")
    capture(tiny_config(tiny_dataset, out / "unused"), out / "features")
    return out / "features"


def test_training_from_a_capture_equals_online(tiny_dataset, fp32_capture, tmp_path):
    online = trainer.train(tiny_config(tiny_dataset, tmp_path / "online"), console=quiet())
    cfg = tiny_config(tiny_dataset, tmp_path / "offline", **{"data.features_dir": str(fp32_capture)})
    offline = trainer.train(cfg, console=quiet())
    assert offline.losses == online.losses  # fp32 storage: the same features, bit for bit
    assert offline.final_val == online.final_val

    bf16 = tmp_path / "bf16"
    m = capture(tiny_config(tiny_dataset, tmp_path / "unused"), bf16, dtype="bfloat16")
    assert m["dtype"] == "bfloat16" and m["bytes_per_token"]["features"] == 2 * 576 * 2
    cfg = tiny_config(tiny_dataset, tmp_path / "offline-bf16", **{"data.features_dir": str(bf16)})
    close = trainer.train(cfg, console=quiet())
    assert close.losses != online.losses
    assert close.losses == pytest.approx(online.losses, rel=2e-2)
    assert close.final_val["acceptance_length"] == pytest.approx(
        online.final_val["acceptance_length"], abs=0.1
    )


def test_interrupted_capture_resumes_to_identical_shards(tiny_dataset, tmp_path, capsys):
    from dflashkit.cli import main

    over = [
        f"data.dir={tiny_dataset}",
        "train.max_len=96",
        "drafter.num_target_layers=2",
        "target.dtype=float32",
    ]
    full = tmp_path / "full"
    args = ["capture", *over, "--out", str(full), "--shard-mb", str(SHARD_MB), "--no-progress", "--verify"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "bytes per token" in printed and "2321" in printed and "verified" in printed
    names = sorted(p.name for p in full.glob("*.safetensors"))
    assert names == [f"train-0000{i}.safetensors" for i in range(4)] + ["validation-00000.safetensors"]

    cfg = tiny_config(tiny_dataset, tmp_path / "unused")
    part = tmp_path / "part"

    def interrupt(split, index):
        if (split, index) == ("train", 1):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        capture(cfg, part, dtype="bfloat16", on_shard=interrupt)
    assert not (part / "manifest.json").exists()
    # A torn shard (a crash or a copy cut short) and a stale temporary file.
    torn = part / "train-00001.safetensors"
    torn.write_bytes(torn.read_bytes()[: torn.stat().st_size // 2])
    (part / "train-00002.safetensors.tmp").write_bytes(b"partial")
    kept_mtime = (part / "train-00000.safetensors").stat().st_mtime_ns

    m = capture(cfg, part, dtype="bfloat16")
    assert (m["run"]["shards_kept"], m["run"]["shards_written"]) == (1, 4)
    assert (part / "train-00000.safetensors").stat().st_mtime_ns == kept_mtime
    assert not list(part.glob("*.tmp"))
    for name in names:
        assert (part / name).read_bytes() == (full / name).read_bytes(), name
    assert verify_features(part)["rows"] == m["splits"]["train"]["rows"] + m["splits"]["validation"]["rows"]

    again = capture(cfg, part, dtype="bfloat16")  # a finished capture: nothing to recompute
    assert (again["run"]["shards_kept"], again["run"]["shards_written"]) == (5, 0)
    with pytest.raises(ConfigError, match="made differently.*dtype"):
        capture(cfg, part, dtype="float32")


def test_a_capture_that_does_not_belong_to_the_run_is_refused(tiny_dataset, fp32_capture, tmp_path):
    def setup(features=fp32_capture, data=tiny_dataset, **over):
        cfg = tiny_config(data, tmp_path / "run", **{"data.features_dir": str(features), **over})
        return trainer.setup_run(cfg)

    with pytest.raises(ConfigError, match=r"holds target layers \[1, 27\].*drafter.num_target_layers=2"):
        setup(**{"drafter.num_target_layers": 3})
    with pytest.raises(ConfigError, match="train.max_len=96, this run has 128"):
        setup(**{"train.max_len": 128})

    def edited(name, change):
        folder = tmp_path / name
        shutil.copytree(fp32_capture, folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        change(manifest)
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return folder

    other_target = edited("target", lambda m: m["target"].update(hash="f" * 64))
    with pytest.raises(ConfigError, match="captured from another target"):
        setup(other_target)
    other_rows = edited("rows", lambda m: m["rows_sha256"].update(train="0" * 64))
    with pytest.raises(ConfigError, match="other train rows"):
        setup(other_rows)

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["settings"]["seed"] = 123  # another selection of prompts
    (data / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ConfigError, match="another dataset"):
        setup(data=data)
    with pytest.raises(DataError, match="dflashkit capture"):
        setup(tmp_path / "nowhere")


def test_dry_run_checks_the_capture_and_shows_ranks(tiny_dataset, fp32_capture, tmp_path):
    from rich.console import Console

    from dflashkit.train.plan import dry_run

    def plan(nproc=None, **over):
        cfg = tiny_config(tiny_dataset, tmp_path / "run", **{"data.features_dir": str(fp32_capture), **over})
        return dry_run(cfg, Console(quiet=True), nproc=nproc)

    ok = plan(nproc=2)
    assert ok["features"].startswith("offline") and ok["ranks"].startswith("2")
    assert "2 x batch 1 x accum 1 = 2 rows per step" in ok["train"]
    with pytest.raises(ConfigError, match="train.max_len=96, this run has 128"):
        plan(**{"train.max_len": 128})
    assert not (tmp_path / "run").exists()


def test_fp8_round_trip_error_is_bounded(tiny_dataset, fp32_capture, tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 50, 3 * 64, generator=g)
    x[..., :64] *= 40.0  # layers of very different size
    x[..., 70] *= 300.0  # an outlier channel
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 50, 3)
    back = dequantize_fp8(q, scale)
    per_layer_scale = scale.repeat_interleave(64, dim=-1)
    # e4m3: 3 mantissa bits (relative error <= 2^-4), subnormal spacing 2^-9 of the scale.
    bound = 2**-4 * x.abs() + 2**-10 * per_layer_scale
    assert bool(((back - x).abs() <= bound * (1 + 1e-5)).all())
    assert float((back - x).norm() / x.norm()) < 0.04

    fp8 = tmp_path / "fp8"
    m = capture(tiny_config(tiny_dataset, tmp_path / "unused"), fp8, dtype="float8_e4m3fn")
    assert m["bytes_per_token"]["features"] == 2 * 576 and m["bytes_per_token"]["scale"] == 2 * 4
    assert verify_features(fp8)["shards"] == 3  # 4 + 4 rows per shard for train, 2 for validation
    exact, approx = FeatureStore(fp32_capture), FeatureStore(fp8)
    idx = list(range(exact.rows("train")))
    f32, labels32 = exact.read("train", idx, torch.device("cpu"), torch.float32)
    f8, labels8 = approx.read("train", idx, torch.device("cpu"), torch.float32)
    assert torch.equal(labels32, labels8)
    _, s = quantize_fp8(f32, 2)
    assert bool(
        ((f8 - f32).abs() <= (2**-4 * f32.abs() + 2**-10 * s.repeat_interleave(576, -1)) * 1.0001).all()
    )


def test_bytes_per_token():
    embedded = bytes_per_token(576, 3, "bfloat16")
    assert embedded["features"] == 3456 and embedded["labels"] == 4
    qwen3_8b = bytes_per_token(4096, 5, "bfloat16")
    assert qwen3_8b["features"] == 40 * 1024
    fp8 = bytes_per_token(4096, 5, "float8_e4m3fn")
    assert fp8["features"] * 2 == qwen3_8b["features"] and fp8["scale"] == 20
    assert fp8["total"] == fp8["features"] + fp8["scale"] + fp8["labels"] + fp8["rows"]
    with pytest.raises(ConfigError):
        bytes_per_token(4096, 5, "int4")
    # the target's last hidden state for a distribution loss: H values a token, bf16 beside fp8 features
    assert bytes_per_token(576, 3, "bfloat16", last_hidden=True)["last_hidden"] == 1152
    fp8_last = bytes_per_token(4096, 5, "float8_e4m3fn", last_hidden=True)
    assert fp8_last["last_hidden"] == 8192 and fp8_last["total"] == fp8["total"] + 8192
    assert embedded["last_hidden"] == 0


def test_a_distribution_loss_trains_from_a_capture_as_online(tiny_dataset, fp32_capture, tmp_path):
    """A capture made with a kl / tv / lk config stores the target's last hidden state (and says so in its
    manifest): training from it equals training online, bit for bit in float32; a capture without it is
    refused in one line, whether the loss or the serving metric needs it."""
    over = {"train.loss": "{ce: 0.1, tv: 0.9}", "train.max_steps": 2, "train.eval_every": 2}
    m = capture(tiny_config(tiny_dataset, tmp_path / "unused", **over), tmp_path / "features")
    last = m["target_last_hidden"]
    assert last == {"layer": 29, "stored": "last_hidden", "dtype": "float32", "bytes_per_token": 576 * 4}
    assert m["bytes_per_token"]["last_hidden"] == 576 * 4 and m["feature_dim"] == 2 * 576
    verify_features(tmp_path / "features")
    online = trainer.train(tiny_config(tiny_dataset, tmp_path / "online", **over), console=quiet())
    cfg = tiny_config(
        tiny_dataset, tmp_path / "offline", **over, **{"data.features_dir": str(tmp_path / "features")}
    )
    offline = trainer.train(cfg, console=quiet())
    assert offline.losses == online.losses and offline.final_val == online.final_val
    assert (
        online.losses
        != trainer.train(  # the loss differs from the CE's: the distribution is used
            tiny_config(tiny_dataset, tmp_path / "ce", **{"train.max_steps": 2, "train.eval_every": 2}),
            console=quiet(),
        ).losses
    )
    for needs in (over, {"train.serve_temperature": 0.7}):
        cfg = tiny_config(
            tiny_dataset, tmp_path / "refused", **needs, **{"data.features_dir": str(fp32_capture)}
        )
        with pytest.raises(ConfigError, match="holds no target distribution") as e:
            trainer.setup_run(cfg)
        assert "\n" not in str(e.value) and "dflashkit capture" in str(e.value)


def test_verify_finds_a_corrupted_shard(fp32_capture, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(fp32_capture, folder)
    shard = folder / "train-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF  # one flipped byte inside the tensors
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match="train-00002.*corrupted"):
        verify_features(folder)
    shard.write_bytes(bytes(data[:1000]))
    with pytest.raises(DataError, match="torn"):
        verify_features(folder)


@pytest.mark.gpu
def test_bf16_capture_on_gpu_is_what_the_target_computes(tiny_dataset, tmp_path):

    gpu = {
        "run.device": "cuda",
        "target.dtype": "bfloat16",
        "attention.backend": "flex",
        "train.autocast": "bf16",
    }
    cfg = tiny_config(tiny_dataset, tmp_path / "unused", **gpu)
    m = capture(cfg, tmp_path / "features", dtype="bfloat16")
    assert m["target_dtype"] == "bfloat16" and m["run"]["device"].startswith("cuda")
    run = trainer.setup_run(
        tiny_config(
            tiny_dataset, tmp_path / "check", **gpu, **{"data.features_dir": str(tmp_path / "features")}
        )
    )
    idx = [0, 1]
    rows = run.train_rows.take(idx, run.device)
    stored, stored_labels = feature_source(run).features("train", idx, rows)
    online, online_labels = target_pass(run.target, rows, run.drafter.config.target_layer_ids)
    assert stored.dtype == torch.bfloat16 and torch.equal(stored, online)
    assert torch.equal(stored_labels, online_labels)
    a = trainer.train(tiny_config(tiny_dataset, tmp_path / "online", **gpu), console=quiet())
    offline = {"data.features_dir": str(tmp_path / "features")}  # a second run in this process
    b = trainer.train(tiny_config(tiny_dataset, tmp_path / "offline", **gpu, **offline), console=quiet())
    assert b.losses == pytest.approx(a.losses, rel=1e-2)
