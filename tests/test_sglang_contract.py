"""megarl's SGLang payloads against the pinned SGLang version's own definitions.

The files come from the pinned wheel (`tools/fetch_sglang_api.py`, run by `make setup`):
`/generate` bodies are decoded with SGLang's generated JSON contract (api_types.py: the
schema both its Python and Rust servers enforce, unknown sampling keys rejected); the
embedded server's answers are decoded with the same contract; control bodies are checked
against the fields of the io_struct request each route parses, and every route the fleet
calls must exist in the pinned http_server.py.
"""

from __future__ import annotations

import ast
import asyncio
import base64
import importlib.util
import re
import struct
from pathlib import Path

import httpx
import pytest
import torch

from megarl.rollout import sglang_api
from megarl.rollout.engine import GenerationOutput, SamplingParams
from megarl.rollout.http import HTTPEngine
from megarl.weights import adapters, disk, group, ipc

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / ".venv" / "sglang-api" / sglang_api.SGLANG_VERSION


@pytest.fixture(scope="module")
def sglang_files() -> Path:
    import subprocess
    import sys

    # the fetcher keeps what it already has and downloads only when a file is missing
    subprocess.run([sys.executable, str(ROOT / "tools" / "fetch_sglang_api.py"), str(API.parent)], check=True,
                   capture_output=True)
    return API


