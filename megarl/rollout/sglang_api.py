"""SGLang's native HTTP API, pinned: the bodies megarl sends and the answers it reads.

Every payload that crosses to an engine server is built here, once, and both sides use it:
the client (`megarl.rollout.http.HTTPEngine`, which the SGLang fleet uses) and megarl's own
server for the embedded engine (`megarl.rollout.http.create_engine_app`). The pinned
version's schema is the reference: `/generate` follows `sglang/api/v1/api_types.py`
(GenerateRequest / GenerateResponse), the control routes follow the request structs of
`sglang/srt/managers/io_struct.py` named in `CONTROL_ROUTES`. tests/test_sglang_contract.py
checks every body built here against that version's own files.

Main entry points: `generate_body`, `output_from_sglang`, `output_to_sglang`, and the
`*_body` builders of the weight-update and control routes.
"""

from __future__ import annotations

from megarl.rollout.engine import GenerationOutput, SamplingParams

SGLANG_VERSION = "0.5.23"  # the server API megarl is written against (pyproject's gpu extra pins it)
SGLANG_ROUTER_VERSION = "0.3.2"

# route -> the request struct of io_struct.py that SGLang parses its JSON body into
CONTROL_ROUTES = {
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}

# SGLang's load_format for one flat buffer per bucket: tensors packed back to back in order,
# no padding (its FlattenedTensorBucket); megarl.transport packs the same way.
FLATTENED_BUCKET = "flattened_bucket"
MEMORY_TAGS = ("weights", "kv_cache")  # what release/resume_memory_occupation can free


def generate_body(prompt_ids: list[int], params: SamplingParams) -> dict:
    """POST /generate: token ids in, token ids and sampled-token log-probs out (never text)."""
    return {"input_ids": list(prompt_ids), "sampling_params": params.to_sglang(), "return_logprob": True}


def output_to_sglang(out: GenerationOutput, return_logprob: bool, text: str = "") -> dict:
    """The /generate answer for one request (GenerateResponse)."""
    if out.finish_reason == "stop":
        finish = {"type": "stop", "matched": out.matched_stop}
    elif out.finish_reason == "length":
        finish = {"type": "length", "length": len(out.token_ids)}
    else:
        finish = {"type": "abort", "message": out.message or "aborted"}
    meta = {"finish_reason": finish, "prompt_tokens": out.prompt_tokens, "completion_tokens": len(out.token_ids),
            "weight_version": str(out.weight_version)}
    if return_logprob:
        meta["output_token_logprobs"] = [[lp, tid, None] for lp, tid in zip(out.log_probs, out.token_ids)]
    return {"text": text, "output_ids": list(out.token_ids), "meta_info": meta}


def output_from_sglang(payload: dict) -> GenerationOutput:
    """Read a /generate answer; the tokens are output_ids (or the log-prob entries' ids)."""
    meta = payload.get("meta_info") or {}
    finish = meta.get("finish_reason") or {"type": "abort", "message": "no finish_reason in the response"}
    logprobs = meta.get("output_token_logprobs")
    ids = payload.get("output_ids")
    if ids is None and logprobs is not None:
        ids = [item[1] for item in logprobs]
    if ids is None:
        raise ValueError("the server's response has neither output_ids nor output_token_logprobs; "
                         "megarl needs token ids (send return_logprob=true)")
    version = meta.get("weight_version")
    return GenerationOutput(
        token_ids=list(ids),
        log_probs=[float(item[0]) for item in logprobs] if logprobs is not None else [],
        finish_reason=finish.get("type", "abort"),
        matched_stop=finish.get("matched"),
        weight_version=int(version) if str(version or "").isdigit() else 0,
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        message=finish.get("message"),
    )


def pause_body() -> dict:
    """Pause without losing requests: "retract" puts running requests back in the queue (their
    KV cache may then be flushed and is recomputed on continue); SGLang's default, "abort",
    would end them."""
    return {"mode": "retract"}


def continue_body() -> dict:
    return {}


def memory_body(tags: list[str] | None = None) -> dict:
    """release/resume_memory_occupation; tags None = weights and KV cache together."""
    if tags is not None and not set(tags) <= set(MEMORY_TAGS):
        raise ValueError(f"memory tags {tags}: SGLang knows {list(MEMORY_TAGS)}")
    return {"tags": list(tags) if tags is not None else None}


def disk_update_body(model_path: str, version: int) -> dict:
    """Load every *.safetensors file under model_path (HF names) in place."""
    return {"model_path": str(model_path), "weight_version": str(version), "flush_cache": True}


def init_group_body(master_address: str, master_port: int, rank_offset: int, world_size: int,
                    group_name: str, backend: str) -> dict:
    """Join a weight-update process group: the trainer is rank 0, the engine's TP ranks are
    rank_offset .. rank_offset + tp - 1."""
    return {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend}


def destroy_group_body(group_name: str) -> dict:
    return {"group_name": group_name}


def distributed_update_body(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                            version: int) -> dict:
    """Receive one flat bucket broadcast from rank 0 of the group and load it."""
    return {"names": list(names), "dtypes": list(dtypes), "shapes": [list(s) for s in shapes],
            "group_name": group_name, "weight_version": str(version), "load_format": FLATTENED_BUCKET,
            "flush_cache": False}


def tensor_update_body(serialized_per_tp_rank: list[str], version: int) -> dict:
    """CUDA IPC handles of one flat bucket, one base64 string per engine TP rank."""
    return {"serialized_named_tensors": list(serialized_per_tp_rank), "load_format": FLATTENED_BUCKET,
            "weight_version": str(version), "flush_cache": False}
