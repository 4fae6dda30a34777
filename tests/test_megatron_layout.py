"""Layout.check: parallel sizes validated against the model and the world before allocating."""

import pytest

from megarl.backends.megatron.model import Layout, LayoutError
from megarl.models import ModelSpec
from tiny_models import tiny_hf_config

pytestmark = pytest.mark.megatron

SPEC = ModelSpec.from_hf(tiny_hf_config("qwen2"))  # 4 heads, 2 KV heads, 4 layers


@pytest.mark.parametrize("layout, world", [(Layout(tp=2, pp=2), 4), (Layout(tp=2), 8), (Layout(pp=2, vpp=2), 2),
                                           (Layout(tp=2, sequence_parallel=True), 2)])
def test_layouts_that_fit(layout, world):
    layout.check(SPEC, world)
    assert layout.dp(world) == world // (layout.tp * layout.pp)


@pytest.mark.parametrize("layout, world, words", [
    (Layout(tp=4), 4, "2 key/value heads (query groups) do not divide over tp=4"),
    (Layout(tp=8), 8, "4 attention heads do not divide over tp=8"),
    (Layout(pp=3), 3, "4 layers do not divide into pp=3"),
    (Layout(pp=2, vpp=4), 2, "do not divide into pp=2 x vpp=4"),
    (Layout(vpp=2), 1, "need pp > 1"),
    (Layout(sequence_parallel=True), 1, "sequence parallelism needs tp > 1"),
    (Layout(tp=2, pp=2), 6, "world size 6 is not a multiple of tp x pp x cp = 4"),
    (Layout(tp=0), 1, "must be positive"),
])
def test_layouts_that_do_not_fit_say_why(layout, world, words):
    with pytest.raises(LayoutError, match=words.replace("(", r"\(").replace(")", r"\)")):
        layout.check(SPEC, world)


def test_every_problem_at_once():
    with pytest.raises(LayoutError) as info:
        Layout(tp=4, pp=3).check(SPEC, 5)
    assert str(info.value).count(";") == 2  # query groups, layers, world size


MOE = ModelSpec.from_hf(tiny_hf_config("qwen3_moe"))  # 6 experts of intermediate size 40


@pytest.mark.parametrize("layout, world", [(Layout(ep=2), 2), (Layout(ep=3), 3), (Layout(ep=6), 6),
                                           (Layout(pp=2, ep=2), 4), (Layout(tp=2, ep=2, etp=1, sequence_parallel=True), 2),
                                           (Layout(tp=2, ep=2, etp=2, sequence_parallel=True), 4)])
def test_expert_layouts_that_fit(layout, world):
    layout.check(MOE, world)


@pytest.mark.parametrize("spec, layout, world, words", [
    (MOE, Layout(ep=4), 4, "6 experts do not divide over ep=4"),
    (MOE, Layout(ep=2, etp=3), 6, "intermediate size 40 does not divide over expert tp=3"),
    (MOE, Layout(pp=2, ep=2), 2, "world size 2 is not a multiple of expert tp x ep x pp = 4"),
    (MOE, Layout(tp=2, ep=2, etp=2, sequence_parallel=True), 2, "expert tp x ep x pp = 4"),
    (MOE, Layout(tp=2, ep=2, etp=1), 2, "with tp > 1 trains only with sequence_parallel=true"),
    (SPEC, Layout(ep=2), 2, "expert parallelism (ep > 1 or etp) needs a mixture-of-experts model"),
])
def test_expert_layouts_that_do_not_fit_say_why(spec, layout, world, words):
    with pytest.raises(LayoutError, match=words.replace("(", r"\(").replace(")", r"\)")):
        layout.check(spec, world)
    if "sequence_parallel" in words:
        layout.check(spec, world, training=False)  # log-probs alone: megatron allows it