@pytest.fixture(scope="module")
def api_types(sglang_files):
    spec = importlib.util.spec_from_file_location("sglang_api_types", sglang_files / "sglang/api/v1/api_types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def request_structs(sglang_files) -> dict[str, tuple[set[str], set[str]]]:
    """{struct name: (all fields, fields without a default)} of io_struct.py, BaseReq's included."""
    tree = ast.parse((sglang_files / "sglang/srt/managers/io_struct.py").read_text())
    structs = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            fields, required = set(), set()
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    fields.add(item.target.id)
                    if item.value is None:
                        required.add(item.target.id)
            bases = [b.id for b in node.bases if isinstance(b, ast.Name)]
            structs[node.name] = (fields, required, bases)
    out = {}
    for name, (fields, required, bases) in structs.items():
        for base in bases:
            if base in structs:
                fields = fields | structs[base][0]
        out[name] = (fields, required)
    return out


SAMPLING_CASES = [
    SamplingParams(max_new_tokens=16, temperature=0.0),
    SamplingParams(max_new_tokens=500, temperature=1.0, top_p=0.7, seed=12345),
    SamplingParams(max_new_tokens=8, temperature=0.6, top_k=20, stop=("</search>", "</answer>"),
                   stop_token_ids=(151643, 151645)),
    SamplingParams(max_new_tokens=4, ignore_eos=True),
]


@pytest.mark.parametrize("params", SAMPLING_CASES)
def test_generate_bodies_satisfy_the_pinned_contract(api_types, params):
    body = sglang_api.generate_body([1, 2, 3], params)
    decoded = api_types.GenerateRequest.from_json_value(body)
    assert decoded.input_ids == [1, 2, 3] and decoded.return_logprob is True and decoded.text is None
    sampling = api_types.SamplingParams.from_json_value(body["sampling_params"])
    assert sampling.max_new_tokens == params.max_new_tokens
    assert sampling.temperature == params.temperature and sampling.top_p == params.top_p
    assert sampling.no_stop_trim is True  # a stop string stays in the tokens we train on
    assert sampling.sampling_seed == params.seed
    assert list(sampling.stop) == list(params.stop) and list(sampling.stop_token_ids) == list(params.stop_token_ids)


def test_the_probe_body_and_answer_satisfy_the_pinned_contract(api_types):
    body = sglang_api.prompt_log_probs_body([4, 5, 6])
    decoded = api_types.GenerateRequest.from_json_value(body)
    assert decoded.input_ids == [4, 5, 6] and decoded.return_logprob is True and decoded.logprob_start_len == 0
    assert api_types.SamplingParams.from_json_value(body["sampling_params"]).max_new_tokens == 1
    # SGLang's answer: one entry a prompt token, the first with no log-prob
    answer = sglang_api.output_to_sglang(GenerationOutput([9], [-0.3], "length", prompt_tokens=3), True)
    answer["meta_info"]["input_token_logprobs"] = sglang_api.prompt_log_probs_to_sglang([4, 5, 6], [-1.5, -2.5])
    meta = api_types.GenerateResponse.from_json_value(answer).meta_info
    assert [(e.logprob, e.token_id) for e in meta.input_token_logprobs] == [(None, 4), (-1.5, 5), (-2.5, 6)]
    assert sglang_api.prompt_log_probs_from_sglang(answer, 3) == [-1.5, -2.5]
    with pytest.raises(ValueError, match="holds 3 entries for a prompt of 4 tokens"):
        sglang_api.prompt_log_probs_from_sglang(answer, 4)


def test_bodies_served_with_a_lora_adapter_name_it_as_sglang_reads_it(api_types):
    for body in (sglang_api.generate_body([1, 2], SamplingParams(), "megarl-v000003"),
                 sglang_api.prompt_log_probs_body([1, 2], "megarl-v000003")):
        assert api_types.GenerateRequest.from_json_value(body).lora_path == "megarl-v000003"
    assert "lora_path" not in sglang_api.generate_body([1, 2], SamplingParams())  # the base, no adapter


def test_the_contract_decoder_rejects_what_sglang_rejects(api_types):
    # the check above can fail: a key SGLang does not know is refused by its own decoder
    body = sglang_api.generate_body([1], SamplingParams())
    body["sampling_params"]["frobnicate"] = 1
    with pytest.raises(api_types.JsonContractError):
        api_types.GenerateRequest.from_json_value(body)


@pytest.mark.parametrize("out", [
    GenerationOutput([5, 6, 7], [-0.1, -0.2, -0.3], "length", weight_version=3, prompt_tokens=4),
    GenerationOutput([5, 9], [-0.1, -0.5], "stop", matched_stop=9, weight_version=0, prompt_tokens=2),
    GenerationOutput([5], [-0.1], "stop", matched_stop="</search>", prompt_tokens=2),
    GenerationOutput([], [], "abort", message="engine stopped", prompt_tokens=2),
    GenerationOutput([5, 6, 7], [-0.1, -0.2, -0.3], "abort", message="x", weight_version=3, token_versions=[3, 4, 4]),
])
def test_answers_decode_with_the_contract_and_back(api_types, out):
    payload = sglang_api.output_to_sglang(out, return_logprob=True, text="t")
    decoded = api_types.GenerateResponse.from_json_value(payload)
    assert list(decoded.output_ids) == out.token_ids
    assert [e.token_id for e in decoded.meta_info.output_token_logprobs] == out.token_ids
    assert decoded.meta_info.weight_version == str(out.weight_version)
    assert [(s.version, s.start, s.end) for s in decoded.meta_info.weight_versions] == \
        [(s["version"], s["start"], s["end"]) for s in sglang_api.version_spans(out.versions())]
    back = sglang_api.output_from_sglang(payload)
    assert (back.token_ids, back.log_probs, back.finish_reason, back.matched_stop, back.weight_version,
            back.versions()) == (out.token_ids, out.log_probs, out.finish_reason, out.matched_stop,
                                 out.weight_version, out.versions())


CONTROL_BODIES = {
    "/update_weights_from_disk": disk.update_body("/shared/w/v000003", 3),
    "/init_weights_update_group": group.init_group_body("10.0.0.1", 29500, 1, 9, "megarl-sync-rank0", "nccl"),
    "/destroy_weights_update_group": group.destroy_group_body("megarl-sync-rank0"),
    "/update_weights_from_distributed": group.distributed_update_body(
        ["model.embed_tokens.weight", "lm_head.weight"], ["bfloat16", "bfloat16"], [[300, 64], [300, 64]],
        "megarl-sync-rank0", 7),
    "/update_weights_from_tensor": ipc.tensor_update_body(["b64a", "b64b"], 7),
    "/load_lora_adapter": adapters.load_body(adapters.adapter_name(7), "/shared/w/v000007"),
    "/unload_lora_adapter": adapters.unload_body(adapters.adapter_name(6)),
    "/update_weight_version": adapters.version_body(7),
    "/pause_generation": sglang_api.pause_body(),
    "/continue_generation": sglang_api.continue_body(),
    "/abort_request": sglang_api.abort_all_body(),
    "/release_memory_occupation": sglang_api.memory_body(),
    "/resume_memory_occupation": sglang_api.memory_body(["weights"]),
    "/begin_weight_update": sglang_api.begin_update_body(),
    "/end_weight_update": sglang_api.end_update_body(),
}


@pytest.mark.parametrize("route", sorted(sglang_api.CONTROL_ROUTES))
def test_control_bodies_match_the_request_structs(request_structs, sglang_files, route):
    body = CONTROL_BODIES[route]
    fields, required = request_structs[sglang_api.CONTROL_ROUTES[route]]
    assert set(body) <= fields, f"{route}: fields SGLang does not know: {set(body) - fields}"
    assert required <= set(body), f"{route}: required fields missing: {required - set(body)}"
    server = (sglang_files / "sglang/srt/entrypoints/http_server.py").read_text()
    assert re.search(rf'@app\.(post|api_route)\("{re.escape(route)}"', server), f"{route} is not served"


def test_every_control_route_has_a_body_here():
    assert set(CONTROL_BODIES) == set(sglang_api.CONTROL_ROUTES)


def test_weight_versions_and_pause_mode():
    # SGLang's weight_version is a string; its default pause mode ("abort") would drop requests
    assert disk.update_body("/w", 12)["weight_version"] == "12"
    assert sglang_api.pause_body() == {"mode": "retract"}
    with pytest.raises(ValueError, match="kv_cache"):
        sglang_api.memory_body(["activations"])


def test_client_sends_the_contract_bodies(api_types):
    """HTTPEngine's requests, captured at the transport, are the bodies checked above."""
    seen = []

    def handler(request: httpx.Request) -> httpx.Response:
        import json

        seen.append((request.url.path, json.loads(request.content) if request.content else None))
        if request.url.path == "/generate":
            return httpx.Response(200, json=sglang_api.output_to_sglang(
                GenerationOutput([4], [-0.5], "length", weight_version=2, prompt_tokens=1), True))
        return httpx.Response(200, json={"success": True, "message": "ok", "status": "ok"})

    async def go():
        client = HTTPEngine("http://engine", transport=httpx.MockTransport(handler))
        out = await client.generate([1, 2], SAMPLING_CASES[2])
        await client.begin_weight_update()
        await client.load_from_disk("/w/v2", 2)
        await client.end_weight_update()
        await client.release_memory()
        await client.resume_memory(["kv_cache"])
        return out

    out = asyncio.run(go())
    assert out.token_ids == [4] and out.weight_version == 2
    bodies = dict(seen)
    # the weights load inside SGLang's weight-update session, with decoding paused around it
    assert [path for path, _ in seen[1:7]] == ["/pause_generation", "/begin_weight_update", "/update_weights_from_disk",
                                              "/end_weight_update", "/flush_cache", "/continue_generation"]
    api_types.GenerateRequest.from_json_value(bodies["/generate"])
    assert bodies["/pause_generation"] == CONTROL_BODIES["/pause_generation"]
    assert bodies["/update_weights_from_disk"] == disk.update_body("/w/v2", 2)
    assert bodies["/resume_memory_occupation"] == {"tags": ["kv_cache"]}


def module_names(path: Path) -> dict[str, ast.AST]:
    """The top-level classes, functions and assignments of a module, by name."""
    names = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.ClassDef, ast.FunctionDef)):
            names[node.name] = node
        elif isinstance(node, ast.Assign):
            names.update({t.id: node for t in node.targets if isinstance(t, ast.Name)})
    return names


