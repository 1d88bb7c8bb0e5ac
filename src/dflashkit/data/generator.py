"""The slot generator: `prepare`'s batched decoder for Llama-family targets (the ``"slots"`` backend).

A fixed number of slots each hold one reply in progress, in a K/V cache allocated once
(`dflashkit.target.slot_decoder`). The loop:

1. **Refill**: free slots take the shortest ready requests; their prompts are prefilled, which also
   samples each reply's first token: packed end to end (`forward_packed`: up to ``packed_tokens`` prompt
   tokens a pass, no padding; the default where FlashAttention runs) or in padded chunks (rows of up to
   ``prefill_rows`` prompts, up to ``max_chunk`` tokens each per pass; fixed shapes, on the CPU).
   Requests whose prompt another request of the same refill has (the samples of one prompt) are not
   prefilled: they copy its keys and values but for the last prompt position, and their first decode
   step feeds that last token, which samples their first reply token from their own seed at the position
   a prefill would have (`_share`). With fixed shapes (GPU), a refill while replies run is launched
   behind the next group of decode steps (its slots are free in that group) and seated after the group's
   look, so the host launches the prefill while the device decodes; packed refills wait for a sixteenth of
   the slots (`_refill_at`).
2. **Decode**: one step feeds every slot's last token and samples the next, all on the device (the token
   and position of each slot stay there); ``steps_per_sync`` steps run back to back before the host looks.
3. **Look**: on the device, in one pass over all slots, each live reply keeps its new tokens up to its first
   end token and at most its length, and the replies that ended are marked; the host copies the new tokens,
   the lengths and the ended marks once (one device->host copy per group of steps), appends the tokens with
   array operations and frees the ended slots for step 1.
4. **Complete**: the ended replies go to the source (detokenising, the next round's prompt, the cache) while
   the device runs the next group of steps: on a GPU the steps are launched first, so that host work hides
   behind them.

Slots that finished inside a group of steps run on (their tokens are dropped) until the next refill, so a
reply that ends early wastes at most a few steps, never a whole batch. Shapes are fixed per (kind, rows,
chunk, key length bucket, sampling): on a GPU each shape is run once, then captured as a CUDA graph and
replayed (one launch per step, nothing to compile); on the CPU steps run eagerly with exact shapes.

Sampling: greedy rows take the argmax. Sampled rows draw from softmax(logits / temperature) cut to the
top-p nucleus, by an exponential race whose noise is hashed on the device from (request seed, position,
token id): a reply depends on its own seed, not on which requests ran beside it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch
from torch import Tensor

from dflashkit.data.generation import GenerationStats, Reply, Request, RequestSource
from dflashkit.errors import DflashkitError
from dflashkit.runtime.cuda_graph import Steps
from dflashkit.target.slot_decoder import (
    Attention,
    DecoderWeights,
    SlotCache,
    forward,
    forward_packed,
    pack,
    to_device,
    values_on,
)

MIN_KV_BUCKET = 64
# A sampled token is drawn among this many most likely tokens (the top-p nucleus is cut there when it is
# larger: at temperature 1 a nucleus of top_p 0.95 rarely is).
SAMPLE_CANDIDATES = 1024
# a launched prefill pass: its requests, their slots, their first reply tokens (on the device), prompt lengths
Pass = tuple[list[Request], list[int], Tensor, list[int]]
MAX_HOLD_STEPS = 32  # a ready request waits at most this many decode steps for a prefill pass
PACKED_REFILL_SHARE = 16  # packed refills wait until slots // 16 are free (`_refill_at`)


@dataclass(frozen=True)
class SlotSettings:
    slots: int = 16  # replies in progress at once
    capacity: int = 1280  # positions per slot: longest prompt + longest reply (+ steps_per_sync)
    prefill_rows: int = 64  # prompts prefilled per padded pass (at most)
    max_chunk: int = 512  # prompt tokens per row per prefill pass
    steps_per_sync: int = 4  # decode steps between two looks of the host (GPU; 1 on the CPU)
    cuda_graphs: bool = True  # on a GPU: capture each step shape once, then replay it
    share_prompts: bool = True  # requests of one refill with the same prompt share its prefill
    # Prompts prefilled packed end to end (no padded rows or chunks; eager, a pass's shape varies), up to
    # packed_tokens a pass. None: packed where FlashAttention runs (a GPU in bf16/fp16), padded elsewhere.
    packed_prefill: bool | None = None
    packed_tokens: int = 16384


def power_buckets(smallest: int, largest: int) -> list[int]:
    """smallest, 2 x smallest, ... and `largest` itself as the last bucket."""
    out, b = [], smallest
    while b < largest:
        out.append(b)
        b *= 2
    return [*out, largest]


def bucket(n: int, buckets: Sequence[int]) -> int:
    for b in buckets:
        if n <= b:
            return b
    raise DflashkitError(f"length {n} is beyond the largest bucket {buckets[-1]}")


def split_shared(requests: list[Request]) -> tuple[list[Request], list[tuple[Request, int]]]:
    """(the requests with a prompt not seen before in `requests`, in order; every other request with the
    index of the first request of its prompt in the first list)."""
    first: dict[tuple[int, ...], int] = {}
    unique: list[Request] = []
    copies: list[tuple[Request, int]] = []
    for r in requests:
        j = first.get(r.prompt_ids)
        if j is None:
            first[r.prompt_ids] = len(unique)
            unique.append(r)
        else:
            copies.append((r, j))
    return unique, copies


# --- sampling ---------------------------------------------------------------------------------

_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash (lowbias32), on int64 tensors holding values below 2**32."""
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & _M32
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & _M32
    return x ^ (x >> 16)


