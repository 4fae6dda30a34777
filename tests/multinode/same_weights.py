"""Exits 1 unless two HF model directories hold exactly the same tensors (names, dtypes, shapes,
bytes), and those differ from the initial model's (training changed them): a run across nodes
must end on the weights of the same run on one node.

    python tests/multinode/same_weights.py DIR_A DIR_B INITIAL_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from safetensors.torch import load_file


def tensors(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(Path(directory).glob("*.safetensors")):
        out.update(load_file(f))
    assert out, f"{directory} holds no safetensors files"
    return out


def main() -> int:
    a, b = tensors(sys.argv[1]), tensors(sys.argv[2])
    if a.keys() != b.keys():
        print(f"different tensors: {sorted(a.keys() ^ b.keys())[:5]}")
        return 1
    differ = [n for n in sorted(a) if a[n].dtype != b[n].dtype or a[n].shape != b[n].shape or not torch.equal(a[n], b[n])]
    if differ:
        print(f"{len(differ)} of {len(a)} tensors differ, e.g. {differ[:5]}")
        return 1
    initial = tensors(sys.argv[3])
    if all(torch.equal(a[n], initial[n]) for n in a if n in initial):
        print(f"the runs did not change the initial weights of {sys.argv[3]}")
        return 1
    print(f"test-multinode: the same {len(a)} trained tensors, bit for bit ({sys.argv[1]} and {sys.argv[2]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
