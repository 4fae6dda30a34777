"""The open-r1 shaping rewards (format, tag counting, reasoning steps, Kimi 1.5 length,
cosine length scaling, n-gram repetition) and the soft overlong punishment, each a
small pure function. A run applies the overlong punishment as algorithm.overlong, once,
after the reward (megarl.experience.shape_overlong), not as a reward weight.

A function returns None when it does not apply to a sample; the combination
(megarl.reward.scoring.combine_rewards) then leaves it out.

Each gives open-r1's value (src/open_r1/rewards.py) by default; megarl's own readings are
options, each with its reason:
- reward.length_rewards=megarl (len and cosine_scaled; the default, open_r1, is open-r1's
  own correctness check, lengths in characters, a response whose gold does not parse counted
  correct by len and given 1.0 by cosine_scaled, and the cosine followed past max_len):
  correctness from the accuracy component or the task score, lengths in tokens when
  the trainer gives them (RewardRequest.response_length), as the length penalties are meant
  to act on generation cost; a sample whose gold does not parse skipped (None), as a broken
  label should move the policy neither way; cosine_scaled held at its end value past max_len
  (see its docstring);
- reward.format_strict_end: format_reward strict about what follows </answer>.
One departure has no option: len compares the responses of one prompt (open-r1 compares those
of the batch TRL hands it, whose make-up depends on the number of devices; Kimi 1.5's
reference length is per problem).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Literal

# How len and cosine_scaled are computed: open-r1's way, or megarl's (see the module docstring).
LengthRewards = Literal["open_r1", "megarl"]

_FORMAT = r"<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>"
# open-r1 matches its pattern from the start (re.match) with a "$" after </answer> under
# re.MULTILINE, and "$" then matches before any newline: "</answer>\n" ends the format and
# whatever follows that newline is never read.
_FORMAT_OPEN_R1 = re.compile(_FORMAT + "$", re.DOTALL | re.MULTILINE)
# The same pattern read without re.MULTILINE: one newline at most after </answer>, then the end.
_FORMAT_STRICT_END = re.compile(_FORMAT + r"\n?", re.DOTALL)
# The exact forms the format reward asks for; each appearing once is worth a quarter.
_FORMAT_TAGS = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
# "Step 1:", "1." opening the response, a bullet line "- " / "* ", and ordinal transitions.
# open-r1 means "^\d+\." for numbered lines but compiles it without re.MULTILINE, so only a
# number at the very start counts; kept as it is, so that the reward is open-r1's.
_REASONING_STEP = re.compile(r"Step \d+:|^\d+\.|\n-|\n\*|First,|Second,|Next,|Finally,")
_STEPS_FOR_FULL_REWARD = 3


def format_reward(response: str, strict_end: bool = False) -> float:
    """1.0 when the response is "<think>\\n…\\n</think>\\n<answer>\\n…\\n</answer>" from its
    first character, else 0.0.

    What may follow "</answer>": by default what open-r1's format_reward accepts, the end of
    the response or a newline, after which anything goes ("…</answer>\\nmore" scores 1.0).
    strict_end=True (reward.format_strict_end) accepts the end or one newline and nothing else,
    for runs where text after the answer should cost the format reward.
    """
    if strict_end:
        return 1.0 if _FORMAT_STRICT_END.fullmatch(response) else 0.0
    return 1.0 if _FORMAT_OPEN_R1.match(response) else 0.0


def tag_count_reward(response: str) -> float:
    """0.25 for each of "<think>\\n", "\\n</think>\\n", "\\n<answer>\\n", "\\n</answer>"
    that appears exactly once: partial credit on the way to the strict format."""
    return 0.25 * sum(response.count(tag) == 1 for tag in _FORMAT_TAGS)


def reasoning_steps_reward(response: str) -> float:
    """min(1, steps / 3) where steps counts step markers: "Step k:", a number and a period
    at the start of the response ("1."; later numbered lines do not count, as in open-r1),
    bullet lines and First, / Second, / Next, / Finally,."""
    steps = len(_REASONING_STEP.findall(response))
    return min(1.0, steps / _STEPS_FOR_FULL_REWARD)


def len_rewards(lengths: Sequence[int], correct: Sequence[bool | None]) -> list[float | None]:
    """Kimi 1.5 length reward over the responses of ONE prompt.

    λ = 0.5 − (len − min_len) / (max_len − min_len); a correct response gets λ (shorter
    is better), a wrong one min(0, λ) (long wrong answers are punished, short ones are
    not rewarded). All 0.0 when every response has the same length. A response whose
    correctness is unknown (None) gets None.
    """
    if len(lengths) != len(correct):
        raise ValueError(f"len_rewards got {len(lengths)} lengths but {len(correct)} correctness flags")
    if not lengths:
        return []
    shortest, longest = min(lengths), max(lengths)
    if shortest == longest:
        return [None if c is None else 0.0 for c in correct]
    rewards: list[float | None] = []
    for length, is_correct in zip(lengths, correct):
        lam = 0.5 - (length - shortest) / (longest - shortest)
        rewards.append(None if is_correct is None else lam if is_correct else min(0.0, lam))
    return rewards


def cosine_scaled_reward(
    length: int,
    correct: bool | None,
    max_len: int = 1000,
    min_value_wrong: float = -1.0,
    max_value_wrong: float = -0.5,
    min_value_correct: float = 0.5,
    max_value_correct: float = 1.0,
    clamp: bool = True,
) -> float | None:
    """Cosine interpolation over length: correct answers go from max_value_correct at
    length 0 down to min_value_correct at max_len (prefer short right answers); wrong
    ones from min_value_wrong at 0 up to max_value_wrong at max_len (a long attempt is
    punished less than a short guess).

    reward = lo + (hi − lo)·(1 + cos(π·t))/2, t = min(length / max_len, 1); with
    (hi, lo) = (max_value_correct, min_value_correct) when correct, else
    (min_value_wrong, max_value_wrong). t is clamped at 1 so that responses longer than
    max_len keep the end value instead of climbing back up the cosine; clamp=False is
    open-r1's t = length / max_len. None when the correctness is unknown.
    """
    if correct is None:
        return None
    if max_len <= 0:
        raise ValueError(f"cosine_scaled max_len={max_len} must be > 0")
    progress = min(length / max_len, 1.0) if clamp else length / max_len
    at_zero, at_max = (max_value_correct, min_value_correct) if correct else (min_value_wrong, max_value_wrong)
    return at_max + (at_zero - at_max) * 0.5 * (1.0 + math.cos(progress * math.pi))


def repetition_penalty_reward(response: str, ngram_size: int, max_penalty: float) -> float:
    """(1 − unique n-grams / all n-grams) · max_penalty over lowercase white-space
    separated words; 0.0 when the response has fewer than ngram_size words."""
    if max_penalty > 0:
        raise ValueError(f"repetition max_penalty={max_penalty} must be <= 0: it is a penalty")
    if ngram_size < 1:
        raise ValueError(f"repetition ngram_size={ngram_size} must be >= 1")
    words = response.lower().split()
    if len(words) < ngram_size:
        return 0.0
    ngrams = [tuple(words[i:i + ngram_size]) for i in range(len(words) - ngram_size + 1)]
    return (1.0 - len(set(ngrams)) / len(ngrams)) * max_penalty


def soft_overlong_reward(length: int, max_response_length: int, buffer_len: int, penalty_factor: float = 1.0) -> float:
    """open-r1's soft overlong punishment: DAPO's formula (megarl.algo.overlong_penalty, the
    one place it is written), clamped at −penalty_factor so that a response past
    max_response_length is not punished beyond the full penalty. Length in tokens."""
    # Imported here: megarl.algo pulls in torch, which no other reward function needs.
    from megarl.algo.overlong import overlong_penalty

    return max(overlong_penalty(length, max_response_length, buffer_len, penalty_factor), -penalty_factor)
