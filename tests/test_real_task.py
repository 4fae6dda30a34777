"""The real-model quickstart's task: the last-number reward and the held-out split."""

from __future__ import annotations

import pyarrow.parquet as pq
import pytest

from megarl.quickstart.real_task import final_number_score, write_addition_data


@pytest.mark.parametrize("response,truth,correct,pred", [
    ("9 + 5 = 14.", "14", True, "14"),
    ("The answer is 14", "14", True, "14"),
    ("14 is not right, it is 13", "14", False, "13"),
    ("fourteen", "14", False, ""),
    ("-3", "-3", True, "-3"),
    ("9 + 5 = 014", "14", True, "014"),
])
def test_the_last_integer_is_the_answer(response, truth, correct, pred):
    assert final_number_score("addition", response, truth) == {"score": float(correct), "acc": correct, "pred": pred}


def test_held_out_pairs_never_appear_in_training_in_either_order(tmp_path):
    paths = write_addition_data(tmp_path, num_val=20, seed=3)

    def pairs(path):
        rows = pq.read_table(path).to_pylist()
        out = set()
        for row in rows:
            words = row["prompt"][0]["content"].split()  # "What is A + B? ..."
            a, b = int(words[2]), int(words[4].rstrip("?"))
            assert row["reward_model"]["ground_truth"] == str(a + b) and row["data_source"] == "addition"
            out.add((a, b))
        return out

    train, val = pairs(paths["train"]), pairs(paths["val"])
    assert train | val == {(a, b) for a in range(1, 10) for b in range(1, 10)}  # all 81, once
    assert not train & val
    assert len({tuple(sorted(p)) for p in val}) == 20 and all((b, a) in val for a, b in val)
    with pytest.raises(ValueError, match="hold out between 1 and 44"):
        write_addition_data(tmp_path / "x", num_val=45)
