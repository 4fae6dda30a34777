"""SGLang's native HTTP API, pinned: the bodies megarl sends and the answers it reads.

Every payload that crosses to an engine server is built once, and both sides use it: the
client (`megarl.rollout.http.HTTPEngine`, which the SGLang fleet uses) and megarl's own
server for the embedded engine (`megarl.rollout.http.create_engine_app`). Generation and
the control routes are built here; each weight transport builds its own routes' bodies in
its module (megarl.weights.*) and declares their request structs, which `CONTROL_ROUTES`
collects. The pinned version's schema is the reference: `/generate` follows
`sglang/api/v1/api_types.py` (GenerateRequest / GenerateResponse), the control routes follow
the request structs of `sglang/srt/managers/io_struct.py` named in `CONTROL_ROUTES`.
tests/test_sglang_contract.py checks every body against that version's own files.

Main entry points: `generate_body`, `output_from_sglang`, `output_to_sglang`, `prompt_log_probs_body`,
`CONTROL_ROUTES`,
`open_without_key`, and the `*_body` builders of the control routes.
"""

from __future__ import annotations

import binascii

import numpy as np
import pybase64
import torch

from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.rollout.token_rows import VersionRuns
from megarl.versions import SGLANG_ROUTER_VERSION, SGLANG_VERSION  # noqa: F401 (the server API megarl is written against)
from megarl.weights import all_transports

# route -> the request struct of io_struct.py that SGLang parses its JSON body into: the
# control routes here, then each weight transport's own
CONTROL_ROUTES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}
for _transport in all_transports():
    CONTROL_ROUTES |= _transport.request_structs
# the paths SGLang serves without its API key (sglang/srt/utils/auth.py decide_request_auth:
# every path that starts with one of these, for k8s probes and Prometheus scrapers); megarl's
# embedded server leaves open the same ones
OPEN_PATH_PREFIXES = ("/health", "/ready", "/metrics")


def open_without_key(path: str) -> bool:
    """Whether a server started with an API key answers `path` without it (as SGLang does)."""
    return path.startswith(OPEN_PATH_PREFIXES)


# what release/resume_memory_occupation can free (sglang/srt/constants.py GPU_MEMORY_ALL_TYPES);
# released and resumed by name, every one of them: no tags means all of them to SGLang
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")


def generate_body(prompt_ids: list[int], params: SamplingParams, adapter: str | None = None) -> dict:
    """POST /generate: token ids in, token ids and sampled-token log-probs out (never text);
    the routed experts when asked for (the route parses io_struct's GenerateReqInput, which has
    return_routed_experts; the typed GenerateRequest of api_types has the start only). `adapter`:
    the LoRA adapter to serve it with, by the name it was loaded under (GenerateReqInput.lora_path)."""
    body = {"input_ids": list(prompt_ids), "sampling_params": params.to_sglang(), "return_logprob": True}
    if params.routed_experts_from is not None:
        body |= {"return_routed_experts": True, "routed_experts_start_len": params.routed_experts_from}
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def prompt_log_probs_body(token_ids: list[int], adapter: str | None = None) -> dict:
    """POST /generate for the weights probe (megarl.weights.probe): the log-prob of every token
    of `token_ids` given the ones before it (return_logprob from logprob_start_len 0). SGLang
    0.5.23 takes these from the raw logits whatever the request's temperature (measured:
    tests/sglang_real/test_probe.py); one greedy token is generated and ignored. `adapter`: as
    for generate_body (the probe checks what the rollouts are served with)."""
    body = {"input_ids": list(token_ids), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
    if adapter is not None:
        body["lora_path"] = adapter
    return body


def prompt_log_probs_from_sglang(payload: dict, num_tokens: int) -> list[float]:
    """The log-probs of tokens 1 .. num_tokens - 1 from a /generate answer to
    `prompt_log_probs_body`: meta_info.input_token_logprobs, one [log-prob, token id, text]
    entry a prompt token, the first with no log-prob (nothing precedes it)."""
    entries = (payload.get("meta_info") or {}).get("input_token_logprobs")
    if not isinstance(entries, list) or len(entries) != num_tokens:
        raise ValueError(f"meta_info.input_token_logprobs holds {len(entries) if isinstance(entries, list) else 0} "
                         f"entries for a prompt of {num_tokens} tokens (asked from logprob_start_len 0)")
    return [float(entry[0]) for entry in entries[1:]]


def prompt_log_probs_to_sglang(token_ids: list[int], log_probs: list[float]) -> list[list]:
    """meta_info.input_token_logprobs as SGLang writes it (the inverse of prompt_log_probs_from_sglang)."""
    return [[None, token_ids[0], None]] + [[lp, t, None] for lp, t in zip(log_probs, token_ids[1:])]


def encode_routed_experts(routed: torch.Tensor) -> str:
    """meta_info.routed_experts as SGLang sends it: base64 of the little-endian int32 array
    (tokens, layers, top-k) in C order."""
    return pybase64.b64encode(routed.to(torch.int32).numpy().astype("<i4").tobytes()).decode("ascii")


def decode_routed_experts(text: str, rows: int) -> torch.Tensor:
    """(rows, layers x top-k) int16 from meta_info.routed_experts, `rows` the positions it covers.
    A 6,000-token answer of Qwen3-30B-A3B carries 12 MB of it; pybase64 against the standard
    library on it: `python tools/bench/codecs.py`."""
    try:
        flat = np.frombuffer(pybase64.b64decode(text, validate=True), dtype="<i4")
    except (binascii.Error, ValueError) as error:
        raise ValueError(f"meta_info.routed_experts is not base64 ({error})") from error
    if rows <= 0 or flat.size % rows:
        raise ValueError(f"meta_info.routed_experts holds {flat.size} expert ids, not a whole row for each "
                         f"of the {rows} positions asked for")
    if flat.size and (flat.min() < -1 or flat.max() >= 1 << 15):
        raise ValueError(f"meta_info.routed_experts holds expert ids out of range ({flat.min()} .. {flat.max()})")
    return torch.from_numpy(flat.astype(np.int16).reshape(rows, -1))


def output_to_sglang(out: GenerationOutput, return_logprob: bool, text: str = "") -> dict:
    """The /generate answer for one request (GenerateResponse)."""
    if out.finish_reason == "stop":
        finish = {"type": "stop", "matched": out.matched_stop}
    elif out.finish_reason == "length":
        finish = {"type": "length", "length": len(out.token_ids)}
    else:
        finish = {"type": "abort", "message": out.message or "aborted"}
    meta = {"finish_reason": finish, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "weight_version": str(out.weight_version), "weight_versions": version_spans(out.versions())}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(out.log_probs, out.token_ids)]
    if out.routed_experts is not None:
        meta["routed_experts"] = encode_routed_experts(out.routed_experts)
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


