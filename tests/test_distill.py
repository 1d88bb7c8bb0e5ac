"""Distillation (train.distill): the target's whole distribution at each block slot comes from its last layer,
read beside the drafter's, through its final norm and head; the layers a run reads and how they split."""

import pytest
import torch

from dflashkit.config import load_config
from dflashkit.errors import ConfigError
from dflashkit.model.config import DrafterConfig
from dflashkit.target.hf import TargetModel
from dflashkit.train import trainer
from dflashkit.train.anchors import block_labels, label_states
from dflashkit.train.sources import feature_layers, feature_source, split_features
from dflashkit.train.step import draw_anchors

TINY = {
    "target.dtype": "float32",
    "drafter.layers": 1,
    "drafter.block_size": 4,
    "drafter.num_target_layers": 2,
    "train.max_len": 96,
    "train.num_anchors": 12,
    "train.cache_features": False,
}


def config(data_dir, out_dir, **over):
    values = {**TINY, "data.dir": str(data_dir), "run.out_dir": str(out_dir), **over}
    return load_config(None, [f"{k}={v}" for k, v in values.items()])


def drafter_config(ids: list[int], layers: int = 30) -> DrafterConfig:
    return DrafterConfig(
        hidden_size=4,
        num_hidden_layers=1,
        num_attention_heads=1,
        num_key_value_heads=1,
        head_dim=4,
        intermediate_size=8,
        vocab_size=10,
        block_size=4,
        target_layer_ids=ids,
        num_target_layers=layers,
        mask_token_id=0,
        rope_theta=10000.0,
    )


def test_a_distilling_run_reads_the_last_layer_and_splits_it_off(tmp_path):
    plain = load_config(None, [])
    distil = load_config(None, ["train.distill=0.5"])
    d = drafter_config([1, 8, 14])
    assert feature_layers(plain, d) == [1, 8, 14]
    assert feature_layers(distil, d) == [1, 8, 14, 29]
    feats = torch.arange(2 * 3 * 16, dtype=torch.float32).view(2, 3, 16)  # 4 layers of H=4
    context, last = split_features(feats, distil, d)
    assert torch.equal(context, feats[..., :12]) and torch.equal(last, feats[..., 12:])
    context, last = split_features(feats[..., :12], plain, d)
    assert last is None and torch.equal(context, feats[..., :12])
    # a drafter that reads the last layer itself: nothing more to read, the last columns are both
    d = drafter_config([1, 14, 29])
    assert feature_layers(distil, d) == [1, 14, 29]
    context, last = split_features(feats[..., :12], distil, d)
    assert torch.equal(context, feats[..., :12]) and torch.equal(last, feats[..., 8:12])


def test_distill_is_the_older_name_of_a_ce_kl_mix(tmp_path):
    cfg = load_config(None, ["train.distill=0.3"])
    assert cfg.train.loss_weights() == pytest.approx({"ce": 0.7, "kl": 0.3})
    assert cfg.train.reads_target_distribution()
    with pytest.raises(ConfigError, match="train.distill"):
        load_config(None, ["train.distill=1.5"])
    with pytest.raises(ConfigError, match="older name of train.loss") as e:
        load_config(None, ["train.distill=0.5", "train.loss=tv"])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "value, match",
    [
        ("rkl", "unknown loss rkl"),
        ("{ce: 0.5, jsd: 0.5}", "unknown loss jsd"),
        ("{ce: -0.1, tv: 0.9}", "weights of a loss mix"),
        ("{ce: 0, tv: 0}", "weights of a loss mix"),
    ],
)
def test_a_bad_loss_is_one_clear_line(value, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config(None, [f"train.loss={value}"])
    assert "\n" not in str(e.value)


def test_the_runs_that_read_the_targets_distribution():
    assert not load_config(None, []).train.reads_target_distribution()
    assert not load_config(None, ["train.loss={ce: 1, tv: 0}"]).train.reads_target_distribution()
    assert load_config(None, ["train.loss={ce: 0.1, tv: 0.9}"]).train.reads_target_distribution()
    assert load_config(None, ["train.serve_temperature=0.7"]).train.reads_target_distribution()
    with pytest.raises(ConfigError, match="serve_draft_sampling"):
        load_config(None, ["train.serve_draft_sampling=topk"])


def test_the_last_layer_through_the_final_norm_is_the_targets_distribution():
    target = TargetModel.load("embedded", dtype=torch.float32)
    ids = torch.tensor([[1, 504, 3456, 28, 905, 17, 2248, 42]])
    last_layer = target.num_layers - 1
    feats, logits = target.features(ids, layer_ids=[last_layer], labels="logits")
    torch.testing.assert_close(target.lm_head(target.final_norm(feats)), logits, rtol=1e-5, atol=1e-4)


def test_each_slots_target_state_predicts_its_label(tiny_dataset, tmp_path):
    """label_states picks, for every block slot, the target state whose argmax `block_labels` reads: the soft
    target sits where the hard one does."""
    cfg = config(tiny_dataset, tmp_path / "run", **{"train.distill": 0.5})
    run = trainer.setup_run(cfg)
    rows = run.train_rows.take(list(range(min(4, len(run.train_rows)))), torch.device("cpu"))
    feats, argmax = feature_source(run).features("train", list(range(len(rows))), rows)
    assert feats.shape[-1] == 3 * run.target.hidden_size  # the drafter's two layers and the last
    _, last = split_features(feats, cfg, run.drafter.config)
    layout = draw_anchors(rows, cfg.train.num_anchors, 4, torch.Generator().manual_seed(0))
    labels, mask = block_labels(layout, argmax, rows.input_ids, rows.loss_mask)
    with torch.no_grad():
        soft = run.target.lm_head(run.target.final_norm(label_states(layout, last)))
    assert mask.sum() > 20
    assert torch.equal(soft.argmax(-1)[mask], labels[mask])
