"""Batched prefill and decode of an HF decoder-only model over a slot-based KV cache.

The embedded engine needs what `model.generate` does not give: sequences that join and
leave a running batch between decode steps (continuous batching), each with its own
length and position. We keep the HF model's own modules (embeddings, norms, rotary
embedding, projections, MLP, LM head) and replace only the attention's cache handling:
every running sequence owns a slot of a preallocated K/V tensor per layer, the running
sequences occupy slots [0, n) (a finished one is swapped with the last), and one decode
step attends each slot over its own prefix with a length mask. When the rows of a step differ
much in length, the keys past a cut are computed for the long rows only and the two parts are
merged by their softmax statistics, so short rows do not pay for the longest one's padding.
With `record_routing` (a mixture of experts) each slot also keeps, per position, the experts
its token was routed to in each MoE layer (`routes`), moved and kept with the K/V.

The cache grows with what is running, within a budget of positions (`max_tokens`, the engine's
rollout.kv_cache_tokens), as SGLang's token pool is sized by memory rather than by the requests
it may be sent.

Supported families: the decoders megarl trains, `megarl.models.spec.FAMILIES` (their
differences — QKV bias, QK norm, rope scaling, Qwen3-MoE's routed experts — live in the HF modules
we reuse).
Main entry point: `SlotDecoder`.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from megarl.models.spec import FAMILIES


class KVStore:
    """K and V tensors per layer, (rows, K/V heads, capacity, head_dim) each, and with
    `route_width` each row's routed experts per position: sequences held row by row. Grown on
    demand to the sizes its owner asks for, one layer's tensor at a time (a growth holds the old
    cache and one new layer's tensor at most)."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, device, dtype, route_width: int = 0):
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.device, self.dtype, self.route_width = device, dtype, route_width
        self.rows = self.capacity = 0
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.routes: torch.Tensor | None = None  # (rows, capacity, MoE layers x top-k) int16, -1 where none

    @property
    def positions(self) -> int:
        """The positions it holds memory for: rows x capacity."""
        return self.rows * self.capacity

    @torch.inference_mode()
    def grow(self, rows: int, capacity: int) -> None:
        """To exactly (rows, capacity) where that is larger; what it holds is kept."""
        rows, capacity = max(rows, self.rows), max(capacity, self.capacity)
        if (rows, capacity) == (self.rows, self.capacity):
            return
        shape = (rows, self.kv_heads, capacity, self.head_dim)
        for i in range(self.layers):
            for cache in (self.k, self.v):
                grown = torch.zeros(shape, device=self.device, dtype=self.dtype)
                if self.positions:
                    grown[: self.rows, :, : self.capacity] = cache[i]
                if i < len(cache):
                    cache[i] = grown  # the old tensor is freed here, before the next layer's is made
                else:
                    cache.append(grown)
        if self.route_width:
            grown = torch.full((rows, capacity, self.route_width), -1, dtype=torch.int16, device=self.device)
            if self.routes is not None:
                grown[: self.rows, : self.capacity] = self.routes
            self.routes = grown
        self.rows, self.capacity = rows, capacity

    def release(self) -> None:
        self.k, self.v, self.routes, self.rows, self.capacity = [], [], None, 0, 0


# the share of the memory available when the engine starts that its K/V cache may take by default
# (the trainer's weights, gradients, optimizer state and activations share the rest on the CPU)
KV_CACHE_MEMORY_SHARE = 0.25