def output_from_sglang(payload: dict, routed_experts_from: int | None = None) -> GenerationOutput:
    """Read a /generate answer; the tokens are output_ids (or the log-prob entries' ids); the
    routed experts (asked for from position `routed_experts_from`) where the answer has them."""
    meta = payload.get("meta_info") or {}
    finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason in the response"}
    logprobs = meta.get("output_token_logprobs")
    ids = payload.get("output_ids")
    if ids is None and logprobs is not None:
        ids = [item[1] for item in logprobs]
    if ids is None and finish.get("type") == "abort":
        ids = []  # aborted before its prefill (SGLang sends no tokens then): an empty output
    if ids is None:
        raise ValueError("the server's response has neither output_ids nor output_token_logprobs; "
                         "megarl needs token ids (send return_logprob=true)")
    version = meta.get("weight_version")
    routed = None
    if routed_experts_from is not None and meta.get("routed_experts"):
        rows = int(meta.get("prompt_tokens", 0)) + len(ids) - 1 - routed_experts_from
        routed = decode_routed_experts(meta["routed_experts"], rows)
    return GenerationOutput(
        routed_experts=routed,
        token_versions=token_versions(meta.get("weight_versions"), len(ids)),
        token_ids=list(ids),
        log_probs=[float(item[0]) for item in logprobs] if logprobs is not None else [],
        finish_reason=finish.get("type", "abort"),
        matched_stop=finish.get("matched"),
        weight_version=int(version) if str(version or "").isdigit() else 0,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        message=finish.get("message"),
    )


def version_spans(versions: list[int] | VersionRuns) -> list[dict]:
    """A version per token as SGLang's weight_versions spans (the inverse of token_versions)."""
    runs = versions if isinstance(versions, VersionRuns) else VersionRuns(versions)
    return [{"version": str(version), "start": start, "end": end} for version, start, end in runs.runs()]


def token_versions(spans, num_tokens: int) -> VersionRuns | None:
    """SGLang's meta_info.weight_versions ([{version, start, end}] over the output tokens, end
    exclusive) as runs of a version (what a trajectory holds: no version a token on the way);
    None when absent, not step numbers, or not covering each token once (then the output's
    weight_version stands for all)."""
    if not spans:
        return None
    runs = VersionRuns()
    for span in sorted(spans, key=lambda s: int(s.get("start", 0))):
        version = str(span.get("version", ""))
        if not version.isdigit():
            return None
        start, end = max(int(span.get("start", 0)), 0), min(int(span.get("end", 0)), num_tokens)
        if start != len(runs) or end < start:  # a token no span covers, or two
            return None
        runs.append_run(int(version), end - start)
    return runs if len(runs) == num_tokens else None


def abort_all_body() -> dict:
    """/abort_request for every request in flight (they answer with finish_reason abort and
    the tokens they have)."""
    return {"abort_all": True}


def pause_body() -> dict:
    """Pause without losing requests: "retract" puts running requests back in the queue (their
    KV cache may then be flushed and is recomputed on continue); SGLang's default, "abort",
    would end them."""
    return {"mode": "retract"}


def continue_body() -> dict:
    return {}


# SGLang 0.5.23 loads weights sent by a process group or as tensors only inside a weight-update
# session (sglang/srt/managers/scheduler_components/weight_updater.py): these routes refuse
# without one, and a second begin is refused while one is open
SESSION_REQUIRED_ROUTES = ("/update_weights_from_distributed", "/update_weights_from_tensor")
NO_SESSION = "no weight-update session is open"
SESSION_OPEN = "a weight-update session is already open"


def begin_update_body() -> dict:
    """Open a weight-update session on every runner of the engine (SGLang's selector "all")."""
    return {}


def end_update_body() -> dict:
    return {}


def memory_body(tags: list[str] | None = None) -> dict:
    """release/resume_memory_occupation of `tags` (None: every kind SGLang tracks)."""
    if tags is not None and not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags {tags}: SGLang knows {list(MEMORY_TAGS)}")
    return {"tags": list(tags) if tags is not None else None}
