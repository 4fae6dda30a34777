"""megarl.rollout.token_rows: a trajectory's weight versions held as runs read exactly as the
list of one version a token they stand for."""

import pickle

import numpy as np
import pytest

from megarl.rollout.agent import Trajectory
from megarl.rollout.token_rows import VersionRuns


def test_versions_as_runs_read_as_the_list_they_stand_for():
    tokens = [3, 3, 3, 4, 4, 3, 5]
    runs = VersionRuns(tokens[:2])
    runs.extend(tokens[2:4])
    runs.append_run(4, 1)
    runs.extend(np.array(tokens[5:]))
    assert runs == tokens and list(runs) == tokens and len(runs) == 7
    assert [runs[i] for i in range(-7, 7)] == tokens + tokens
    with pytest.raises(IndexError):
        runs[7]
    assert np.asarray(runs, np.int64).tolist() == tokens and np.asarray(runs).dtype == np.int32
    assert runs[2:5] == tokens[2:5]
    assert repr(runs) == "VersionRuns(3 x 3, 4 x 2, 3 x 1, 5 x 1)"  # equal neighbours merged into one run
    assert pickle.loads(pickle.dumps(runs)) == tokens
    assert VersionRuns(runs) == runs and VersionRuns() == [] and not VersionRuns()


def test_a_trajectory_s_observation_takes_the_version_of_the_token_before():
    traj = Trajectory(prompt_ids=[1], weight_version=2)
    traj.extend([5, 6], None)  # before any sampled token: the trajectory's first weights
    traj.extend([7, 8, 9], [-0.5, -0.25, -0.125], [2, 3, 3])
    traj.extend([10, 11], None)
    assert traj.token_versions == [2, 2, 2, 3, 3, 3, 3]
    assert list(traj.loss_mask) == [0, 0, 1, 1, 1, 0, 0]
    assert Trajectory(prompt_ids=[1], token_versions=[1, 1, 2]).token_versions == [1, 1, 2]
