"""What a generation backend is asked, and what it answers.

`dflashkit prepare` turns conversations into `Request`s (one per user turn, round by round: a later round
is asked only once the target has answered the earlier ones), and a backend answers them with `Reply`s.
The backends share one small contract, so the cache, resume and record logic never depend on which one
ran:

- ``"slots"`` (`dflashkit.data.generator.SlotGenerator`): our own batched decoder for Llama-family
  targets: a preallocated K/V cache of fixed slots, finished slots refilled at once with new requests,
  prompts prefilled in chunks, fixed-shape steps replayed as CUDA graphs on a GPU.
- ``"hf"`` (`dflashkit.data.hf_generate.HFGenerator`): transformers' ``generate`` on fixed, left-padded
  batches; any architecture transformers can generate with; the reference for the others.
- ``"server"`` (`dflashkit.data.server`): an OpenAI-compatible completions endpoint (vLLM, SGLang,
  llama.cpp's server) for targets too large to generate with in-process; token ids in and out.

A backend pulls work from a `RequestSource` and hands every reply back to it:

    while True:
        new = source.take(free_capacity, idle=nothing_running)  # up to n requests ready now
        ...start them...
        if nothing is running and not new: break  # no request runs, so none can become ready
        ...for each request that ends: source.complete(request, reply)

`complete` may make new requests ready (the conversation's next round), so a backend asks again after
completing. `take` returns the shortest prompts first, so batched rows waste little padding. A source may
prepare requests in batches (rendering prompts in parallel); `idle=True` tells it that the backend has
nothing running, so it must hand over whatever it is holding back: [] then means "no request will come".

Sampling is seeded per request (`Request.seed`): a backend that can (slots, server) draws each request's
tokens from its own seed, so a reply does not depend on which other requests ran beside it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class Request:
    """One reply to generate: the rendered prompt as token ids and how to sample the continuation."""

    key: str  # unique within a run: "<record id>#<round>"
    prompt_ids: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0
    seed: int = 0  # this request's sampling seed (0 <= seed < 2**31)


@dataclass(frozen=True)
class Reply:
    """The tokens the target wrote: up to and including its end token when `finished`, else cut at the
    request's `max_new_tokens`."""

    ids: list[int]
    finished: bool


def cut_reply(ids: list[int], eos_ids: list[int] | set[int] | frozenset[int], max_new_tokens: int) -> Reply:
    """The reply in a stream of generated ids: up to the first end token (kept), else the first
    `max_new_tokens` ids, unfinished."""
    stop = set(eos_ids)
    for k, t in enumerate(ids[:max_new_tokens]):
        if t in stop:
            return Reply(list(ids[: k + 1]), True)
    return Reply(list(ids[:max_new_tokens]), False)


class RequestSource(Protocol):
    def take(self, n: int, idle: bool = False) -> list[Request]:
        """Up to `n` requests that are ready now, shortest prompt first ([] when none is). With `idle`
        (nothing runs in the backend) [] means that no request will come."""
        ...

    def complete(self, request: Request, reply: Reply) -> None:
        """The reply to `request`; may make the conversation's next round ready."""
        ...


class ListSource:
    """The simplest `RequestSource`: a fixed list of requests, handed out shortest first; each reply kept
    in `replies` by request key (a second reply to one request is an error)."""

    def __init__(self, requests: list[Request]):
        self.ready = sorted(requests, key=lambda r: len(r.prompt_ids))
        self.replies: dict[str, Reply] = {}

    def take(self, n: int, idle: bool = False) -> list[Request]:
        out, self.ready = self.ready[:n], self.ready[n:]
        return out

    def complete(self, request: Request, reply: Reply) -> None:
        if request.key in self.replies:
            raise ValueError(f"request {request.key} answered twice")
        self.replies[request.key] = reply


@dataclass
class GenerationStats:
    """What one backend run did (new tokens count every token of every reply, end tokens included)."""

    requests: int = 0
    new_tokens: int = 0
    prompt_tokens: int = 0
    seconds: float = 0.0
    extra: dict[str, float] = field(default_factory=dict)  # backend-specific figures (steps, slots used, ...)

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0


class Backend(Protocol):
    name: str

    def run(
        self, source: RequestSource, *, on_progress: Callable[[int], None] | None = None
    ) -> GenerationStats:
        """Answer requests from `source` until none is running and none is ready. `on_progress(n)` is
        called with the new tokens written since its last call (for a progress bar)."""
        ...


def request_seed(run_seed: int, record_id: str, round_index: int) -> int:
    """The sampling seed of one request: fixed by the run's seed, the record and the round (not by what
    else is generated beside it)."""
    import hashlib

    digest = hashlib.sha256(f"{run_seed}:{record_id}:{round_index}".encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
