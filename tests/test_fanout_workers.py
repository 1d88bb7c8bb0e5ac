"""Several target workers in a fan-out (`fanout.target_devices`): the drafters get exactly the batches, in
exactly the order, that one worker gives them; the workers' counts add up; a worker that raises stops the
fan-out cleanly. A tiny random Llama and random tokens, on the CPU (workers on a repeated `cpu` share one
copy of the target there), sdpa."""

import json
import threading
import time

import pytest
import torch

from dflashkit.config import load_config
from dflashkit.errors import ConfigError, DeviceError, DflashkitError
from dflashkit.model.checkpoint import load_drafter
from dflashkit.target import packed
from dflashkit.train import fanout, state

STEPS = 8
VOCAB = 64
# a: 2 rows per micro-batch, 8 micro-batches; b: block 8, gradient accumulation 2 (16 micro-batches, so
# its feed runs past a's); c: 2 layers reading 3 target layers (the workers compute the union).
VARIANTS = (
    "[{name: a}, {name: b, overrides: {drafter.block_size: 8, train.grad_accum: 2}},"
    " {name: c, overrides: {drafter.layers: 2, drafter.num_target_layers: 3}}]"
)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(target folder, dataset folder): a 6-layer Llama of width 32 and 12 + 2 rows of 40 random tokens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from dflashkit.data.dataset import KIND, MANIFEST_FILE, SCHEMA, write_split
    from dflashkit.target.hf import identity_of_folder

    root = tmp_path_factory.mktemp("workers")
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "target")
    data = root / "data"
    data.mkdir()
    g = torch.Generator().manual_seed(0)
    splits = {}
    for split, n in (("train", 12), ("validation", 2)):
        ids = [f"{split}-{i}" for i in range(n)]
        tokens = [torch.randint(0, VOCAB - 1, (40,), generator=g).tolist() for _ in ids]
        write_split(data / f"{split}.safetensors", ids, tokens, [[0] * 8 + [1] * 32 for _ in ids])
        splits[split] = {"file": f"{split}.safetensors", "records": n, "tokens": n * 40}
    manifest = {
        "kind": KIND,
        "schema": SCHEMA,
        "target": identity_of_folder(root / "target"),
        "counts": {"records": 14},
        "splits": splits,
    }
    (data / MANIFEST_FILE).write_text(json.dumps(manifest))
    return root / "target", data


def workers_config(tiny, out_dir, devices=None, variants=VARIANTS, **over):
    """A fan-out of the tiny target; ``devices``: fanout.target_devices (None: one worker, on the CPU)."""
    target, data = tiny
    base = {
        "target.path": str(target),
        "target.dtype": "float32",
        "data.dir": str(data),
        "run.out_dir": str(out_dir),
        "run.device": "cpu",
        "drafter.layers": 1,
        "drafter.block_size": 4,
        "drafter.num_target_layers": 2,
        "drafter.mask_token_id": VOCAB - 1,
        "train.max_steps": STEPS,
        "train.batch_size": 2,
        "train.max_len": 48,
        "train.num_anchors": 6,
        "train.lr": 3e-3,
        "train.warmup_ratio": 0.0,
        "train.log_every": 1,
        "train.eval_every": STEPS,
        "train.save_every": 2,
        "train.keep_last": 4,
        "train.chunk_blocks": 4,
        "fanout.variants": variants,
    }
    if devices is not None:
        base["fanout.target_devices"] = f"[{', '.join(devices)}]"
    base.update(over)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def quiet():
    from rich.console import Console

    return Console(quiet=True)


def uneven_workers(mp, seconds=0.02):
    """Make target worker 0 slow, so that the others finish later micro-batches first and must wait for
    their turn; record (thread, rows) of every target pass."""
    real = packed.target_pass
    calls = []

    def slow(target, rows, layer_ids):
        name = threading.current_thread().name
        if name == "target-0":
            time.sleep(seconds)
        calls.append(name)
        return real(target, rows, layer_ids)

    mp.setattr(packed, "target_pass", slow)
    return calls


def recording_puts(mp):
    """Record, per drafter, the micro-batches put into its feed, in the order they went in."""
    real = fanout.Feed.put
    order: dict[str, list[int]] = {}

    def put(self, batch):
        order.setdefault(self.name, []).append(batch.n)
        return real(self, batch)

    mp.setattr(fanout.Feed, "put", put)
    return order