def test_memory_tags_are_the_pinned_versions(sglang_files):
    constants = module_names(sglang_files / "sglang/srt/constants.py")
    values = {name: node.value.value for name, node in constants.items()
              if name.startswith("GPU_MEMORY_TYPE_") and isinstance(node.value, ast.Constant)}
    every = [values[e.id] for e in constants["GPU_MEMORY_ALL_TYPES"].value.elts]
    assert sorted(sglang_api.MEMORY_TAGS) == sorted(every)


def test_the_sglang_internals_ipc_imports_exist_in_the_pinned_version(sglang_files):
    """megarl.weights.ipc.sglang_ipc_api imports these; SGLang moves internals between versions."""
    srt = sglang_files / "sglang/srt"
    assert "from sglang.srt.utils.common import *" in (srt / "utils/__init__.py").read_text()
    serializer = module_names(srt / "utils/common.py")["MultiprocessingSerializer"]
    methods = {f.name: f for f in serializer.body if isinstance(f, ast.FunctionDef)}
    assert "output_str" in [a.arg for a in methods["serialize"].args.args + methods["serialize"].args.kwonlyargs]
    assert "monkey_patch_torch_reductions" in module_names(srt / "utils/patch_torch.py")
    metadata = module_names(srt / "weight_sync/tensor_bucket.py")["FlattenedTensorMetadata"]
    fields = [f.target.id for f in metadata.body if isinstance(f, ast.AnnAssign)]
    assert fields == ["name", "shape", "dtype", "start_idx", "end_idx", "numel"]  # what SGLangHandles fills in


