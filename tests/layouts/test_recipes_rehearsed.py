"""Every shipped recipe's layout rehearsed in miniature (megarl.rehearsal): real megatron-core over
gloo as Ray ranks, step 1 with the probe, the gate and the sync, a checkpoint, and a resumed step 2.
`make test-layouts` (CI runs it); each recipe prints its relations kept and lost, and the run's
time and memory. Recipes whose miniatures are the same layout of the same family (the Qwen2.5
7B DAPO and both Search-R1 recipes: TP 2 x DP 2, trainer asleep around generation) share the
first one's run, to keep CI's time."""

from pathlib import Path

import pytest

from megarl.rehearsal import layouts, rehearse, report, table

pytestmark = pytest.mark.layouts

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
RECIPES = sorted(str(p.relative_to(EXAMPLES)) for d in ("dapo", "search_r1") for p in (EXAMPLES / d).glob("*.yaml"))
RUNS: dict = {}  # (miniature, family, colocated) -> the rehearsal that ran it


def test_every_recipe_is_rehearsed():
    assert len(RECIPES) == 6, RECIPES  # a new recipe joins the list by itself; this says how many there are


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_layout_in_miniature(recipe, tmp_path):
    config = str(EXAMPLES / recipe)
    real, mini, family = layouts(config, [])
    key = (mini, family, real.engines == "colocated")
    if key not in RUNS:
        RUNS[key] = rehearse(config, [], tmp_path)
        run = tmp_path / "run"
        assert (run / "checkpoints" / "step_000001" / "megatron_trainer.json").exists()
        assert (run / "checkpoints" / "step_000002" / "megatron_trainer.json").exists()
    ran = RUNS[key]
    assert ran["resumed_to"] == "step_000002"
    mine = {**ran, **table(recipe, real, mini, family)}
    shared = "" if ran["config"] == config else f"\n  (the run of {Path(ran['config']).name}: the same miniature)"
    print("\n" + report(mine) + shared)