def run_bounded(fn, seconds=120):
    """fn() in a thread: a fan-out that fails to unblock its workers fails the test instead of hanging it."""
    box: dict = {}

    def go():
        try:
            box["result"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the fan-out did not end within {seconds} s"
    if "error" in box:
        raise box["error"]
    return box["result"]


@pytest.fixture(scope="module")
def one_worker(tiny, tmp_path_factory):
    return fanout.train_fanout(workers_config(tiny, tmp_path_factory.mktemp("w1") / "fan"), console=quiet())


@pytest.mark.parametrize("devices", [["cpu", "cpu"], ["cpu", "cpu", "cpu"]])
def test_several_workers_feed_exactly_what_one_worker_feeds(tiny, one_worker, tmp_path, devices):
    cfg = workers_config(tiny, tmp_path / "fan", devices)
    with pytest.MonkeyPatch.context() as mp:
        calls = uneven_workers(mp)
        order = recording_puts(mp)
        result = run_bounded(lambda: fanout.train_fanout(cfg, console=quiet()))
    assert result.ok and one_worker.ok
    for name, alone in one_worker.results.items():
        mine = result.results[name]
        assert mine.steps == STEPS
        assert mine.losses == pytest.approx(alone.losses, rel=1e-6, abs=1e-6), name
        assert mine.final_val["acceptance_length"] == pytest.approx(alone.final_val["acceptance_length"])
    # every drafter got its micro-batches in stream order (a wrong one would also raise FeedError)
    assert order == {"a": list(range(STEPS)), "b": list(range(2 * STEPS)), "c": list(range(STEPS))}
    # the slow worker 0 held the others back without reordering anything: each computed its share
    W = len(devices)
    assert result.target_batches == one_worker.target_batches == 2 * STEPS
    assert [t.batches for t in result.target_workers] == [len(range(i, 2 * STEPS, W)) for i in range(W)]
    passes = sorted(c for c in calls if c.startswith("target-"))  # the held-out rows: worker 0, before
    assert passes == sorted(f"target-{i}" for i in range(W) for _ in range(i, 2 * STEPS, W))
    summary = json.loads((tmp_path / "fan" / fanout.SUMMARY_FILE).read_text())
    assert [t["device"] for t in summary["target_workers"]] == devices
    assert sum(t["batches"] for t in summary["target_workers"]) == summary["target_batches"] == 2 * STEPS
    assert all(0 < t["utilisation"] <= 1 and t["seconds"] > 0 for t in summary["target_workers"])
    busy = sum(t["seconds"] for t in summary["target_workers"])
    assert summary["target_seconds"] == pytest.approx(busy, abs=0.05)


def test_a_failing_target_worker_stops_the_fanout_cleanly(tiny, tmp_path):
    """Worker 1 of 2 raises on its third micro-batch (stream position 5) while worker 0 is waiting for its
    turn or computing: every drafter stops with its checkpoints whole, one DflashkitError names the worker,
    and no thread is left behind."""
    cfg = workers_config(tiny, tmp_path / "fan", ["cpu", "cpu"])
    real = packed.target_pass
    mine = []

    def failing(target, rows, layer_ids):
        if threading.current_thread().name == "target-1":
            mine.append(1)
            if len(mine) == 3:
                raise RuntimeError("injected target failure")
        return real(target, rows, layer_ids)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed, "target_pass", failing)
        with pytest.raises(
            DflashkitError, match=r"target worker 1 \(on cpu\) failed \(RuntimeError: injected"
        ):
            run_bounded(lambda: fanout.train_fanout(cfg, console=quiet()))
    left = [t.name for t in threading.enumerate() if t.name.startswith(("target-", "drafter-"))]
    assert left == []
    table = json.loads((tmp_path / "fan" / fanout.SUMMARY_FILE).read_text())
    assert [d["status"] for d in table["drafters"]] == ["stopped"] * 3
    assert [t["batches"] for t in table["target_workers"]][1] == 2  # its third pass raised
    # worker 0 may have computed 0, 2, 4 and 6, but nothing past 5 went into a feed
    assert table["target_batches"] <= 6 and all(d["micro_batches"] <= 5 for d in table["drafters"])
    for d in table["drafters"]:
        latest = state.read_latest(tmp_path / "fan" / d["name"] / "checkpoints")
        if latest is not None:  # whatever was saved before the stop is whole
            assert json.loads((latest / state.STATE_JSON).read_text())["step"] <= d["steps"]
            load_drafter(latest)


def test_target_devices_config(tiny, tmp_path):
    cfg = workers_config(tiny, tmp_path, ["cpu", "cpu", "cpu"], variants="[{name: a}, {name: b}]")
    targets, drafters = fanout.placement(cfg)
    assert targets == [torch.device("cpu")] * 3 and drafters == [torch.device("cpu")] * 2
    assert fanout.placement(workers_config(tiny, tmp_path, **{"fanout.target_device": "cpu"}))[0] == [
        torch.device("cpu")
    ]
    bad = {
        "both place the target; keep one": dict(devices=["cpu"], **{"fanout.target_device": "cpu"}),
        "names cuda:0 more than once; one target worker per GPU": dict(devices=["cuda", "cuda:0"]),
        "auto is not one": dict(devices=["cuda:0", "auto"]),
        "mixes device kinds": dict(devices=["cpu", "cuda:1"]),
        "target_devices: List should have at least 1 item": dict(**{"fanout.target_devices": "[]"}),
    }
    for message, over in bad.items():
        with pytest.raises(ConfigError, match=message):
            workers_config(tiny, tmp_path, **over)
    if not torch.cuda.is_available():
        with pytest.raises(
            DeviceError, match=r"fanout.target_devices\[0\] is cuda:0 but this machine has no"
        ):
            fanout.placement(workers_config(tiny, tmp_path, ["cuda:0", "cuda:1"]))