def uniform(seed: Tensor, position: Tensor, token: Tensor) -> Tensor:
    """A number in (0, 1) fixed by (seed, position, token id), 24 bits, float32; seed and position
    [R], token [R, K]."""
    row = _mix32(_mix32(seed & _M32) ^ (position & _M32))
    return ((_mix32(row[:, None] ^ token) >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def sample(logits: Tensor, temperature: Tensor, top_p: Tensor, seed: Tensor, position: Tensor) -> Tensor:
    """Next tokens [R] from float logits [R, V]: the argmax where temperature is 0; elsewhere a draw from
    softmax(logits / temperature) cut to its top-p nucleus (the most likely tokens whose mass reaches
    top_p; the first always kept), among the SAMPLE_CANDIDATES most likely tokens.

    The draw is an exponential race: the kept token with the largest p / E wins, where E = -log U and U
    is uniform(seed, position, token id). Each token's U is its own, so two computations of one request
    whose logits differ by rounding (another batch, another kernel) draw the same token unless two
    tokens tie within that rounding."""
    greedy = logits.argmax(-1)
    logp = torch.log_softmax(logits / temperature.clamp(min=1e-5)[:, None], dim=-1)
    top_logp, top_ids = logp.topk(min(SAMPLE_CANDIDATES, logits.shape[-1]), dim=-1)  # most likely first
    p = top_logp.exp()
    keep = (p.cumsum(-1) - p) < top_p[:, None]
    race = top_logp - torch.log(-torch.log(uniform(seed, position, top_ids)))
    pick = torch.where(keep, race, float("-inf")).argmax(-1, keepdim=True)
    drawn = top_ids.gather(-1, pick).squeeze(-1)
    return torch.where(temperature > 0, drawn, greedy)


# --- the generator ------------------------------------------------------------------------------


class SlotGenerator:
    """The ``"slots"`` backend. Build with `SlotGenerator.create(model, ...)` from a transformers model
    (its weights are shared, fused copies of the projections are made once)."""

    name = "slots"

    def __init__(
        self,
        weights: DecoderWeights,
        eos_ids: Sequence[int],
        settings: SlotSettings,
        fixed_shapes: bool | None = None,
    ):
        """`fixed_shapes` (default: with CUDA graphs) pads every step to a few shapes and decodes all slots
        `steps_per_sync` steps at a time, as graphs need; eager steps otherwise take exact shapes, the live
        slots only, and one step at a time."""
        self.w = weights
        self.settings = settings
        self.eos = np.array(sorted(set(eos_ids)), dtype=np.int64)
        self.eos_ids = frozenset(int(t) for t in self.eos)
        self.device = weights.device
        cuda = self.device.type == "cuda"
        self.graphs = Steps(cuda and settings.cuda_graphs)
        self.pad = self.graphs.graphs if fixed_shapes is None else fixed_shapes
        self.sync_every = settings.steps_per_sync if self.pad else 1
        self.attention: Attention = (
            "flash" if cuda and weights.dtype in (torch.bfloat16, torch.float16) else "sdpa"
        )
        self.packed = (
            settings.packed_prefill if settings.packed_prefill is not None else self.attention == "flash"
        )
        self.chunk = min(settings.max_chunk, settings.capacity)
        # Whole prefill passes must fit a slot: round the capacity up to a multiple of the chunk.
        needed = settings.capacity + self.sync_every
        self.capacity = -(-needed // self.chunk) * self.chunk
        self.cache = SlotCache(weights, settings.slots, self.capacity)
        self.kv_buckets = power_buckets(MIN_KV_BUCKET, self.capacity) if self.pad else None
        self.row_buckets = power_buckets(1, max(1, min(settings.prefill_rows, settings.slots)))
        self.chunk_buckets = power_buckets(16, self.chunk)
        self._buffers()

    @classmethod
    def create(
        cls, model: Any, eos_ids: Sequence[int], settings: SlotSettings, fixed_shapes: bool | None = None
    ) -> SlotGenerator:
        weights = DecoderWeights.from_hf(model, max_positions=None)
        weights.pack_for_cpu()  # bf16 on a CPU: every weight packed once for oneDNN (the same numbers)
        return cls(weights, eos_ids, settings, fixed_shapes)

    def _buffers(self) -> None:
        s, dev = self.settings.slots, self.device
        i64 = dict(dtype=torch.long, device=dev)
        f32 = dict(dtype=torch.float32, device=dev)
        # Per slot, on the device: the token fed to the next decode step, its position, how to sample.
        self.tokens = torch.zeros(s, **i64)  # type: ignore[arg-type]
        self.pos = torch.zeros(s, **i64)  # type: ignore[arg-type]
        self.temperature = torch.zeros(s, **f32)  # type: ignore[arg-type]
        self.top_p = torch.ones(s, **f32)  # type: ignore[arg-type]
        self.seed = torch.zeros(s, **i64)  # type: ignore[arg-type]
        self.next = torch.zeros(s, **i64)  # type: ignore[arg-type]
        # Per slot, on the device: the reply's length so far, its budget, whether it is still running.
        self.count_d = torch.zeros(s, **i64)  # type: ignore[arg-type]
        self.budget_d = torch.zeros(s, **i64)  # type: ignore[arg-type]
        self.live_d = torch.zeros(s, dtype=torch.bool, device=dev)
        self.eos_d = torch.from_numpy(self.eos).to(dev)
        self.window = torch.arange(self.sync_every, device=dev)
        # What the host reads after a group of steps, in one copy: the new tokens [steps, slots], then
        # each slot's reply length, then whether it ended in this group.
        self.look = torch.zeros(self.sync_every + 2, s, **i64)  # type: ignore[arg-type]
        self.ring = self.look[: self.sync_every]
        self.all_slots = torch.arange(s, device=dev)
        self.zero_rows = torch.zeros(s, **i64)  # type: ignore[arg-type]
        # Prefill inputs, at the largest padded shape (steps read leading views of them).
        r, c = self.row_buckets[-1], self.chunk
        self.p_tokens = torch.zeros(r, c, **i64)  # type: ignore[arg-type]
        self.p_slots = torch.full((r,), self.cache.scratch, **i64)  # type: ignore[arg-type]
        self.p_starts = torch.zeros(r, **i64)  # type: ignore[arg-type]
        self.p_last = torch.zeros(r, **i64)  # type: ignore[arg-type]
        self.p_temperature = torch.zeros(r, **f32)  # type: ignore[arg-type]
        self.p_top_p = torch.ones(r, **f32)  # type: ignore[arg-type]
        self.p_seed = torch.zeros(r, **i64)  # type: ignore[arg-type]
        self.p_out = torch.zeros(r, **i64)  # type: ignore[arg-type]
        # On the host: each slot's request, reply so far, whether it runs and samples.
        self.req: list[Request | None] = [None] * s
        self.live = np.zeros(s, dtype=bool)
        self.sampled = np.zeros(s, dtype=bool)
        self.count = np.zeros(s, dtype=np.int64)
        self.at = np.zeros(s, dtype=np.int64)  # position of each slot's next input token
        self.out = np.zeros((s, self.capacity + self.sync_every), dtype=np.int64)

    # --- steps ---

    def _decode(self, kv_len: int, sampling: bool, rows: Tensor) -> None:
        """One step for the slots `rows` (every slot with CUDA graphs; the live ones on the CPU)."""
        pos = self.pos[rows]
        logits = forward(
            self.w,
            self.cache,
            self.tokens[rows, None],
            rows,
            pos,
            self.zero_rows[: rows.shape[0]],
            kv_len=kv_len,
            attention=self.attention,
        )
        if sampling:
            nxt = sample(logits, self.temperature[rows], self.top_p[rows], self.seed[rows], pos + 1)
        else:
            nxt = logits.argmax(-1)
        self.next[rows] = nxt
        self.tokens[rows] = nxt
        self.pos[rows] = (pos + 1).clamp(max=self.capacity - 1)

    def _prefill(self, rows: int, chunk: int, kv_len: int, sampling: bool) -> None:
        logits = forward(
            self.w,
            self.cache,
            self.p_tokens[:rows, :chunk],
            self.p_slots[:rows],
            self.p_starts[:rows],
            self.p_last[:rows],
            kv_len=kv_len,
            attention=self.attention,
        )
        if sampling:
            where = self.p_starts[:rows] + self.p_last[:rows] + 1
            nxt = sample(logits, self.p_temperature[:rows], self.p_top_p[:rows], self.p_seed[:rows], where)
        else:
            nxt = logits.argmax(-1)
        self.p_out[:rows].copy_(nxt)

    def _look(self) -> None:
        """After a group of steps, for every slot at once: the live replies keep their new tokens up to
        the first end token and at most their budget; lengths, ended marks and the live flags are updated
        and written below the tokens in `look`."""
        k = self.sync_every
        count, budget, live = self.count_d, self.budget_d, self.live_d
        kept = live[None, :] & (count[None, :] + self.window[:, None] < budget[None, :])  # [k, slots]
        stop = kept & (self.ring[..., None] == self.eos_d).any(-1)
        stopped = stop.any(0)
        first = torch.where(stop, self.window[:, None], k).amin(0)  # the first end token's step
        grown = torch.where(stopped, count + first + 1, torch.minimum(count + k, budget))
        new_count = torch.where(live, grown, count)
        ended = live & (stopped | (new_count >= budget))
        count.copy_(new_count)
        live.logical_and_(~ended)
        self.look[k].copy_(new_count)
        self.look[k + 1].copy_(ended)

    def _kv_len(self, needed: int) -> int:
        return bucket(needed, self.kv_buckets) if self.kv_buckets else needed

    # --- the loop ---

    def run(
        self, source: RequestSource, *, on_progress: Callable[[int], None] | None = None
    ) -> GenerationStats:
        stats = GenerationStats()
        steps = 0
        busy = 0  # slot-steps spent on live replies
        held: list[Request] = []  # taken, waiting for enough free slots to make a prefill pass worth it
        ended: list[tuple[Request, Reply]] = []  # replies not yet handed to the source
        since_refill = 0
        # prefill passes, and prompt tokens not prefilled (copied from another request's prefill)
        tally = {"prefills": 0, "shared": 0}
        # wall seconds: each phase up to its device sync; "source": in the source's take and complete (part
        # of the host's); "overlap": host work done while decode steps ran
        clock = {"prefill": 0.0, "decode": 0.0, "source": 0.0, "overlap": 0.0}
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                while True:
                    live = int(self.live.sum())
                    if live == 0:  # nothing runs to hide it behind; it may ready the next rounds
                        self._complete(ended, source, stats, on_progress, clock)
                    free = np.flatnonzero(~self.live).tolist()
                    if len(free) > len(held):
                        ts = time.perf_counter()
                        held += source.take(len(free) - len(held), idle=live == 0 and not held)
                        clock["source"] += time.perf_counter() - ts
                    launch = seat = None  # a refill: its prefill passes, then seating their requests
                    if held and (
                        live == 0 or len(held) >= self._refill_at() or since_refill >= MAX_HOLD_STEPS
                    ):
                        since_refill = 0
                        held, copies = split_shared(held) if self.settings.share_prompts else (held, [])
                        passes: list[Pass] = []
                        launch = partial(self._launch_refill, passes, held, free, clock)
                        seat = partial(self._seat_refill, passes, copies, held, free, stats, clock, tally)
                        held = []
                        if not (live and self.pad):  # the eager loop, or nothing decoding: refill now
                            launch()
                            ended += seat()
                            continue  # replies that ended at their first token free slots and may ready new requests
                    if live == 0:
                        break
                    if launch is None:
                        since_refill += self.sync_every
                    # a refill's passes are launched behind this group's steps: on a GPU the host launches
                    # them while the device decodes (its slots are free in this group: nothing there reads or
                    # keeps what their rows hold), and its requests are seated after the group's look
                    look = self._decode_group(ended, source, stats, on_progress, clock, behind=launch)
                    steps += self.sync_every
                    busy += live * self.sync_every
                    ended += self._end(self._collect(look))
                    if seat is not None:
                        ended += seat()
        except KeyboardInterrupt:
            self._complete(ended, source, stats, on_progress, clock)  # what ended reaches the source
            raise
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        stats.seconds = time.perf_counter() - t0
        stats.extra = {
            "decode_steps": steps,
            "prefill_groups": tally["prefills"],
            "shared_prompt_tokens": tally["shared"],
            "slot_occupancy": busy / max(1, steps * self.settings.slots),
            "cuda_graphs": len(self.graphs),
            "capture_seconds": round(self.graphs.capture_seconds, 3),
            "prefill_seconds": round(clock["prefill"], 3),
            "decode_seconds": round(clock["decode"], 3),
            # the rest: collecting tokens, ending replies, the source's work (rendering, records, disk)
            "host_seconds": round(stats.seconds - clock["prefill"] - clock["decode"], 3),
            # ...of which in the source (`take`, `complete`: rendering prompts, detokenising, records, disk)
            "host_source_seconds": round(clock["source"], 3),
            # ...and done while decode steps were in flight (on a GPU the device ran them meanwhile;
            # on the CPU steps run eagerly, so nothing overlaps)
            "host_overlap_seconds": round(clock["overlap"], 3),
        }
        return stats

    def _decode_group(
        self,
        ended: list[tuple[Request, Reply]],
        source: RequestSource,
        stats: GenerationStats,
        on_progress: Callable[[int], None] | None,
        clock: dict[str, float],
        behind: Callable[[], None] | None = None,
    ) -> np.ndarray:
        """Launch `sync_every` decode steps and the look, then `behind` (a refill's prefill passes, queued
        after the steps), hand the `ended` replies to the source while they run, then copy the look to the
        host (the group's one sync). Decode seconds: launching and waiting."""
        live_rows = self.live
        kv_len = self._kv_len(int(self.at[live_rows].max()) + self.sync_every)
        sampling = bool((self.sampled & live_rows).any())
        rows = self.all_slots if self.pad else torch.from_numpy(np.flatnonzero(live_rows)).to(self.device)
        td = time.perf_counter()
        for k in range(self.sync_every):
            self.graphs.run(("decode", kv_len, sampling), partial(self._decode, kv_len, sampling, rows))
            self.ring[k].copy_(self.next)
        self._look()  # a dozen small kernels, launched eagerly (a graph would save ~0.1 ms a look)
        launched = time.perf_counter()
        if behind is not None:
            behind()  # its seconds count as prefill
        handing = time.perf_counter()
        self._complete(ended, source, stats, on_progress, clock)
        tw = time.perf_counter()
        look = self.look.cpu().numpy()
        clock["decode"] += (launched - td) + (time.perf_counter() - tw)
        clock["overlap"] += tw - handing
        return look

    def _refill_at(self) -> int:
        """Free slots that make a refill worth a prefill pass (a pass costs about as much for 1 row as
        for many on a GPU). A packed pass is eager: on the H200 it cost ~21 ms whether it held 3,600 or
        12,500 prompt tokens (its kernel launches, 2026-12-02), so packed refills wait for a sixteenth of
        the slots (128 of 2,048: about 14 decode steps of replies ending) and pass them together."""
        if not self.pad:
            return 1
        if self.packed:
            return max(1, self.settings.slots // PACKED_REFILL_SHARE)
        return max(1, min(self.row_buckets[-1], self.settings.slots) // 8)

    def _prefill_groups(self, held: list[Request]) -> list[list[Request]]:
        """The prefill passes of a refill: up to `prefill_rows` requests each (padded), or up to
        `packed_tokens` prompt tokens each (packed; a longer prompt passes alone)."""
        if not self.packed:
            rows = self.row_buckets[-1]
            return [held[i : i + rows] for i in range(0, len(held), rows)]
        groups: list[list[Request]] = []
        tokens = 0
        for r in held:
            n = len(r.prompt_ids)
            if not groups or tokens + n > self.settings.packed_tokens:
                groups.append([])
                tokens = 0
            groups[-1].append(r)
            tokens += n
        return groups

    def _launch_refill(
        self, passes: list[Pass], held: list[Request], free: list[int], clock: dict[str, float]
    ) -> None:
        """Launch the prefill passes of `held` into the first of the `free` slots (device work only, nothing
        read back), appending to `passes` each pass's requests, slots, first reply tokens (on the device)
        and prompt lengths."""
        tp = time.perf_counter()
        i = 0
        for group in self._prefill_groups(held):
            slots = free[i : i + len(group)]
            first, lengths = self._prefill_pass(group, slots)
            passes.append((group, slots, first, lengths))
            i += len(group)
        clock["prefill"] += time.perf_counter() - tp

    def _seat_refill(
        self,
        passes: list[Pass],
        copies: list[tuple[Request, int]],
        unique: list[Request],
        free: list[int],
        stats: GenerationStats,
        clock: dict[str, float],
        tally: dict[str, int],
    ) -> list[tuple[Request, Reply]]:
        """After `_launch_refill`: seat each pass's requests (their first tokens read back), then the
        `copies` of their prompts (`_share`) in the free slots after them; the replies that already ended."""
        tp = time.perf_counter()
        ended = []
        for group, slots, first, lengths in passes:
            tally["prefills"] += 1
            ended += self._end(self._started(group, slots, first, lengths, stats))
        if copies:
            tally["shared"] += self._share(
                [r for r, _ in copies],
                [free[j] for _, j in copies],
                free[len(unique) : len(unique) + len(copies)],
                stats,
            )
        clock["prefill"] += time.perf_counter() - tp
        return ended

    def _prefill_pass(self, group: list[Request], slots: list[int]) -> tuple[Tensor, list[int]]:
        """Prefill `group` into `slots`, sampling each reply's first token: (those tokens on the device, the
        prompt lengths). Host values go to the device without waiting for it (the pass may be queued behind
        decode steps)."""
        if self.packed:
            return self._packed_pass(group, slots)
        n = len(group)
        lengths = self._fitting_lengths(group)
        rows = bucket(n, self.row_buckets) if self.pad else n
        longest = max(lengths)
        chunk = bucket(min(longest, self.chunk), self.chunk_buckets) if self.pad else min(longest, self.chunk)
        passes = -(-longest // chunk)
        width = passes * chunk
        toks = torch.zeros(rows, width, dtype=torch.long)
        for i, r in enumerate(group):
            toks[i, : lengths[i]] = torch.tensor(r.prompt_ids, dtype=torch.long)
        to = partial(values_on, device=self.device)
        self.p_slots[:rows].fill_(self.cache.scratch)
        self.p_slots[:n] = to(slots)
        self.p_temperature[:n] = to([r.temperature for r in group], dtype=torch.float32)
        self.p_top_p[:n] = to([r.top_p for r in group], dtype=torch.float32)
        self.p_seed[:n] = to([r.seed for r in group])
        last_pass = to([(length - 1) // chunk for length in lengths] + [0] * (rows - n))
        first = torch.zeros(rows, dtype=torch.long, device=self.device)
        sampling = any(r.temperature > 0 for r in group)
        ends = torch.tensor([length - 1 for length in lengths] + [0] * (rows - n))
        for j in range(passes):
            self.p_tokens[:rows, :chunk] = to_device(toks[:, j * chunk : (j + 1) * chunk], self.device)
            self.p_starts[:rows].fill_(j * chunk)
            self.p_last[:rows] = to_device((ends - j * chunk).clamp(0, chunk - 1), self.device)
            kv_len = self._kv_len((j + 1) * chunk)
            self.graphs.run(
                ("prefill", rows, chunk, kv_len, sampling),
                partial(self._prefill, rows, chunk, kv_len, sampling),
            )
            first = torch.where(last_pass == j, self.p_out[:rows], first)
        return first[:n], lengths

    def _packed_pass(self, group: list[Request], slots: list[int]) -> tuple[Tensor, list[int]]:
        """`_prefill_pass` with the prompts packed end to end in one pass (`forward_packed`): the pass costs
        the prompt tokens, not rows x the longest prompt. Eager: its shape changes from pass to pass (on the
        H200 a pass is bound by its launches, ~21 ms, up to ~12,000 tokens: see `_refill_at`)."""
        lengths = self._fitting_lengths(group)
        to = partial(values_on, device=self.device)
        packing = pack(slots, [0] * len(group), lengths, self.device)
        tokens = to([t for r in group for t in r.prompt_ids])
        logits = forward_packed(self.w, self.cache, tokens, packing, attention=self.attention)
        if any(r.temperature > 0 for r in group):
            first = sample(
                logits,
                to([r.temperature for r in group], dtype=torch.float32),
                to([r.top_p for r in group], dtype=torch.float32),
                to([r.seed for r in group]),
                to(lengths),  # the position of the first reply token
            )
        else:
            first = logits.argmax(-1)
        return first, lengths

    def _started(
        self,
        group: list[Request],
        slots: list[int],
        first: Tensor,
        lengths: list[int],
        stats: GenerationStats,
    ) -> list[int]:
        """After a prefill sampled each request's first reply token (`first`, on the device): seat them;
        returns the slots whose reply already ended."""
        first_host = first.cpu().numpy()
        budget = np.array([r.max_new_tokens for r in group], dtype=np.int64)
        done = np.isin(first_host, self.eos) | (budget <= 1)
        where = np.array(slots, dtype=np.int64)
        self.out[where, 0] = first_host
        self._seat(group, slots, first, lengths, replied=1, live=~done)
        stats.prompt_tokens += sum(lengths)
        return where[done].tolist()

    def _share(
        self, group: list[Request], sources: list[int], slots: list[int], stats: GenerationStats
    ) -> int:
        """Start `group` in `slots`: each request's prompt was just prefilled into the slot `sources[i]`
        by another request. Its keys and values are copied (all positions but the last prompt position,
        one copy per cache tensor for the whole group), and the request starts as a decoding slot whose
        next input is the prompt's last token at its position: the first decode step writes that
        position and samples the first reply token from the request's own seed, at the position a
        prefill samples it. Returns the prompt tokens not prefilled."""
        lengths = self._fitting_lengths(group)
        dev = self.device
        idx = torch.tensor(slots, device=dev)
        upto = max(lengths) - 1  # beyond a shorter prompt's own length the copy is stale rows no query reads
        if upto > 0:
            src = torch.tensor(sources, device=dev)
            for t in (self.cache.keys, self.cache.values):  # every layer at once
                t[:, idx, :upto] = t[:, src, :upto]
        last = torch.tensor([r.prompt_ids[-1] for r in group], device=dev)
        live = np.ones(len(group), dtype=bool)
        self._seat(group, slots, last, [length - 1 for length in lengths], replied=0, live=live)
        stats.prompt_tokens += sum(lengths)
        return sum(lengths) - len(group)

    def _seat(
        self,
        group: list[Request],
        slots: list[int],
        tokens: Tensor,
        positions: list[int],
        replied: int,
        live: np.ndarray,
    ) -> None:
        """Seat `group` in `slots`, on the host and on the device: each slot's next input token (`tokens`,
        on the device) at `positions`, its sampling, the reply tokens it holds already (`replied`: 1 after a
        prefill sampled the first, 0 when the first decode step will), its budget and whether it runs."""
        dev = self.device
        idx = torch.tensor(slots, device=dev)
        self.tokens[idx] = tokens
        self.pos[idx] = torch.tensor(positions, device=dev)
        self.temperature[idx] = torch.tensor([r.temperature for r in group], device=dev)
        self.top_p[idx] = torch.tensor([r.top_p for r in group], device=dev)
        self.seed[idx] = torch.tensor([r.seed for r in group], device=dev)
        where = np.array(slots, dtype=np.int64)
        for r, s in zip(group, slots, strict=True):
            self.req[s] = r
        self.count[where] = replied
        self.at[where] = positions
        self.live[where] = live
        self.sampled[where] = [r.temperature > 0 for r in group]
        self.count_d[idx] = replied
        self.budget_d[idx] = torch.tensor([r.max_new_tokens for r in group], device=dev)
        self.live_d[idx] = torch.from_numpy(live).to(dev)

    def _fitting_lengths(self, group: list[Request]) -> list[int]:
        """The prompt lengths of `group`; a request whose prompt and reply do not fit a slot is an error."""
        lengths = [len(r.prompt_ids) for r in group]
        for r, length in zip(group, lengths, strict=True):
            if length == 0 or length + r.max_new_tokens + self.sync_every > self.capacity:
                raise DflashkitError(
                    f"request {r.key}: a prompt of {length} tokens and a reply of up to {r.max_new_tokens} "
                    f"do not fit a slot of {self.capacity - self.sync_every} positions"
                )
        return lengths

    def _collect(self, look: np.ndarray) -> np.ndarray:
        """Append the tokens of the last group of steps (`look`, as `_look` wrote it) to the live replies;
        the slots whose reply ended."""
        k = self.sync_every
        new, count, ended = look[:k], look[k], look[k + 1].astype(bool)
        steps, slots = np.nonzero(np.arange(k)[:, None] < (count - self.count)[None, :])
        self.out[slots, self.count[slots] + steps] = new[steps, slots]
        self.at[self.live] += k
        self.count = count.copy()
        self.live &= ~ended
        return np.flatnonzero(ended)

    def _end(self, slots: Sequence[int] | np.ndarray) -> list[tuple[Request, Reply]]:
        """The replies of ended `slots`, which are free again."""
        out = []
        for s in slots:
            req = self.req[s]
            assert req is not None
            self.req[s] = None
            ids = self.out[s, : self.count[s]].tolist()
            out.append((req, Reply(ids, bool(ids) and ids[-1] in self.eos_ids)))
        self.live[np.asarray(slots, dtype=np.int64)] = False
        return out

    def _complete(
        self,
        ended: list[tuple[Request, Reply]],
        source: RequestSource,
        stats: GenerationStats,
        on_progress: Callable[[int], None] | None,
        clock: dict[str, float],
    ) -> None:
        """Hand the `ended` replies to the source, emptying the list (an interruption leaves the ones not
        handed yet; a reply whose handing it cut is not handed twice)."""
        written = handed = 0
        t0 = time.perf_counter()
        try:
            for req, reply in ended:
                handed += 1
                stats.requests += 1
                stats.new_tokens += len(reply.ids)
                written += len(reply.ids)
                source.complete(req, reply)
        finally:
            del ended[:handed]
            clock["source"] += time.perf_counter() - t0
        if written and on_progress is not None:
            on_progress(written)
