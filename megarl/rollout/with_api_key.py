"""Run a server module with `--api-key` taken from the environment, off its command line:

    MEGARL_ENGINE_API_KEY=... python -m megarl.rollout.with_api_key sglang.launch_server ARGS...

runs `python -m sglang.launch_server ARGS... --api-key=KEY` in this process (one argument, so
a key that starts with "-", as one random key in 64 does, is still read as the value). A process's
command line can be read by every user of the node (`ps`, /proc/PID/cmdline); this one
shows the module and ARGS only, and the key is removed from the environment the server's
own children inherit. The fleet starts SGLang servers and sglang-router this way (neither
reads its key from the environment). Main entry point: `main`.
"""

from __future__ import annotations

import os
import runpy
import sys

from megarl.http_auth import ENGINE_KEY_ENV


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit("usage: python -m megarl.rollout.with_api_key MODULE [ARGS...]")
    key = os.environ.pop(ENGINE_KEY_ENV, "")
    if not key:
        sys.exit(f"megarl.rollout.with_api_key: {ENGINE_KEY_ENV} is not set; it holds the key {argv[0]} "
                 "is started with (the fleet sets it)")
    module, args = argv[0], argv[1:]
    sys.argv = [module, *args, f"--api-key={key}"]
    # as `python -m module`: __main__ is that module (its __spec__ names it, so processes it
    # spawns with multiprocessing import it, not this file)
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
