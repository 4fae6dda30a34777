"""The ipc transport's rank side in a process of the SGLang environment, on the CPU:

    MEGARL_ENGINE_API_KEY=KEY .venv-sglang/bin/python tests/sglang_real/tensor_sender.py URL WEIGHTS VERSION

sends the tensors of the safetensors file WEIGHTS to the server at URL as one train rank whose GPU
is the engine's (IpcSender, SGLang's own serializer), in buckets of two dtypes, with torch's
`file_system` sharing strategy: a CPU tensor then travels as a shared-memory file the server
maps, as a CUDA tensor travels as an IPC handle (with the default strategy, a file descriptor,
the server crashes). Prints {"buckets": N}. The caller opens and closes the weight-update session.
"""

import json
import os
import sys

import torch
import torch.multiprocessing
from safetensors.torch import load_file

from megarl.weights.buckets import group_tensors
from megarl.weights.ipc import IpcSender
from megarl.weights.transport import RankPlace


def main(url: str, weights: str, version: int) -> None:
    torch.multiprocessing.set_sharing_strategy("file_system")
    tensors = [(n, t.double() if "norm" in n else t) for n, t in load_file(weights).items()]  # two dtypes
    place = RankPlace(rank=0, node="127.0.0.1", gpu="0", stage=0, is_source=True)
    sender = IpcSender([place], 0, [(url, [0])], makes_handle=True, api_key=os.environ["MEGARL_ENGINE_API_KEY"])
    sender.open()
    sent = sender.send(group_tensors(tensors, 40_000), version)
    sender.close()
    print(json.dumps({"buckets": sent}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
