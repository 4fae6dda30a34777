"""The rehearsal's layouts (megarl.rehearsal): each shipped recipe's real layout, worked out by hand
from its YAML, and the miniature that keeps its relations on one CPU machine."""

from dataclasses import replace
from pathlib import Path

import pytest

from megarl.config import load_config
from megarl.rehearsal import Shape, compare, miniature, model_family, relations, shape_of

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# (recipe, real (TP, PP, CP, DP, EP, ETP), miniature (TP, PP, CP, DP, EP, ETP, probe sequences))
RECIPES = [
    # 8 nodes x 8 GPUs colocated: 64 / (8 x 2) = DP 4, not more than the probe's 4 sequences
    ("dapo/dapo_qwen2.5_32b.yaml", (8, 2, 1, 4, 1, 1), (2, 2, 1, 2, 1, 1, 4)),
    ("dapo/dapo_qwen2.5_7b.yaml", (4, 1, 1, 4, 1, 1), (2, 1, 1, 2, 1, 1, 4)),
    # DP 32 set in the YAML, EP 64 over all of a stage's 64 ranks: the experts span the replicas
    # (a mixture of experts' miniature is TP 1: megatron trains MoE at TP > 1 only with sequence
    # parallelism, which its CPU layers lack; EP 2 over the 2 replicas still spans them)
    ("dapo/dapo_qwen3_235b_a22b.yaml", (2, 1, 1, 32, 64, 1), (1, 1, 1, 2, 2, 1, 1)),
    # 16 GPUs / (TP 4 x CP 2) = DP 2; EP 8 x ETP 1 = TP x CP: each replica's experts its own
    ("dapo/dapo_qwen3_30b_a3b.yaml", (4, 1, 2, 2, 8, 1), (1, 1, 2, 2, 2, 1, 4)),
    ("search_r1/search_r1_qwen2.5_32b.yaml", (8, 1, 1, 4, 1, 1), (2, 1, 1, 2, 1, 1, 4)),
    ("search_r1/search_r1_qwen2.5_7b.yaml", (4, 1, 1, 4, 1, 1), (2, 1, 1, 2, 1, 1, 4)),
]


@pytest.mark.parametrize("recipe, real, mini", RECIPES)
def test_each_recipe_has_its_layout_and_a_miniature_that_keeps_its_relations(recipe, real, mini):
    cfg = load_config(str(EXAMPLES / recipe), consistent=False)
    shape = shape_of(cfg, moe=model_family(cfg.model.path) == "qwen3_moe")
    assert (shape.tp, shape.pp, shape.cp, shape.dp, shape.ep, shape.etp) == real
    small = miniature(shape)
    assert (small.tp, small.pp, small.cp, small.dp, small.ep, small.etp, small.probe_sequences) == mini
    assert small.world <= 8  # this machine runs it
    kept = {name for name, _, _, verdict in compare(shape, small) if verdict == "kept"}
    lost = {name for name, _, _, verdict in compare(shape, small) if verdict != "kept"}
    assert {"DP > probe sequences", "EP spans DP replicas", "PP > 1", "CP > 1", "DP > 1", "EP > 1",
            "distributed optimizer", "dynamic micro-batches"} <= kept
    assert ("TP > 1" in kept) == (shape.moe is False)
    assert "sequence parallel" in lost  # the recipes all set it; local layers have none
    assert ("engines" in lost) == (cfg.rollout.mode == "colocated")
    assert ("agent turns" in lost) == recipe.startswith("search_r1")


@pytest.mark.parametrize("real, want", [
    # EP x ETP wider than a replica's TP x CP ranks reaches into other replicas
    (Shape(tp=2, pp=1, vpp=None, cp=1, dp=4, ep=4, etp=1, moe=True), True),
    (Shape(tp=2, pp=1, vpp=None, cp=1, dp=4, ep=2, etp=1, moe=True), False),  # EP folded into TP
    (Shape(tp=2, pp=1, vpp=None, cp=2, dp=2, ep=4, etp=1, moe=True), False),  # TP x CP = 4
    (Shape(tp=4, pp=1, vpp=None, cp=1, dp=2, ep=4, etp=2, moe=True), True),  # 8 > 4
    (Shape(tp=2, pp=1, vpp=None, cp=1, dp=4, ep=1, etp=1, moe=False), False),
])
def test_expert_groups_span_replicas_exactly_when_wider_than_one(real, want):
    assert real.ep_spans_dp is want
    small = miniature(real)
    assert small.ep_spans_dp is want
    assert (small.tp * small.cp * small.dp) % (small.ep * small.etp) == 0  # megatron lays experts out so


def test_a_virtual_pipeline_and_an_outnumbered_probe_are_kept():
    real = Shape(tp=8, pp=4, vpp=3, cp=1, dp=16, probe_sequences=4)
    small = miniature(real)
    assert (small.pp, small.vpp, small.dp, small.probe_sequences) == (2, 2, 2, 1)
    assert relations(small)["DP > probe sequences"].startswith("yes")
    assert all(verdict == "kept" for *_, verdict in compare(real, small))


def test_a_model_unknown_and_not_on_disk_is_named(tmp_path):
    with pytest.raises(ValueError, match="--family"):
        model_family(str(tmp_path / "no-such-model"))
    assert model_family("models/Qwen3-30B-A3B") == "qwen3_moe"  # a recipe's directory, by its name
    assert model_family("Qwen/Qwen2.5-7B") == "qwen2"


def test_adapter_sync_is_rehearsed_merged_and_says_so():
    real = Shape(tp=2, pp=1, vpp=None, cp=1, dp=4, lora="adapter", engines="colocated")
    small = miniature(real)
    assert small.lora == "merged"
    verdicts = {name: verdict for name, _, _, verdict in compare(real, small)}
    assert verdicts["LoRA"].startswith("lost: adapters alone")
    assert miniature(replace(real, lora="merged")).lora == "merged"