def default_kv_cache_tokens(decoder: SlotDecoder) -> int:
    """rollout.kv_cache_tokens left unset: KV_CACHE_MEMORY_SHARE of the memory available on the
    engine's device now (the host's available memory on the CPU, the GPU's free memory on CUDA),
    in positions of the model's K/V."""
    if decoder.device.type == "cuda":
        available = torch.cuda.mem_get_info(decoder.device)[0]
    else:
        import psutil

        available = psutil.virtual_memory().available
    return max(1, int(available * KV_CACHE_MEMORY_SHARE) // decoder.bytes_per_token)


@torch.inference_mode()
def _copy_row(src: KVStore, src_row: int, dst: KVStore, dst_row: int, length: int) -> None:
    """The first `length` positions of a row of `src` into a row of `dst`."""
    for s, d in zip((*src.k, *src.v), (*dst.k, *dst.v)):
        d[dst_row, :, :length] = s[src_row, :, :length]
    if src.routes is not None and dst.routes is not None:
        dst.routes[dst_row, :length] = src.routes[src_row, :length]


class SlotDecoder:
    """Runs `model` over the K/V cache of the running sequences, slots 0 .. max_rows - 1, and a
    second cache of kept sequences (finished ones whose cache a later prompt may continue: the
    engine's prefix reuse). Both grow as sequences need them, within `max_tokens` positions
    together (rows x capacity of the two), the K/V budget: the engine admits requests by
    `fits` and reserves what its running requests may reach (`reserve`), so that growth never
    passes the budget; a kept sequence is kept only where it fits beside that reservation."""

    def __init__(self, model: torch.nn.Module, max_rows: int, max_tokens: int | None = None,
                 record_routing: bool = False):
        cfg = model.config
        if cfg.model_type not in FAMILIES:
            raise ValueError(f"the embedded engine supports model types {sorted(FAMILIES)}, "
                             f"not {cfg.model_type!r}; use rollout.engine=sglang for other architectures")
        if getattr(cfg, "use_sliding_window", False):
            raise ValueError("sliding-window attention is not supported by the embedded engine; "
                             "set use_sliding_window=false in the model config or use rollout.engine=sglang")
        self.model = model
        self.layers = model.model.layers
        attn = self.layers[0].self_attn
        self.head_dim = attn.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.apply_rotary = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.max_rows = max_rows
        self.max_positions = getattr(cfg, "max_position_embeddings", None) or 1 << 30
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.moe_layers = [i for i, layer in enumerate(self.layers) if hasattr(layer.mlp, "experts")]
        if record_routing and not self.moe_layers:
            raise ValueError(f"record_routing needs a mixture of experts; {cfg.model_type!r} has no routed experts")
        self.record_routing = record_routing
        self.route_width = len(self.moe_layers) * getattr(cfg, "num_experts_per_tok", 0)
        store = (len(self.layers), self.num_kv_heads, self.head_dim, self.device, self.dtype,
                 self.route_width if record_routing else 0)
        self.running, self.kept = KVStore(*store), KVStore(*store)
        self.max_tokens = max_tokens if max_tokens is not None else 1 << 62
        self.reserved = (0, 0)  # (rows, positions) the running sequences may reach: `reserve`

    @property
    def bytes_per_token(self) -> int:
        """The cache's bytes for one position of one sequence: K and V of every layer."""
        return 2 * len(self.layers) * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def k_cache(self) -> list[torch.Tensor]:
        return self.running.k

    @property
    def v_cache(self) -> list[torch.Tensor]:
        return self.running.v

    @property
    def routes(self) -> torch.Tensor | None:
        return self.running.routes

    # -- memory --------------------------------------------------------------------------
    def _running_need(self, rows: int, length: int) -> int:
        """The running cache's positions once it holds `rows` sequences of up to `length`."""
        return max(rows, self.running.rows) * max(length, self.running.capacity)

    def fits(self, rows: int, length: int) -> bool:
        """Whether the running cache may reach `rows` sequences of `length` positions beside
        the kept cache, within the budget."""
        return self._running_need(rows, length) + self.kept.positions <= self.max_tokens

    def reserve(self, rows: int, length: int) -> None:
        """What the running sequences may reach (their number, the longest's prompt and new
        tokens): room the kept cache leaves them."""
        self.reserved = (rows, length)

    def kept_fits(self, slot: int, length: int) -> bool:
        """Whether a kept sequence of `length` positions fits in kept slot `slot`."""
        rows, capacity = max(slot + 1, self.kept.rows), max(length, self.kept.capacity)
        return rows * capacity + self._running_need(*self.reserved) <= self.max_tokens

    @torch.inference_mode()
    def ensure(self, rows: int, length: int) -> None:
        """The running cache holds `rows` sequences of `length` positions: grown where it is
        smaller, doubling each dimension (to amortise copies) where the budget allows, else to
        what is asked; past the budget a RuntimeError (the engine admits only what fits)."""
        if rows <= self.running.rows and length <= self.running.capacity:
            return
        if length > self.max_positions + 1:
            raise ValueError(f"{length} positions asked for; the model has {self.max_positions}")
        room = self.max_tokens - self.kept.positions
        if self._running_need(rows, length) > room:
            raise RuntimeError(f"the embedded engine's K/V cache would pass its budget of {self.max_tokens} positions "
                               f"({rows} sequences x {length} positions beside {self.kept.positions} kept)")
        doubled = (max(rows, min(2 * self.running.rows, self.max_rows)) if rows > self.running.rows else rows,
                   max(length, 2 * self.running.capacity, 16) if length > self.running.capacity else length)
        if self._running_need(*doubled) <= room:
            rows, length = doubled
        self.running.grow(rows, length)

    def release(self) -> None:
        self.running.release()
        self.kept.release()

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` cached positions of running slot src into running slot dst."""
        _copy_row(self.running, src, self.running, dst, length)

    def keep(self, src: int, kept_slot: int, length: int) -> None:
        """Copy running slot src's first `length` positions into kept slot `kept_slot` (`kept_fits`)."""
        if not self.kept_fits(kept_slot, length):
            raise RuntimeError(f"kept slot {kept_slot} of {length} positions does not fit the K/V budget")
        rows = max(kept_slot + 1, self.kept.rows)
        doubled = min(2 * self.kept.rows, self.max_rows)  # amortises the copies, where the budget allows
        if kept_slot >= self.kept.rows and doubled > rows and self.kept_fits(doubled - 1, length):
            rows = doubled
        self.kept.grow(rows, length)
        _copy_row(self.running, src, self.kept, kept_slot, length)

    def restore(self, kept_slot: int, dst: int, length: int) -> None:
        """Copy kept slot `kept_slot`'s first `length` positions into running slot dst."""
        self.ensure(dst + 1, length + 1)
        _copy_row(self.kept, kept_slot, self.running, dst, length)

    def routed_experts(self, slot: int, start: int, end: int) -> torch.Tensor:
        """(end - start, MoE layers x top-k) int16: the experts of the tokens at positions
        start .. end - 1 of `slot`, a copy (record_routing)."""
        if self.running.routes is None:
            raise RuntimeError("this decoder does not record routing (record_routing=False)")
        return self.running.routes[slot, start:max(start, end)].cpu().clone()

    # -- forward -----------------------------------------------------------------------
    def _attention(self, layer_idx: int, attn, hidden, rotary, slots: slice, write_at, key_len, mask):
        """hidden (B, T, E) whose positions' rotary (cos, sin) is `rotary`; writes K/V into the
        cache rows of `slots` at `write_at` and attends over the first `key_len` cached positions
        under `mask`."""
        b, t, _ = hidden.shape
        q = attn.q_proj(hidden).view(b, t, self.num_heads, self.head_dim)
        k = attn.k_proj(hidden).view(b, t, self.num_kv_heads, self.head_dim)
        v = attn.v_proj(hidden).view(b, t, self.num_kv_heads, self.head_dim)
        if hasattr(attn, "q_norm"):  # Qwen3 normalises each head before rotary
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = self.apply_rotary(q, k, *rotary)
        k_cache, v_cache = self.k_cache[layer_idx][slots], self.v_cache[layer_idx][slots]
        write_at(k_cache, k)
        write_at(v_cache, v)
        if isinstance(mask, _SplitKeys):
            out = self._split_attention(q, k_cache, v_cache, mask)
        elif t == 1:  # decode: the query heads of a K/V head attend as its queries (no K/V copies)
            groups = self.num_heads // self.num_kv_heads
            out = F.scaled_dot_product_attention(
                q.view(b, self.num_kv_heads, groups, self.head_dim), k_cache[:, :, :key_len],
                v_cache[:, :, :key_len], attn_mask=mask, scale=self.scaling,
            ).view(b, self.num_heads, 1, self.head_dim)
        else:
            out = F.scaled_dot_product_attention(
                q, k_cache[:, :, :key_len], v_cache[:, :, :key_len], attn_mask=mask, scale=self.scaling,
                enable_gqa=self.num_heads != self.num_kv_heads,
            )
        return attn.o_proj(out.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim))

    def _split_attention(self, q, k_cache, v_cache, split: _SplitKeys) -> torch.Tensor:
        """Decode attention (q: n, H, 1, D) in two parts: every row over the keys [0, cut), then
        the rows longer than that over [cut, key_len), merged by their softmax statistics. Equal
        to one pass over [0, key_len) with the length mask, without computing the short rows'
        padding up to the longest row."""
        n, groups = q.shape[0], self.num_heads // self.num_kv_heads
        q = q.view(n, self.num_kv_heads, groups, self.head_dim)  # the query heads sharing a K/V head together
        m, total, out = _attend(q, k_cache[:, :, :split.cut], v_cache[:, :, :split.cut], split.head_mask, self.scaling)
        rows = split.long_rows
        m2, total2, out2 = _attend(q[rows], k_cache[:, :, split.cut:split.key_len][rows],
                                   v_cache[:, :, split.cut:split.key_len][rows], split.tail_mask, self.scaling)
        m1, total1, out1 = m[rows], total[rows], out[rows]
        top = torch.maximum(m1, m2)
        a, b = torch.exp(m1 - top), torch.exp(m2 - top)
        out[rows] = out1 * a + out2 * b
        total[rows] = total1 * a + total2 * b
        return (out / total).view(n, self.num_heads, 1, self.head_dim)

    def _run(self, input_ids, positions, slots: slice, write_at, key_len, mask, last_index):
        hidden = self.model.model.embed_tokens(input_ids)
        rotary = self.model.model.rotary_emb(hidden, positions)  # (cos, sin), the same for every layer
        routed = [] if self.record_routing else None
        for i, layer in enumerate(self.layers):
            residual = hidden
            hidden = layer.input_layernorm(hidden)
            hidden = residual + self._attention(i, layer.self_attn, hidden, rotary, slots, write_at, key_len, mask)
            residual = hidden
            hidden = residual + self._mlp(layer.mlp, layer.post_attention_layernorm(hidden), routed)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        if routed:  # (n, T, MoE layers x top-k) at the tokens' positions of their slots
            self.routes[slots][rows[:, None], positions] = torch.cat(routed, dim=-1).to(torch.int16)
        last = self.model.model.norm(hidden[rows, last_index])
        return self.model.lm_head(last).float()

    @staticmethod
    def _mlp(mlp, hidden, routed: list | None):
        """The layer's MLP; a mixture of experts with `routed` given appends its routing (the
        top-k experts of each token, (n, T, top-k)) to it: HF's Qwen3-MoE block, its router's
        indices kept."""
        if routed is None or not hasattr(mlp, "experts"):
            return mlp(hidden)
        b, t, width = hidden.shape
        flat = hidden.reshape(-1, width)
        _, weights, experts = mlp.gate(flat)
        routed.append(experts.view(b, t, -1))
        return mlp.experts(flat, experts, weights).view(b, t, width)

    @torch.inference_mode()
    def prefill(self, first_slot: int, prompts: list[list[int]], cached: list[int] | None = None) -> torch.Tensor:
        """Fill slots first_slot.. with the prompts; returns the next-token logits (n, V) at each
        prompt's last position. `cached[i]`: how many of prompt i's first tokens its slot holds
        already (a prefix kept from an earlier request): only the rest is computed, at its
        positions, attending over the cached prefix too."""
        cached = cached or [0] * len(prompts)
        starts = torch.tensor(cached, device=self.device)
        lengths = torch.tensor([len(p) for p in prompts], device=self.device)
        width = int((lengths - starts).max())
        self.ensure(first_slot + len(prompts), int(starts.max()) + width + 1)
        ids = torch.zeros((len(prompts), width), dtype=torch.long, device=self.device)
        for row, (prompt, start) in enumerate(zip(prompts, cached)):
            ids[row, : len(prompt) - start] = torch.tensor(prompt[start:], dtype=torch.long, device=self.device)
        positions = starts[:, None] + torch.arange(width, device=self.device)  # (n, width), right-padded rows
        key_len = int(lengths.max())
        keys = torch.arange(key_len, device=self.device)
        # query at position q sees keys 0..q of its own sequence; padding keys are never attended
        mask = ((keys[None, None] <= positions[:, :, None]) & (keys[None, None] < lengths[:, None, None]))[:, None]
        rows = torch.arange(len(prompts), device=self.device)[:, None]

        def write_at(cache, new):  # new (n, H, width, D) at each row's positions
            cache[rows, :, positions] = new.transpose(1, 2)

        slots = slice(first_slot, first_slot + len(prompts))
        return self._run(ids, positions, slots, write_at, key_len, mask, lengths - starts - 1)

    @torch.inference_mode()
    def decode(self, last_tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """One step for slots [0, n): append last_tokens (n,) at positions lengths (n,);
        returns the next-token logits (n, V)."""
        last_tokens, lengths = last_tokens.to(self.device), lengths.to(self.device)
        n = last_tokens.shape[0]
        key_len = int(lengths.max()) + 1
        self.ensure(n, key_len)
        rows = torch.arange(n, device=self.device)
        mask = _split_keys(lengths, key_len, self.device)
        if mask is None:  # lengths alike: one pass over the longest row's keys
            mask = (torch.arange(key_len, device=self.device)[None] <= lengths[:, None])[:, None, None, :]

        def write_at(cache, new):
            cache[rows, :, lengths] = new[:, :, 0]

        return self._run(last_tokens[:, None], lengths[:, None], slice(0, n), write_at, key_len, mask,
                         torch.zeros(n, dtype=torch.long, device=self.device))


class _SplitKeys:
    """How a decode step splits its keys (SlotDecoder._split_attention): [0, cut) for every row,
    [cut, key_len) for `long_rows`; the masks say which of those keys each row has."""

    def __init__(self, cut: int, key_len: int, long_rows: torch.Tensor, head_mask: torch.Tensor,
                 tail_mask: torch.Tensor):
        self.cut, self.key_len, self.long_rows = cut, key_len, long_rows
        self.head_mask, self.tail_mask = head_mask, tail_mask


# a split pays when it saves this share of the padded keys at least (it costs a copy of the long
# rows' tail keys and a few more operations per layer)
SPLIT_SAVING = 0.3


def _split_keys(lengths: torch.Tensor, key_len: int, device) -> _SplitKeys | None:
    """The cut that computes the fewest keys, counting the long rows' tail keys twice (they are
    copied out of the cache), or None when no cut saves SPLIT_SAVING of the one-pass keys."""
    n = lengths.shape[0]
    if n < 2:
        return None
    needed = sorted((lengths + 1).tolist())  # keys each row attends over, ascending
    best_cost, cut = n * key_len, key_len
    for i, length in enumerate(needed[:-1]):  # cut after the i + 1 shortest rows
        cost = n * length + 2 * (n - i - 1) * (key_len - length)
        if cost < best_cost:
            best_cost, cut = cost, length
    if best_cost > (1 - SPLIT_SAVING) * n * key_len:
        return None
    keys = torch.arange(key_len, device=device)
    long_rows = (lengths + 1 > cut).nonzero().flatten()
    head_mask = (keys[None, :cut] <= lengths[:, None])[:, None, None, :]
    tail_mask = (keys[None, cut:] <= lengths[long_rows, None])[:, None, None, :]
    return _SplitKeys(cut, key_len, long_rows, head_mask, tail_mask)


def _attend(q, k, v, mask, scale):
    """Softmax attention of q (n, KV, G, D) over k, v (n, KV, L, D) where mask (n, 1, 1, L):
    the row maxima of the scores, the sums of their exponentials and the unnormalised outputs."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    m = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - m)
    return m, p.sum(dim=-1, keepdim=True), torch.matmul(p, v)