@pytest.mark.parametrize("installed, message", [
    (None, "need SGLang 0.5.23 installed too"),  # no sglang on the train ranks
    ("0.4.6", "as of SGLang 0.5.23; this environment has 0.4.6: install 0.5.23 or use sync.transport=nccl or disk"),
])
def test_ipc_refuses_an_sglang_whose_internals_it_was_not_written_for(monkeypatch, installed, message):
    import sys
    import types

    module = None
    if installed is not None:
        module = types.ModuleType("sglang")
        module.__version__ = installed
    monkeypatch.setitem(sys.modules, "sglang", module)  # None makes `import sglang` fail
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ipc.sglang_ipc_api()


@pytest.mark.parametrize("colocated, gpus", [(True, 8), (False, 8), (False, 0)])
def test_the_launch_flags_are_sglangs(sglang_files, colocated, gpus):
    """Every option megarl gives `sglang.launch_server` is one of the pinned version's server
    arguments: a field of its arg_groups/fields dataclasses, flag "--" + the name with "-" for
    "_" (arg_utils._field_to_cli_name); the options given without a value are booleans."""
    from megarl.config import load_config
    from megarl.rollout.engine_unit import rank_args
    from megarl.rollout.sglang_launch import server_command

    groups = sglang_files / "sglang/srt/arg_groups"
    assert 'return "--" + name.replace("_", "-")' in (groups / "arg_utils.py").read_text()
    fields = {item.target.id: ast.unparse(item.annotation)
              for path in (groups / "fields").glob("*.py") for node in ast.walk(ast.parse(path.read_text()))
              if isinstance(node, ast.ClassDef) for item in node.body
              if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}
    tp = 4 if gpus else 1
    cfg = load_config(None, ["model.path=m", "model.tokenizer_path=t", "model.trust_remote_code=true",
                             "rollout.engine=sglang", "rollout.sglang.server=sglang", f"cluster.gpus_per_node={gpus}",
                             f"rollout.tensor_parallel_size={tp}", f"rollout.expert_parallel_size={tp}",
                             "rollout.mode=disaggregated", "actor.moe_routing_replay=true"])
    argv = server_command(cfg, colocated)
    assert "--enable-return-routed-experts" in argv  # the experts of every token, for the trainer to replay
    if gpus:
        assert argv[argv.index("--ep-size") + 1] == "4"  # a mixture of experts split over the engine's GPUs
    else:  # SGLang's CPU engine, its KV cache sized in tokens
        assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--max-total-tokens") + 1] == "32768"
    # as ServerProcess starts node rank 1 of an engine across two nodes (megarl.rollout.engine_unit)
    argv = [*argv[argv.index("sglang.launch_server") + 1:], *rank_args(2, 1, "10.0.0.1:5000"), "--host", "10.0.0.1",
            "--port", "30000"]
    given = {argv[i]: i + 1 < len(argv) and not argv[i + 1].startswith("--")
             for i in range(len(argv)) if argv[i].startswith("--")}
    assert ("--enable-memory-saver" in given) is colocated and "--trust-remote-code" in given
    assert {"--nnodes", "--node-rank", "--dist-init-addr"} <= set(given)
    for flag, has_value in given.items():
        name = flag[2:].replace("-", "_")
        assert name in fields, f"{flag} is not an option of SGLang {sglang_api.SGLANG_VERSION}"
        if not has_value:
            assert "bool" in fields[name], f"{flag} is given without a value but is {fields[name]}"


