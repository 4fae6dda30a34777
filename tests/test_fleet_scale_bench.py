"""tools/bench/fleet_scale.py runs end to end on a small fleet (4 simulated engines, 60
trajectories, GPU time x 0.1): the turns, searches and sampled tokens its seeded script implies,
every trajectory answered, and its target line last."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

from agent import question  # noqa: E402
from fleet_engines import turn_lengths  # noqa: E402


@pytest.mark.slow  # 15-25 s: the tokenizer, a retrieval index, the engines' process and the router started
def test_the_bench_runs_a_small_fleet_and_prints_its_target_last():
    from fleet_scale import build_tokenizer

    n, seed = 60, 3
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "bench" / "fleet_scale.py"), "--engines", "4",
                          "--trajectories", str(n), "--seed", str(seed), "--time-scale", "0.1", "--distractors", "300"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    lines = out.stdout.splitlines()
    assert lines[0].startswith("versions:"), out.stderr[-3000:]
    # the script: turn lengths drawn per trajectory (1-4 turns, 150 median), each turn's sampled
    # part at most the recipe's 500 tokens a turn less the longest action
    tok = build_tokenizer()
    actions = [f" <search> {question(i)} </search>" for i in range(n)] + [" <answer> the founders </answer>"]
    longest = 500 - max(len(tok.encode(a, add_special_tokens=False)) for a in actions)
    drawn = [turn_lengths(seed, i, 150, 0.8, longest) for i in range(n)]
    turns = sum(map(len, drawn))
    assert {len(d) for d in drawn} == {1, 2, 3, 4}
    text = out.stdout
    assert f"{n} trajectories on 4 engines (time scale 0.1): turns {turns} " in text
    assert f"searches {turns - n} in " in text  # every turn but each trajectory's last
    assert f"answered {n}/{n}" in text
    assert f"({sum(map(sum, drawn)):,} sampled + " in text
    assert f"requests served {turns:,}" in text  # each turn once: none re-sent, no health check
    assert "do not serve were called" not in text  # the router and the fleet call only routes the engines have
    wall, ideal = map(float, re.search(r"wall time ([\d.]+) s, ideal time ([\d.]+) s", text).groups())
    assert 0 < ideal <= wall
    # the least-loaded ideal: its own choices, the same turns; the run measured against it too
    balanced, router_share, vs_balanced = map(float, re.search(
        r"least-loaded ideal time ([\d.]+) s .*: the router's choices replayed take ([\d.]+)% of it; utilisation vs "
        r"the least-loaded ideal ([\d.]+)%", text).groups())
    assert balanced > 0 and router_share / 100 == pytest.approx(ideal / balanced, abs=0.025)  # times printed to 0.1 s
    assert vs_balanced / 100 == pytest.approx(balanced / wall, abs=0.025)
    target = lines[-1]
    ratio = float(re.search(r"target utilisation vs ideal >= 90%: ([\d.]+)%", target).group(1)) / 100
    assert ratio == pytest.approx(ideal / wall, abs=0.015)  # the times are printed to 0.1 s
    assert out.returncode == (0 if ratio >= 0.9 else 1) and ("MISSED" in target) == (ratio < 0.9)


def test_the_least_loaded_ideal_shows_a_router_that_sent_every_turn_to_one_engine():
    """Eight one-turn trajectories (100 input tokens, 50 new) all served by engine 0 of 2. A
    decode step costs 0.01 s + 0.001 s a token of context, prefill nothing: on one engine the 8
    decode 50 steps at 800 + 8 j tokens of context (step j), 0.5 + 0.001 x (800 x 50 + 8 x 1,225)
    = 50.3 s; split 4 and 4 by the least-loaded choice, 0.5 + 0.001 x (400 x 50 + 4 x 1,225) = 25.4 s."""
    from fleet_engines import LatencyModel
    from fleet_scale import ideal

    model = LatencyModel(decode_s=0.01, kv_s=0.001, prefill_s=0.0, kv_capacity=10**6)
    served = [[(k, 0, 100, 50, 500) for k in range(8)], []]
    router_s, router_busy = ideal(served, model, search_latency_s=0.0)
    balanced_s, balanced_busy = ideal(served, model, search_latency_s=0.0, least_loaded=True)
    assert router_s == pytest.approx(50.3) and router_busy == [pytest.approx(50.3), 0.0]
    assert balanced_s == pytest.approx(25.4) and balanced_busy == [pytest.approx(25.4)] * 2
