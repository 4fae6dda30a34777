"""tools/bench/async_rollout.py's headline: where two loops trained on different numbers of
tokens (the asynchronous loop's are equal only in expectation), tokens a second, not steps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools" / "bench"))
from async_rollout import headline  # noqa: E402
from protocol import Comparison  # noqa: E402


def test_tokens_a_second_headline_the_comparison_where_the_work_differs():
    # 5 timed steps a run: the synchronous loop 1,000 tokens in 50 s (20/s); the asynchronous one
    # 900 tokens in 36 s (25/s): 1.39x the steps a second, 1.25x the tokens a second
    result = Comparison({"sync": [50.0] * 3, "async": [36.0] * 3, "same": [40.0] * 3},
                        {"sync": [1000.0] * 3, "async": [900.0] * 3, "same": [1000.0] * 3})
    assert headline(result, "sync", "async") == ("async vs sync, response tokens a second: 1.25x (median of 3 "
                                                 "alternating runs; range 1.25-1.25x)")
    both = headline(result, "sync", "async", both=True)
    assert both.startswith(headline(result, "sync", "async") + "; async vs sync: 1.39x ")
    assert both.endswith("[steps a second]")
    # the same tokens: steps a second is the figure
    assert headline(result, "sync", "same") == ("same vs sync: 1.25x (median of 3 alternating runs; range "
                                                "1.25-1.25x) [steps a second]")