def test_the_api_key_is_sglangs(sglang_files):
    """The fleet starts SGLang with --api-key (the `api_key` option of its serving settings), and
    megarl's embedded server leaves open exactly the paths SGLang's middleware does: those that
    start with the prefixes decide_request_auth tests (sglang_api.OPEN_PATH_PREFIXES)."""
    srt = sglang_files / "sglang/srt"
    serving = [c for c in module_names(srt / "arg_groups/fields/serving.py").values() if isinstance(c, ast.ClassDef)]
    assert "api_key" in {f.target.id for c in serving for f in c.body if isinstance(f, ast.AnnAssign)}
    decide = module_names(srt / "utils/auth.py")["decide_request_auth"]
    prefixes = {call.args[0].value for call in ast.walk(decide) if isinstance(call, ast.Call)
                and isinstance(call.func, ast.Attribute) and call.func.attr == "startswith"
                and isinstance(call.func.value, ast.Name) and call.func.value.id == "path"}
    assert prefixes == set(sglang_api.OPEN_PATH_PREFIXES)
    assert "bearer" in {c.value for c in ast.walk(decide) if isinstance(c, ast.Constant)}  # Authorization: Bearer


def test_routed_experts_bodies_and_answers(api_types, request_structs):
    # asked for from position 5: the typed contract has the start, the route's GenerateReqInput the switch
    body = sglang_api.generate_body([1, 2, 3, 4, 5, 6], SamplingParams(max_new_tokens=3, routed_experts_from=5))
    assert api_types.GenerateRequest.from_json_value(body).routed_experts_start_len == 5
    fields, _ = request_structs["GenerateReqInput"]
    assert {"return_routed_experts", "routed_experts_start_len"} <= fields
    # the answer: base64 of little-endian int32 (positions 5 .. 7 of 6 prompt + 3 output tokens, 2 layers x top-2)
    routed = torch.tensor([[0, 3, 1, 2], [5, 4, 0, 1], [2, 3, 3, 2]], dtype=torch.int16)
    out = GenerationOutput([7, 8, 9], [-0.1, -0.2, -0.3], "length", prompt_tokens=6, routed_experts=routed)
    payload = sglang_api.output_to_sglang(out, return_logprob=True)
    raw = base64.b64decode(payload["meta_info"]["routed_experts"])
    assert struct.unpack("<12i", raw) == tuple(routed.flatten().tolist())
    api_types.GenerateResponse.from_json_value(payload)  # unknown meta_info keys are SGLang's too
    assert torch.equal(sglang_api.output_from_sglang(payload, 5).routed_experts, routed)
    assert sglang_api.output_from_sglang(payload).routed_experts is None  # not asked for
    with pytest.raises(ValueError, match="not a whole row for each of the 7 positions"):
        sglang_api.output_from_sglang({**payload, "output_ids": [7, 8, 9] * 2 + [7]}, 5)
    broken = {**payload, "meta_info": {**payload["meta_info"], "routed_experts": "AAAA!AAA"}}
    with pytest.raises(ValueError, match="routed_experts is not base64"):
        sglang_api.output_from_sglang(broken, 5)


def test_a_request_aborted_before_its_prefill_is_an_empty_preempted_output():
    """SGLang answers a request aborted while it waited for its prefill with no output_ids and
    no log-probs; our abort's request is an empty output to continue, not an error."""
    answer = {"text": "", "meta_info": {"id": "r1", "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                                        "weight_version": "3", "e2e_latency": 0.1}}
    out = sglang_api.output_from_sglang(answer)
    assert (out.token_ids, out.log_probs, out.finish_reason, out.message) == ([], [], "abort", "Abort before prefill")
    with pytest.raises(ValueError, match="neither output_ids"):  # a finished answer without tokens is still wrong
        sglang_api.output_from_sglang({"meta_info": {"finish_reason": {"type": "length", "length": 4}}})

    async def go():
        arrived, aborted = asyncio.Event(), asyncio.Event()

        async def handler(request: httpx.Request) -> httpx.Response:
            arrived.set()
            await aborted.wait()  # the call is in flight when our abort comes
            return httpx.Response(200, json=answer)

        client = HTTPEngine("http://engine", transport=httpx.MockTransport(handler))
        call = asyncio.ensure_future(client.generate([1, 2], SAMPLING_CASES[2]))
        await arrived.wait()
        client.mark_preempted()
        aborted.set()
        return await call

    out = asyncio.run(go())
    assert out.token_ids == [] and out.preempted
