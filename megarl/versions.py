"""The versions of outside servers megarl speaks to, pinned in one place: SGLang's HTTP API
(megarl.rollout.sglang_api) and the SGLang internals the CUDA IPC transport uses to serialise
tensor handles (megarl.weights.ipc). pyproject's gpu extra installs these versions."""

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"

# what a benchmark's figures depend on, printed by every tools/bench script before its figures
BENCH_PACKAGES = ("torch", "transformers", "megatron-core", "ray", "sglang-router", "mlflow", "numpy", "safetensors",
                  "bm25s", "faiss-cpu", "math-verify")


def installed_versions(packages: tuple[str, ...] = BENCH_PACKAGES) -> str:
    """One line: Python, each package's installed version ("-" when absent), the CPUs this
    process may use and, when torch is loaded, its intra-op threads."""
    import os
    import platform
    import sys
    from importlib import metadata

    parts = [f"python {platform.python_version()}"]
    for name in packages:
        try:
            parts.append(f"{name} {metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} -")
    parts.append(f"{len(os.sched_getaffinity(0))} CPUs ({platform.machine()})")
    if "torch" in sys.modules:
        parts.append(f"torch threads {sys.modules['torch'].get_num_threads()}")
    return "versions: " + ", ".join(parts)
