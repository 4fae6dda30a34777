"""The versions of outside servers megarl speaks to, pinned in one place: SGLang's HTTP API
(megarl.rollout.sglang_api) and the SGLang internals the CUDA IPC transport uses to serialise
tensor handles (megarl.weights.ipc). pyproject's gpu extra installs these versions."""

SGLANG_VERSION = "0.5.23"
SGLANG_ROUTER_VERSION = "0.3.2"
