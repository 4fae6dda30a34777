"""Fetch the pinned SGLang version's API definitions for the contract tests.

    python tools/fetch_sglang_api.py [DEST]      (default: .venv/sglang-api)

Downloads the pinned wheel (megarl.versions.SGLANG_VERSION) from the package index without
its dependencies and keeps a few files of it: the HTTP server's routes
(`srt/entrypoints/http_server.py`), the request structs of the control routes
(`srt/managers/io_struct.py`), the /generate JSON contract (`api/v1/api_types.py`), the
memory tags (`srt/constants.py`), the internals megarl.weights.ipc imports, the server's
options (`srt/arg_groups/fields/*.py`, flags named by `srt/arg_groups/arg_utils.py`) and the
API key's middleware (`srt/utils/auth.py`).
tests/test_sglang_contract.py checks megarl's payloads against them. Nothing of SGLang is
installed or imported here (only api_types.py is imported, and it needs msgspec alone).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from megarl.versions import SGLANG_VERSION  # noqa: E402

FILES = ("sglang/srt/entrypoints/http_server.py", "sglang/srt/managers/io_struct.py", "sglang/api/v1/api_types.py",
         # the memory tags, and the internals the ipc transport imports to serialise CUDA handles
         "sglang/srt/constants.py", "sglang/srt/utils/__init__.py", "sglang/srt/utils/common.py",
         "sglang/srt/utils/patch_torch.py", "sglang/srt/weight_sync/tensor_bucket.py",
         # the server's options (one dataclass field per flag, named by arg_utils.py), and the
         # paths the server leaves open without --api-key
         "sglang/srt/arg_groups/arg_utils.py",
         *(f"sglang/srt/arg_groups/fields/{group}.py" for group in (
             "device", "disagg", "exec_", "lora", "memory", "mm", "model", "observability", "parallel", "schedule",
             "serving", "spec")),
         "sglang/srt/utils/auth.py")


def fetch(dest: Path) -> Path:
    """The pinned version's FILES under dest/VERSION, downloaded unless all are there."""
    target = dest / SGLANG_VERSION
    if all((target / f).is_file() for f in FILES):
        return target
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                        f"sglang=={SGLANG_VERSION}", "-d", tmp], check=True)
        (wheel,) = Path(tmp).glob("sglang-*.whl")
        with zipfile.ZipFile(wheel) as zf:
            for name in FILES:
                out = target / name
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(zf.read(name))
    return target


if __name__ == "__main__":
    where = fetch(Path(sys.argv[1] if len(sys.argv) > 1 else ".venv/sglang-api"))
    print(f"SGLang {SGLANG_VERSION} API files in {where}")
