"""Layout.check: parallel sizes validated against the model and the world before allocating."""

import pytest

from megarl.backends.megatron.model import Layout, LayoutError
from megarl.models import ModelSpec
from tiny_models import tiny_hf_config

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
