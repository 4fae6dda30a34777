"""The embedded rollout engine: an HF causal LM in-process, with continuous batching.

The CPU (and single-GPU) default behind `RolloutEngine`. Requests queue up; a scheduler
task admits waiting requests into free batch slots (one batched prefill), runs one decode
step for every running sequence, and retires finished ones between steps, so a short
answer frees its slot at once instead of waiting for the longest sequence of a batch. The
samples of a prompt share one prefill, a prompt that continues a finished sequence (the
next turn of a trajectory) reuses its cache, and prompts admitted together compute the tokens
they start with alike (a template's instruction) once (megarl.rollout.prefix_cache).
Model work runs on one dedicated thread, so the event loop (agent logic, HTTP server) stays
responsive while the model computes, and that thread has the CPU's OpenMP workers to itself
(megarl.rollout.openmp_workers).

Main entry point: `LocalEngine.from_pretrained(path)` or `LocalEngine(model, tokenizer)`.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from megarl.models.hf_layout import checkpoint_views
from megarl.rollout.decoder import SlotDecoder, default_kv_cache_tokens
from megarl.rollout.engine import PREEMPTED, GenerationOutput, PauseAroundUpdates, SamplingParams, WeightBucket
from megarl.rollout.openmp_workers import release_openmp_workers
from megarl.rollout.prefix_cache import KeptPrefixes, shared_prefixes
from megarl.rollout.token_sampling import sample_next_tokens

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: asyncio.Future
    generator: torch.Generator | None
    weight_version: int = 0
    output: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # the weights of each output token
    finish: tuple[str, object] | None = None
    continues: bool = False  # its prompt started with a kept sequence when it came: admitted first
    cancelled: bool = False  # set on the event loop; the scheduler retires it between steps
    preempted: bool = False  # abort_requests: retired between steps with what it has
    routed: torch.Tensor | None = None  # SamplingParams.routed_experts_from: read from its slot on retiring

    @property
    def length(self) -> int:  # tokens in the cache once the last output is appended
        return len(self.prompt) + len(self.output) - 1


class LocalEngine(PauseAroundUpdates):
    """In-process generation engine (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, *, max_batch_size: int = 64,
                 max_prefill_tokens: int = 8192, eos_token_ids: Iterable[int] | None = None, seed: int = 0,
                 kept_sequences: int | None = None, record_routing: bool = False, kv_cache_tokens: int | None = None):
        """`kept_sequences`: finished sequences whose cache is kept for prompts that continue
        them (megarl.rollout.prefix_cache; default max_batch_size). 0 turns prefix reuse off: the
        n samples of a prompt still share its computation, but no other prompt shares any. `record_routing`
        (a mixture of experts): keep the experts of every token, for requests that ask for them
        (SamplingParams.routed_experts_from), as SGLang's --enable-return-routed-experts.
        `kv_cache_tokens`: the K/V cache's budget in positions, running and kept sequences
        together (default: `default_kv_cache_tokens`, a share of the memory available now)."""
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        kept = max_batch_size if kept_sequences is None else kept_sequences
        self.decoder = SlotDecoder(model, max_rows=max_batch_size, record_routing=record_routing)
        self.decoder.max_tokens = kv_cache_tokens or default_kv_cache_tokens(self.decoder)
        log.info("embedded engine: a K/V cache of %d positions at most (%.2f GB, %d bytes a position)",
                 self.decoder.max_tokens, self.decoder.max_tokens * self.decoder.bytes_per_token / 1e9,
                 self.decoder.bytes_per_token)
        self.kept = KeptPrefixes(first_slot=0, size=kept)
        self.shared_prefix_tokens = 0  # prompt tokens not computed since prompts admitted together shared them
        self.eos_token_ids = frozenset(eos_token_ids if eos_token_ids is not None else _eos_ids(model, tokenizer))
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = 0
        self.tokens_generated = 0  # over the engine's life: the progress a liveness check watches
        self._waiting: deque[_Request] = deque()
        self._running: list[_Request] = []
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="megarl-engine")
        self._wake: asyncio.Event | None = None
        self._unpaused: asyncio.Event | None = None
        self._idle: asyncio.Event | None = None
        self._loop_task: asyncio.Task | None = None
        self._failure: BaseException | None = None
        release_openmp_workers()  # this thread's, which loaded the model most likely (openmp_workers)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str = "float32", device: str = "cpu", **kwargs) -> LocalEngine:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device)
        return cls(model, AutoTokenizer.from_pretrained(path), **kwargs)

    # -- RolloutEngine -------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> GenerationOutput:
        self._ensure_loop()
        if self._failure is not None:
            raise RuntimeError(f"the embedded engine failed earlier and cannot generate: {self._failure!r}")
        if not prompt_ids:
            raise ValueError("prompt_ids is empty: a generation needs at least one prompt token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; pass tokenizer= to LocalEngine or use stop_token_ids")
        if params.routed_experts_from is not None:
            if not self.decoder.record_routing:
                raise ValueError("routed experts asked for, but this engine does not record them: "
                                 "LocalEngine(record_routing=True)")
            if params.routed_experts_from > len(prompt_ids):
                raise ValueError(f"routed_experts_from={params.routed_experts_from} is past the prompt's "
                                 f"{len(prompt_ids)} tokens")
        if self._positions(prompt_ids, params) > self.decoder.max_tokens:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens with max_new_tokens={params.max_new_tokens} needs "
                             f"{self._positions(prompt_ids, params)} positions of K/V cache; the embedded engine holds "
                             f"{self.decoder.max_tokens} (rollout.kv_cache_tokens): raise it or ask for fewer tokens")
        generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        request = _Request(list(prompt_ids), params, asyncio.get_running_loop().create_future(), generator)
        request.continues = len(self.kept) > 0 and self.kept.find(request.prompt) is not None
        if params.max_new_tokens == 0:
            request.finish = ("length", None)
            return self._output(request)
        self._waiting.append(request)
        self._wake.set()
        try:
            return await asyncio.shield(request.future)
        except asyncio.CancelledError:
            request.cancelled = True  # the scheduler drops it before the next step
            raise

    async def update_weights(self, buckets: Iterable[WeightBucket], version: int) -> None:
        """Copy HF-named tensors into the model between decode steps (the model thread runs
        them in order with the steps, so no step ever sees half-updated weights)."""
        params = checkpoint_views(self.model)  # checkpoint names, sharing the parameters' memory
        loop = asyncio.get_running_loop()
        for bucket in buckets:
            unknown = sorted(set(bucket) - set(params))
            if unknown:
                raise KeyError(f"update_weights got names the model does not have: {unknown[:5]}")
            for name, tensor in bucket.items():
                if tuple(tensor.shape) != tuple(params[name].shape):
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"the model expects {tuple(params[name].shape)}")
            await loop.run_in_executor(self._executor, _copy_bucket, params, bucket)
        await loop.run_in_executor(self._executor, self.kept.clear)  # caches of the old weights
        self.weight_version = version

    async def weight_checksums(self) -> dict[str, str]:
        """Per-tensor checksums of the model's HF weights (sync.verify)."""
        from megarl.weights.buckets import hf_tensors, weight_checksums

        return weight_checksums(hf_tensors(self.model))

    async def prompt_log_probs(self, token_ids: list[int], temperature: float = 1.0) -> list[float]:
        """The log-prob of each token after the first given the ones before it (softmax of the
        logits / temperature; the weights probe takes 1, as SGLang's prompt log-probs are). On
        the model thread, between decode steps."""
        if len(token_ids) < 2:
            raise ValueError("prompt_log_probs needs at least two tokens (the first has no log-prob)")
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._prompt_log_probs,
                                                                list(token_ids), temperature)

    @torch.no_grad()
    def _prompt_log_probs(self, token_ids: list[int], temperature: float) -> list[float]:
        device = next(self.model.parameters()).device
        ids = torch.tensor([token_ids], device=device)
        logits = self.model(input_ids=ids).logits[0, :-1].float() / temperature
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()

    async def probe_log_probs(self, sequences: list[list[int]]) -> dict[str, list[list[float]]]:
        return {"embedded engine": [await self.prompt_log_probs(s) for s in sequences]}

    async def abort_requests(self) -> None:
        """End all requests with the tokens they have (RolloutEngine.abort_requests): the
        waiting at once, the running between steps (at once when no step is in progress)."""
        self._ensure_loop()
        for request in [*self._waiting, *self._running]:
            request.preempted = True
        if self._idle.is_set():
            self._drop_aborted()

    async def pause(self) -> None:
        self._ensure_loop()
        self._unpaused.clear()
        await self._idle.wait()  # the step in progress finishes first

    async def resume(self) -> None:
        self._ensure_loop()
        self._unpaused.set()

    async def flush_cache(self) -> None:
        """Forget the kept sequences (their caches are reused no more). On the model thread, as
        every use of them: never in the middle of a step."""
        await asyncio.get_running_loop().run_in_executor(self._executor, self.kept.clear)

    async def release_memory(self) -> None:
        self._ensure_loop()
        await self.pause()
        if self._running:
            raise RuntimeError("release_memory with requests still running; wait for them or abort them first")
        await asyncio.get_running_loop().run_in_executor(self._executor, self._release)

    def _release(self) -> None:
        self.kept.clear()
        self.decoder.release()

    async def resume_memory(self) -> None:
        await self.resume()  # the cache is reallocated on the next prefill

    async def health(self) -> bool:
        return self._failure is None and (self._loop_task is None or not self._loop_task.done())

    async def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._abort_all("engine closed")
        self._executor.shutdown(wait=True)

    # -- scheduler -----------------------------------------------------------------------
    def _ensure_loop(self) -> None:
        if self._loop_task is None or self._loop_task.done() and self._failure is None:
            self._wake, self._unpaused, self._idle = asyncio.Event(), asyncio.Event(), asyncio.Event()
            self._unpaused.set()
            self._idle.set()
            self._loop_task = asyncio.get_running_loop().create_task(self._schedule())

    async def _schedule(self) -> None:
        try:
            await self._schedule_forever()
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a dead scheduler must not leave callers waiting forever
            log.exception("embedded engine scheduler failed")
            self._failure = e
            self._abort_all(f"engine scheduler failed: {e!r}")
            raise

    async def _schedule_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._unpaused.wait()
            self._drop_aborted()
            if not self._waiting and not self._running:
                self._wake.clear()
                # idle: the model thread's OpenMP workers would slow whoever computes meanwhile
                await loop.run_in_executor(self._executor, release_openmp_workers)
                await self._wake.wait()
                continue
            admitted = self._admit()
            self._idle.clear()
            release_openmp_workers()  # this thread's, should it have run torch since the last step
            finished = []
            try:
                finished = await loop.run_in_executor(self._executor, self._step, admitted)
            except Exception as e:  # a model failure must not leave callers waiting forever
                log.exception("embedded engine step failed")
                self._abort_all(f"engine step failed: {e!r}", admitted)  # admitted: in neither queue yet
                self.decoder.release()
                self.kept.clear()
            finally:
                self._idle.set()
            for request in finished:
                self._resolve(request)
            self._drop_aborted()  # before a pause can hold them: abort_requests comes before a sync

    def _admit(self) -> list[_Request]:
        """Waiting requests for the free slots, up to max_prefill_tokens of distinct prompts (the
        n samples of a prompt are prefilled once). Requests that continue a kept sequence (a
        trajectory's next turn) go first, in arrival order, then the rest in arrival order: a
        started trajectory runs on while its cache is kept, instead of queueing behind new ones
        until the sequences that finish meanwhile push its cache out."""
        free = self.max_batch_size - len(self._running)
        if free <= 0 or not self._waiting:
            return []
        first = [r for r in self._waiting if r.continues]
        order = first + [r for r in self._waiting if not r.continues] if first else list(self._waiting)
        admitted, tokens, prompts = [], 0, set()
        reach = max((self._positions(r.prompt, r.params) for r in self._running), default=0)
        for nxt in order:
            if len(admitted) == free:
                break
            new = tuple(nxt.prompt) not in prompts
            if admitted and new and tokens + len(nxt.prompt) > self.max_prefill_tokens:
                break
            if not self._room_for(len(self._running) + len(admitted) + 1,
                                  max(reach, self._positions(nxt.prompt, nxt.params)), started=bool(admitted)):
                break  # in arrival order: it waits for running sequences to finish, and none passes it
            reach = max(reach, self._positions(nxt.prompt, nxt.params))
            nxt.weight_version = self.weight_version
            admitted.append(nxt)
            if new:
                prompts.add(tuple(nxt.prompt))
                tokens += len(nxt.prompt)
        self.decoder.reserve(len(self._running) + len(admitted), reach)
        if len(admitted) == len(self._waiting):
            self._waiting.clear()
        else:
            taken = {id(r) for r in admitted}
            self._waiting = deque(r for r in self._waiting if id(r) not in taken)
        return admitted

    def _step(self, admitted: list[_Request]) -> list[_Request]:
        """Model thread: prefill the admitted requests, then one decode step for the rest; the
        requests that finished, their slots freed."""
        decoding = [r for r in self._running if r.finish is None]
        if decoding:
            last = torch.tensor([r.output[-1] for r in decoding])
            lengths = torch.tensor([r.length for r in decoding])
            self._sample(decoding, self.decoder.decode(last, lengths))
        if admitted:
            ordered, rows, logits = self._prefill(admitted)
            self._running.extend(ordered)
            self._sample(ordered, logits[rows])
        finished = [r for r in self._running if r.finish is not None]
        for request in finished:
            self._free_slot(request)
        self.decoder.reserve(len(self._running),
                             max((self._positions(r.prompt, r.params) for r in self._running), default=0))
        return finished

    def _positions(self, prompt: list[int], params: SamplingParams) -> int:
        """The K/V positions a request may reach: its prompt and new tokens, within the model's
        positions (one more: the next token's row as it is computed)."""
        return max(len(prompt), min(len(prompt) + params.max_new_tokens, self.decoder.max_positions)) + 1

    def _room_for(self, rows: int, length: int, started: bool) -> bool:
        """Whether the running cache may reach `rows` sequences of `length` positions. Kept
        sequences give way first (forgotten, their cache freed); with nothing running or
        admitted, the running cache is freed too and made again at the size needed."""
        if self.decoder.fits(rows, length):
            return True
        if len(self.kept) or self.decoder.kept.positions:
            self.kept.clear()
            self.decoder.kept.release()
            if self.decoder.fits(rows, length):
                return True
        if not self._running and not started:
            self.decoder.release()
            return self.decoder.fits(rows, length)
        return False

    def _prefill(self, admitted: list[_Request]) -> tuple[list[_Request], list[int], torch.Tensor]:
        """Model thread: the admitted requests in slots from len(running) on; returns them in
        slot order, the row of the logits each samples from, and the logits. Each distinct
        prompt is computed once (the n samples of a group get a copy of its cache and sample
        from its logits). With prefix reuse on, a prompt that continues a kept sequence starts
        from its cache, and prompts that start alike compute what they share once."""
        firsts, copies, seen = [], [], set()
        for r in admitted:
            key = tuple(r.prompt)
            (copies if key in seen else firsts).append(r)
            seen.add(key)
        # every admitted request's slot (the samples' copies too), as long as the longest prompt
        self.decoder.ensure(len(self._running) + len(admitted), max(len(r.prompt) for r in admitted) + 1)
        found = [self.kept.take(r.prompt) for r in firsts]  # (slot, length) of a kept prefix, or None
        fresh = [i for i, f in enumerate(found) if f is None]
        groups = shared_prefixes([tuple(firsts[i].prompt) for i in fresh]) if self.kept.size else []
        groups = [([fresh[i] for i in members], shared) for members, shared in groups]
        # the group leaders first: their slots compute the shared tokens in one batch
        leaders = [members[0] for members, _ in groups]
        order = leaders + sorted(set(range(len(firsts))) - set(leaders))
        firsts, found = [firsts[i] for i in order], [found[i] for i in order]
        slot_of = {old: new for new, old in enumerate(order)}
        first = len(self._running)
        cached = [f[1] if f is not None else 0 for f in found]
        for i, f in enumerate(found):
            if f is not None:
                self.decoder.restore(f[0], first + i, f[1])
        if groups:
            self.decoder.prefill(first, [firsts[k].prompt[:shared] for k, (_, shared) in enumerate(groups)])
            for k, (members, shared) in enumerate(groups):
                for i in members:
                    if i != members[0]:
                        self.decoder.move_slot(first + k, first + slot_of[i], shared)
                    cached[slot_of[i]] = shared
                self.shared_prefix_tokens += (len(members) - 1) * shared
        logits = self.decoder.prefill(first, [r.prompt for r in firsts], cached)
        row = {tuple(r.prompt): i for i, r in enumerate(firsts)}
        for i, r in enumerate(copies):
            self.decoder.move_slot(first + row[tuple(r.prompt)], first + len(firsts) + i, len(r.prompt))
        ordered = firsts + copies  # their slots, in order from `first`
        return ordered, [row[tuple(r.prompt)] for r in ordered], logits

    def _sample(self, requests: list[_Request], logits: torch.Tensor) -> None:
        tokens, log_probs = sample_next_tokens(logits, [r.params for r in requests],
                                               [r.generator or self.generator for r in requests])
        for request, token, log_prob in zip(requests, tokens.tolist(), log_probs.tolist()):
            request.output.append(token)
            request.log_probs.append(log_prob)
            request.versions.append(self.weight_version)
            request.finish = self._finish_reason(request, token)
        self.tokens_generated += len(requests)

    def _finish_reason(self, request: _Request, token: int) -> tuple[str, object] | None:
        p = request.params
        if (token in self.eos_token_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return ("stop", token)
        if p.stop:
            # the stop string must involve the newest token; decoding a short tail is enough
            longest = max(len(s) for s in p.stop)
            tail = self.tokenizer.decode(request.output[-(longest + 2):])
            for s in p.stop:
                if s in tail:
                    return ("stop", s)
        if len(request.output) >= p.max_new_tokens:
            return ("length", len(request.output))
        if len(request.prompt) + len(request.output) >= self.decoder.max_positions:
            return ("length", len(request.output))
        return None

    def _free_slot(self, request: _Request) -> None:
        """Between steps: keep the request's cache for a prompt that continues it (a finished
        one), then free its slot by moving the last running sequence into it."""
        idx = self._running.index(request)
        if request.params.routed_experts_from is not None:
            request.routed = self.decoder.routed_experts(idx, request.params.routed_experts_from, request.length)
        if request.finish[0] != "abort":
            slot = self.kept.keep(tuple(request.prompt + request.output)[:request.length],
                                  lambda slot: self.decoder.kept_fits(slot, request.length))
            if slot is not None:
                self.decoder.keep(idx, slot, request.length)
        last = len(self._running) - 1
        if idx != last:
            moved = self._running[last]
            self.decoder.move_slot(last, idx, moved.length)
            self._running[idx] = moved
        self._running.pop()

    def _resolve(self, request: _Request) -> None:
        if not request.future.done():
            request.future.set_result(self._output(request))

    def _drop_aborted(self) -> None:
        """Between steps: the cancelled and preempted requests answered, their slots freed. Here
        on the event loop's thread, at once (a pause that follows finds them gone), where the
        slots' cache moves may give the thread OpenMP workers: released before the next step."""
        for request in [r for r in self._waiting if r.cancelled or r.preempted]:
            self._waiting.remove(request)
            if request.preempted and not request.future.done():
                request.finish = ("abort", PREEMPTED)
                request.future.set_result(self._output(request))
        for request in [r for r in self._running if r.cancelled or r.preempted]:
            request.finish = ("abort", "cancelled by the caller" if request.cancelled else PREEMPTED)
            self._free_slot(request)
            self._resolve(request)

    def _abort_all(self, message: str, admitted: Iterable[_Request] = ()) -> None:
        for request in [*self._waiting, *self._running, *admitted]:
            request.finish = ("abort", message)
            if not request.future.done():
                request.future.set_result(self._output(request))
        self._waiting.clear()
        self._running.clear()

    def _output(self, request: _Request) -> GenerationOutput:
        reason, detail = request.finish
        return GenerationOutput(
            token_ids=list(request.output), log_probs=list(request.log_probs), finish_reason=reason,
            matched_stop=detail if reason == "stop" else None, weight_version=request.weight_version,
            prompt_tokens=len(request.prompt), message=detail if reason == "abort" else None,
            token_versions=list(request.versions), routed_experts=request.routed,
        )


def _copy_bucket(params: dict[str, torch.Tensor], bucket: WeightBucket) -> None:
    with torch.no_grad():
        for name, tensor in bucket.items():
            params[name].copy_(tensor)


def _eos_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids.update(value if isinstance(value, (list, tuple, set)) else [value])
    return ids
