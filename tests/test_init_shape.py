"""A run that starts from a drafter (`drafter.init`): it trains that drafter's shape, grows it by layers that
start as identities when the config asks for more, and refuses a shape the checkpoint cannot take."""

import pytest
import torch

from dflashkit.config import apply_overrides, load_config
from dflashkit.errors import ConfigError
from dflashkit.model.checkpoint import load_drafter
from dflashkit.model.config import make_config
from dflashkit.model.drafter import DFlashDrafter, grown
from dflashkit.train import trainer
from dflashkit.train.fanout import variant_configs
from dflashkit.train.plan import dry_run
from dflashkit.train.setup import start_note, with_init_shape
from test_train import TINY, quiet, tiny_config


def small_config(layers: int, block_size: int):
    return make_config(
        hidden_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=48,
        vocab_size=64,
        block_size=block_size,
        target_layer_ids=[0, 2],
        num_target_layers=4,
        mask_token_id=3,
        rope_theta=10000.0,
    )


def test_a_grown_drafter_computes_what_it_computed():
    """Two more layers and another block size: the same outputs at first; the new layers' output
    projections are zero and get gradients, their other weights are drawn."""
    torch.manual_seed(0)
    old = DFlashDrafter(small_config(1, 4))
    new_config = small_config(3, 8).updated(layer_types=["full_attention"] * 3)
    torch.manual_seed(1)
    new = grown(old, new_config)
    assert len(new.layers) == 3 and new.config.block_size == 8
    ctx = torch.randn(2, 10, 64)
    block = torch.randn(2, 8, 32)
    ctx_pos = torch.arange(10).expand(2, 10)
    block_pos = torch.arange(10, 18).expand(2, 8)
    torch.testing.assert_close(new(ctx, block, ctx_pos, block_pos), old(ctx, block, ctx_pos, block_pos))
    for layer in new.layers[1:]:
        assert not layer.self_attn.o_proj.weight.any() and not layer.mlp.down_proj.weight.any()
        assert layer.self_attn.q_proj.weight.std() > 0
    new(ctx, block, ctx_pos, block_pos).square().sum().backward()
    assert all(layer.self_attn.o_proj.weight.grad.abs().sum() > 0 for layer in new.layers[1:])
    assert grown(old, old.config) is old
    with pytest.raises(ValueError, match="only the number of layers"):
        grown(old, small_config(1, 4).updated(mask_token_id=5))


def from_init(data_dir, out_dir, init, **drafter):
    """A tiny run (`test_train.TINY`) that starts from ``init`` and sets only the drafter keys given."""
    keys = {
        **{k: v for k, v in TINY.items() if not k.startswith("drafter.")},
        "data.dir": str(data_dir),
        "run.out_dir": str(out_dir),
        "drafter.init": str(init),
        "train.max_steps": 2,
        "train.eval_every": 2,
        "train.save_every": 1,
        **{f"drafter.{k}": v for k, v in drafter.items()},
    }
    return load_config(None, [f"{k}={v}" for k, v in keys.items()])


def test_a_run_from_a_drafter_trains_its_shape_and_grows_on_request(tiny_dataset, tmp_path):
    trainer.train(tiny_config(tiny_dataset, tmp_path / "first", **{"train.max_steps": 3}), console=quiet())
    best = tmp_path / "first" / "best"

    same = from_init(tiny_dataset, tmp_path / "same", best)  # no drafter keys: the checkpoint's shape
    shaped = with_init_shape(same)
    assert (shaped.drafter.layers, shaped.drafter.block_size, shaped.drafter.num_target_layers) == (1, 4, 2)
    assert with_init_shape(shaped) == shaped
    # an override elsewhere keeps the drafter keys unset
    assert with_init_shape(apply_overrides(same, {"train.lr": 1e-3}, "test")).drafter.layers == 1

    deeper = from_init(tiny_dataset, tmp_path / "deeper", best, layers=2)
    assert start_note(shaped).endswith("as it is")
    plan = dry_run(deeper, quiet())  # the plan says what the run starts from
    assert plan["starts from"] == f"{best}, grown: 1 -> 2 layers (the new ones start as identities)"
    assert plan["drafter"].startswith("2 layers, block 4")
    kept = trainer.train(same, console=quiet())
    grew = trainer.train(deeper, console=quiet(), stop_after=1)
    # the grown drafter starts as the one it grew from: the first step's loss is the same
    assert grew.losses[0] == pytest.approx(kept.losses[0], rel=1e-5)
    resumed = trainer.train(deeper, resume=True, console=quiet())  # its config.yaml holds the grown shape
    assert resumed.steps == 2
    assert len(load_drafter(tmp_path / "deeper" / "best").layers) == 2

    # fan-out variants from one drafter: each takes its shape, one grown
    fan = apply_overrides(
        same,
        {
            "fanout": {
                "target_device": "cpu",
                "variants": [{"name": "a"}, {"name": "b", "overrides": {"drafter.layers": 2}}],
            }
        },
        "test",
    )
    shapes = [(c.drafter.layers, c.drafter.num_target_layers) for _, c in variant_configs(fan)]
    assert shapes == [(1, 2), (2, 2)]

    with pytest.raises(ConfigError, match="not fewer"):
        with_init_shape(from_init(tiny_dataset, tmp_path / "x", tmp_path / "deeper" / "best", layers=1))
    with pytest.raises(ConfigError, match="num_target_layers=3"):
        with_init_shape(from_init(tiny_dataset, tmp_path / "x", best, num_target_layers=3))
    assert (
        with_init_shape(from_init(tiny_dataset, tmp_path / "x", best, block_size=8)).drafter.block_size == 8
    )
