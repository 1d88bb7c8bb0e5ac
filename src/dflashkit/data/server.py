"""Generation through a serving engine: the ``"server"`` backend of `dflashkit prepare --server URL`.

For targets too large to generate with in-process, the replies come from one or more running
OpenAI-compatible servers. Token ids go in and come out, so the data is exactly the target's tokens:
prompts are rendered and tokenized here with the target's own tokenizer and sent as id lists, and the
reply ids are taken as the server returns them, never re-tokenised from text.

Which endpoint each server gets is decided once, when `make_server_backend` probes it:

- llama.cpp's server (answers ``GET /props``): its native ``POST /completion`` with
  ``"return_tokens": true``, which returns the generated ids in ``tokens`` (its ``/v1/completions``
  returns text only). Only the top-p and temperature samplers run (``"samplers"``), as in the target;
  it stops on the end tokens its GGUF declares (it takes no stop token ids).
- vLLM and SGLang: ``POST /v1/completions`` with ``"return_token_ids": true``, which returns the ids in
  ``choices[0].token_ids`` (vLLM >= 0.10.2, SGLang); the end tokens are passed as ``stop_token_ids``.

Every reply is cut with `cut_reply` at the first of the target's end tokens (kept), so
`Reply.finished` means the target's end token was produced, whatever the server stopped on.

A server is used only after these checks pass (each failure is one clear `DflashkitError` naming the
server and the first difference): it answers a short completion with token ids; its tokenize endpoint
(``/tokenize``, or SGLang's ``/v1/tokenize``) splits a fixed set of probe texts (plain text, code,
Unicode, special tokens, a chat-rendered conversation) exactly as the target's tokenizer does; and its
chat template equals the target's where the server exposes it (llama.cpp: ``/props`` ``chat_template``;
vLLM: ``/tokenize`` of a conversation with ``messages``). Prompts are rendered here, so a server that
does not expose its template (SGLang) is still exact; its description says the template went unchecked.

Requests are spread over the servers by a pool of worker threads (``concurrency`` requests in flight
in all). A failed attempt (no connection, a time-out, HTTP 429 or 5xx, a malformed answer) is retried
with exponential back-off and jitter, honouring ``Retry-After``, on another server when one is healthy;
a server whose last attempt failed gets one request at a time, after a back-off that grows with its
failures, until it answers again, so the work of a dead server moves to the others. A request that fails ``retries + 1`` times, or that a server refuses
(another 4xx), stops the run with one clear error. Replies are handed to the `RequestSource` on the
thread that called `run`, each exactly once, and nothing else is: a failed request is not completed,
so a resumed run asks for it again.
"""

from __future__ import annotations

import email.utils
import http.client
import json
import logging
import queue
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from dflashkit.data.chat import PROBE_MESSAGES, encode_text, generation_prompt_ids, render_text, template_text
from dflashkit.data.generation import GenerationStats, Reply, Request, RequestSource, cut_reply
from dflashkit.errors import DflashkitError

log = logging.getLogger(__name__)

LLAMACPP = "llama.cpp"
OPENAI = "openai"  # vLLM / SGLang: /v1/completions with return_token_ids

# Texts whose tokenization must agree between the server and the target (the chat rendering and the
# special tokens are added per tokenizer by `probe_texts`).
PROBE_TEXTS: tuple[str, ...] = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces,\ttabs and\nnew lines\n\n   and trailing   ",
    "Numbers 1234567890 and 3.14159; symbols #$%&*(){}[]<>/\\|~`^_=+-",
    "Unicode: naïve café, Straße, Ελληνικά, 日本語のテキスト, 😀👍🏽",
    "def square(x: int) -> int:\n    return x ** 2  # code\n",
)
MAX_RETRY_AFTER_S = 120.0  # a longer Retry-After is capped (the request is retried, not abandoned)
MAX_BACKOFF_S = 30.0

_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # serving engines: no proxy


class ServerError(DflashkitError):
    """A server could not be used, or a request could not be completed on any server."""


# --- one HTTP exchange ---------------------------------------------------------------------------


class _Transient(Exception):
    """A failed attempt worth retrying (no connection, time-out, HTTP 429/5xx, malformed answer)."""

    def __init__(self, what: str, *, advice: str, retry_after: float | None = None) -> None:
        super().__init__(what)
        self.advice = advice
        self.retry_after = retry_after


class _Refused(Exception):
    """An answer that asking again will not change (HTTP 4xx other than 429, a cut context)."""


def normalize_url(url: str) -> str:
    """``http://host:port`` from what a user may type (a trailing slash or ``/v1`` is dropped)."""
    u = url.strip().rstrip("/")
    if u.endswith("/v1"):
        u = u[: -len("/v1")]
    if not u.startswith(("http://", "https://")):
        raise ServerError(f"--server {url!r} is not an http:// or https:// URL (e.g. http://127.0.0.1:8000)")
    return u


def retry_after_seconds(value: str | None) -> float | None:
    """The delay a ``Retry-After`` header asks for (seconds or an HTTP date), capped; None if absent."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(value)
        except (TypeError, ValueError):
            return None
        seconds = (when - datetime.now(timezone.utc)).total_seconds()
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def _error_detail(body: bytes) -> str:
    """The message of an error answer (the JSON ``error.message``/``message``/``detail``, else the text)."""
    text = body.decode("utf-8", "replace").strip()
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return text[:200] or "(empty answer)"
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            for k in ("message", "detail"):
                if err.get(k):
                    return str(err[k])[:200]
        elif err:
            return str(err)[:200]
    return text[:200]


def http_json(url: str, path: str, body: dict[str, Any] | None, timeout_s: float) -> Any:
    """One request to ``url + path`` (GET without a body, else POST of JSON); the parsed JSON answer.
    Raises `_Transient` for failures worth retrying and `_Refused` for other 4xx answers."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(
        url + path,
        data=data,
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json", "Accept": "application/json"},
    )
    reach = f"is the server running and reachable? (check `curl {url}/health`)"
    try:
        with _OPENER.open(req, timeout=timeout_s) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        detail = _error_detail(e.read() if e.fp is not None else b"")
        if e.code == 429 or e.code >= 500:
            raise _Transient(
                f"HTTP {e.code}: {detail}",
                advice="the server is overloaded or failing: lower the concurrency or read its log",
                retry_after=retry_after_seconds(e.headers.get("Retry-After") if e.headers else None),
            ) from None
        raise _Refused(f"HTTP {e.code}: {detail}") from None
    except TimeoutError:
        raise _Transient(
            f"no answer within {timeout_s:g} s",
            advice="raise the time-out or lower the concurrency (a reply of max_new_tokens must fit in it)",
        ) from None
    except urllib.error.URLError as e:
        if isinstance(e.reason, TimeoutError):
            raise _Transient(f"no connection within {timeout_s:g} s", advice=reach) from None
        raise _Transient(f"cannot connect ({e.reason})", advice=reach) from None
    except (http.client.HTTPException, OSError) as e:
        raise _Transient(f"connection lost ({type(e).__name__}: {e})", advice=reach) from None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _Transient(
            f"malformed JSON answer {raw[:80]!r}",
            advice="read the server's log; is it a vLLM, SGLang or llama.cpp server?",
        ) from None


def backoff_delay(attempt: int, base_s: float, retry_after: float | None) -> float:
    """Seconds to wait before retry `attempt` (0-based): exponential with full jitter, at least what
    the server's Retry-After asked for."""
    delay = random.uniform(base_s, base_s * 2**attempt) if base_s > 0 else 0.0
    delay = min(delay, MAX_BACKOFF_S)
    return max(delay, retry_after or 0.0)


# --- what is sent and what comes back ------------------------------------------------------------


def llamacpp_body(request: Request) -> dict[str, Any]:
    """llama.cpp's native /completion: ids in, ids back (``tokens``), only top-p and temperature."""
    return {
        "prompt": list(request.prompt_ids),
        "n_predict": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "samplers": ["top_p", "temperature"],
        "top_k": 0,
        "min_p": 0.0,
        "typical_p": 1.0,
        "repeat_penalty": 1.0,
        "return_tokens": True,
        "stream": False,
    }


def openai_body(request: Request, eos_ids: Sequence[int], model: str | None) -> dict[str, Any]:
    """/v1/completions of vLLM and SGLang: ids in, ``choices[0].token_ids`` back, no other sampler."""
    body: dict[str, Any] = {
        "prompt": list(request.prompt_ids),
        "max_tokens": request.max_new_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "seed": request.seed,
        "top_k": -1,
        "min_p": 0.0,
        "repetition_penalty": 1.0,
        "stop_token_ids": list(eos_ids),
        "return_token_ids": True,
        "skip_special_tokens": False,
        "n": 1,
        "stream": False,
    }
    if model:
        body["model"] = model
    return body


def _int_list(x: Any) -> list[int] | None:
    if isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x):
        return x
    return None


def answer_ids(kind: str, answer: Any) -> list[int] | None:
    """The generated token ids in a completion answer; None when it holds none."""
    if not isinstance(answer, dict):
        return None
    if kind == LLAMACPP:
        return _int_list(answer.get("tokens"))
    choices = answer.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return None
    return _int_list(choices[0].get("token_ids"))


def tokens_in(answer: Any) -> list[int] | None:
    """The ids of a tokenize answer (``{"tokens": [...]}``; llama.cpp may give ``{"id": ...}`` items)."""
    if not isinstance(answer, dict) or not isinstance(answer.get("tokens"), list):
        return None
    toks = [t["id"] if isinstance(t, dict) and "id" in t else t for t in answer["tokens"]]
    return _int_list(toks)


# --- the servers ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerInfo:
    """One checked server and how it is used."""

    url: str
    kind: str  # LLAMACPP or OPENAI
    endpoint: str  # "/completion" or "/v1/completions"
    model: str | None  # the served model's name ("model" of /v1/completions)
    version: str  # what the server says it is
    template: str  # how its chat template was checked

    def describe(self) -> str:
        return (
            f"{self.url}: {self.kind} ({self.version}), POST {self.endpoint} with token ids; "
            f"tokenizer checked; chat template {self.template}"
        )


class _Server:
    """Run-time state of one server (guarded by `_Pool`'s lock)."""

    def __init__(self, info: ServerInfo) -> None:
        self.info = info
        self.in_flight = 0
        self.failures = 0  # failed attempts since its last answer
        self.probe_at = 0.0  # a failing server is tried again (one request) from this time on
        self.answered = 0


class _Pool:
    """Chooses a server for each attempt: fewest requests in flight among the healthy ones (whose last
    attempt was answered). A failing server gets no work but one probe request at a time, after a
    back-off that grows with its failures, so a dead server's work moves to the others and a server
    that recovers is used again."""

    def __init__(self, infos: Sequence[ServerInfo], backoff_s: float) -> None:
        self.servers = [_Server(i) for i in infos]
        self.backoff_s = backoff_s
        self.lock = threading.Lock()
        self.retried = 0

    def pick(self, avoid: _Server | None) -> _Server:
        """The server for the next attempt (`avoid`: the one the request just failed on)."""
        with self.lock:
            now = time.monotonic()
            usable = [s for s in self.servers if s.failures == 0 or (s.in_flight == 0 and now >= s.probe_at)]
            others = [s for s in self.servers if s is not avoid]
            pool = [s for s in usable if s is not avoid] or usable or others or self.servers
            server = min(pool, key=lambda s: s.in_flight)
            server.in_flight += 1
            return server

    def done(self, server: _Server, *, ok: bool, retry_after: float | None = None) -> None:
        with self.lock:
            server.in_flight -= 1
            if ok:
                server.failures = 0
                server.answered += 1
                return
            server.failures += 1
            self.retried += 1
            wait = backoff_delay(min(server.failures - 1, 6), self.backoff_s, retry_after)
            server.probe_at = time.monotonic() + wait

    def healthy_other_than(self, server: _Server) -> bool:
        with self.lock:
            return any(s is not server and s.failures == 0 for s in self.servers)


class _Cancelled(Exception):
    """The run stopped (another request failed) while this one waited to retry."""


class ServerBackend:
    """The ``"server"`` generation backend: answers requests through checked serving engines
    (see the module docstring). Build it with `make_server_backend`."""

    name = "server"

    def __init__(
        self,
        servers: Sequence[ServerInfo],
        *,
        eos_ids: Sequence[int],
        concurrency: int = 64,
        timeout_s: float = 300.0,
        retries: int = 5,
        backoff_s: float = 0.5,
    ) -> None:
        if not servers:
            raise ServerError("no server given: pass --server URL (repeatable)")
        if concurrency < 1 or retries < 0 or timeout_s <= 0:
            raise ServerError(
                f"server settings out of range (concurrency {concurrency} >= 1, retries {retries} >= 0, "
                f"time-out {timeout_s} s > 0)"
            )
        self.servers = list(servers)
        self.eos_ids = [int(t) for t in eos_ids]
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s

    def describe(self) -> list[str]:
        """One line per server: its kind, the endpoint used and what was checked."""
        return [s.describe() for s in self.servers]

    # --- one request, on worker threads ---

    def _body(self, server: _Server, request: Request) -> dict[str, Any]:
        if server.info.kind == LLAMACPP:
            return llamacpp_body(request)
        return openai_body(request, self.eos_ids, server.info.model)

    def _attempt(self, server: _Server, request: Request) -> Reply:
        info = server.info
        answer = http_json(info.url, info.endpoint, self._body(server, request), self.timeout_s)
        ids = answer_ids(info.kind, answer)
        if ids is None:
            raise _Transient(
                f"answer without token ids {json.dumps(answer)[:80]!r}",
                advice="read the server's log; is it a vLLM, SGLang or llama.cpp server?",
            )
        if info.kind == LLAMACPP and answer.get("truncated"):
            raise _Refused(
                f"it cut the context (prompt {len(request.prompt_ids)} + up to {request.max_new_tokens} "
                "new tokens is more than a slot holds); restart the llama.cpp server with a larger --ctx-size",
            )
        return cut_reply(ids, self.eos_ids, request.max_new_tokens)

    def _answer(self, pool: _Pool, request: Request, stop: threading.Event) -> Reply:
        avoid: _Server | None = None
        last: tuple[_Server, _Transient] | None = None
        for attempt in range(self.retries + 1):
            if stop.is_set():
                raise _Cancelled
            server = pool.pick(avoid)
            try:
                reply = self._attempt(server, request)
            except _Transient as e:
                pool.done(server, ok=False, retry_after=e.retry_after)
                last, avoid = (server, e), server
                log.info("%s: request %s attempt %d failed: %s", server.info.url, request.key, attempt + 1, e)
                wait = attempt < self.retries and not pool.healthy_other_than(server)
                if wait and stop.wait(backoff_delay(attempt, self.backoff_s, e.retry_after)):
                    raise _Cancelled from None
                continue
            except _Refused as e:
                pool.done(server, ok=True)  # it answered: the server is alive, the request is refused
                raise ServerError(
                    f"server {server.info.url} refused request {request.key} ({e}); asking again will not "
                    "help: check the server's settings (context size, model) against the data"
                ) from None
            pool.done(server, ok=True)
            return reply
        assert last is not None
        server, err = last
        raise ServerError(
            f"request {request.key} failed {self.retries + 1} times; last at server {server.info.url}: {err}; "
            f"{err.advice}. Replies already written are kept: fix the server and run prepare again to resume"
        )

    def _worker(
        self,
        pool: _Pool,
        tasks: queue.SimpleQueue[Request | None],
        results: queue.SimpleQueue[tuple[Request, Reply | BaseException]],
        stop: threading.Event,
    ) -> None:
        while (request := tasks.get()) is not None:
            try:
                results.put((request, self._answer(pool, request, stop)))
            except _Cancelled:
                return
            except BaseException as e:  # handed to the calling thread, which raises it
                results.put((request, e))

    # --- the run, on the calling thread ---

    def run(
        self, source: RequestSource, *, on_progress: Callable[[int], None] | None = None
    ) -> GenerationStats:
        """Answer every request `source` makes ready; `complete` is called on this thread only."""
        pool = _Pool(self.servers, self.backoff_s)
        stop = threading.Event()
        tasks: queue.SimpleQueue[Request | None] = queue.SimpleQueue()
        results: queue.SimpleQueue[tuple[Request, Reply | BaseException]] = queue.SimpleQueue()
        workers = [
            threading.Thread(target=self._worker, args=(pool, tasks, results, stop), daemon=True)
            for _ in range(self.concurrency)
        ]
        for w in workers:
            w.start()
        stats = GenerationStats()
        t0 = time.perf_counter()
        running = 0
        try:
            while True:
                if running < self.concurrency:  # idle: [] then means that no request will come
                    for request in source.take(self.concurrency - running, idle=running == 0):
                        tasks.put(request)
                        running += 1
                if running == 0:
                    break
                request, out = results.get()
                running -= 1
                if isinstance(out, BaseException):
                    self._complete_ready(source, results, stats, on_progress)
                    raise out
                self._complete(source, request, out, stats, on_progress)
        finally:
            stop.set()
            for _ in workers:
                tasks.put(None)
        stats.seconds = time.perf_counter() - t0
        stats.extra.update(self._extra(pool))
        return stats

    @staticmethod
    def _complete(
        source: RequestSource,
        request: Request,
        reply: Reply,
        stats: GenerationStats,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        source.complete(request, reply)
        stats.requests += 1
        stats.new_tokens += len(reply.ids)
        stats.prompt_tokens += len(request.prompt_ids)
        if on_progress is not None:
            on_progress(len(reply.ids))

    def _complete_ready(
        self,
        source: RequestSource,
        results: queue.SimpleQueue[tuple[Request, Reply | BaseException]],
        stats: GenerationStats,
        on_progress: Callable[[int], None] | None,
    ) -> None:
        """Hand over the replies that arrived beside a failure, so no finished work is lost."""
        while True:
            try:
                request, out = results.get_nowait()
            except queue.Empty:
                return
            if isinstance(out, Reply):
                self._complete(source, request, out, stats, on_progress)

    def _extra(self, pool: _Pool) -> dict[str, float]:
        extra: dict[str, float] = {
            "servers": float(len(pool.servers)),
            "concurrency": float(self.concurrency),
            "retried_attempts": float(pool.retried),
            "servers_failing_at_end": float(sum(s.failures > 0 for s in pool.servers)),
        }
        for s in pool.servers:
            extra[f"answered {s.info.url}"] = float(s.answered)
        return extra


# --- probing and checking a server ---------------------------------------------------------------


def _probe(
    url: str, path: str, body: dict[str, Any] | None, *, timeout_s: float, retries: int, backoff_s: float
) -> Any:
    """`http_json` with retries (a server that is still loading its model answers 503)."""
    for attempt in range(retries + 1):
        try:
            return http_json(url, path, body, timeout_s)
        except _Transient as e:
            if attempt == retries:
                raise ServerError(
                    f"server {url} did not answer {path} after {retries + 1} attempts: {e}; {e.advice}"
                ) from None
            time.sleep(backoff_delay(attempt, backoff_s, e.retry_after))
    raise AssertionError("unreachable")


def _optional(url: str, path: str, body: dict[str, Any] | None, **kw: Any) -> Any | None:
    """The answer of an endpoint the server may not have (None on a 4xx answer)."""
    try:
        return _probe(url, path, body, **kw)
    except _Refused:
        return None


def probe_texts(tokenizer: Any, enable_thinking: bool) -> list[str]:
    """The texts whose tokenization is compared: `PROBE_TEXTS`, the special tokens, and a conversation
    rendered with the target's chat template."""
    specials = [t for t in getattr(tokenizer, "all_special_tokens", []) if t]
    texts = list(PROBE_TEXTS)
    if specials:
        texts.append("".join(specials))
        texts.append(f"Before{specials[0]}between {specials[-1]} after")
    if getattr(tokenizer, "chat_template", None):
        texts.append(
            render_text(
                tokenizer, PROBE_MESSAGES, add_generation_prompt=True, enable_thinking=enable_thinking
            )
        )
    return texts


def _first_difference(a: Sequence[Any], b: Sequence[Any]) -> int:
    """The first index where `a` and `b` differ (the shorter length when one is a prefix of the other)."""
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def _piece(tokenizer: Any, ids: Sequence[int], k: int) -> str:
    if k >= len(ids):
        return "nothing (the sequence ends)"
    try:
        piece = tokenizer.convert_ids_to_tokens([ids[k]])[0]
    except Exception:
        piece = "?"
    return f"{ids[k]} {piece!r}"


def tokenizer_mismatch(tokenizer: Any, text: str, server_ids: Sequence[int]) -> str | None:
    """Where the server's tokenization of `text` first differs from the target's (None: identical)."""
    ours = encode_text(tokenizer, text)
    if list(server_ids) == ours:
        return None
    k = _first_difference(server_ids, ours)
    return (
        f"probe text {text[:40]!r}...: at token {k} the server has {_piece(tokenizer, server_ids, k)} "
        f"where the target's tokenizer has {_piece(tokenizer, ours, k)}"
    )


def template_mismatch(ours: str, theirs: str) -> str | None:
    """Where two chat template texts first differ (None: identical)."""
    if ours == theirs:
        return None
    k = _first_difference(ours, theirs)
    return f"at character {k} the server's template has {theirs[k : k + 40]!r} where the target's has {ours[k : k + 40]!r}"


class _Probe:
    """The start-up checks of one server (see `make_server_backend`)."""

    def __init__(self, url: str, tokenizer: Any, eos_ids: Sequence[int], kw: dict[str, Any]) -> None:
        self.url = url
        self.tokenizer = tokenizer
        self.eos_ids = list(eos_ids)
        self.kw = kw

    def refuse(self, what: str) -> ServerError:
        return ServerError(f"server {self.url} cannot be used: {what}")

    def kind(self) -> tuple[str, dict[str, Any] | None]:
        health = _optional(self.url, "/health", None, **self.kw)
        props = _optional(self.url, "/props", None, **self.kw)
        if isinstance(props, dict) and ("default_generation_settings" in props or "build_info" in props):
            return LLAMACPP, props
        if health is None and _optional(self.url, "/v1/models", None, **self.kw) is None:
            raise self.refuse(
                "it answers neither /health nor /v1/models; is it a vLLM, SGLang or llama.cpp server?"
            )
        return OPENAI, None

    def info(self, enable_thinking: bool) -> ServerInfo:
        kind, props = self.kind()
        if kind == LLAMACPP:
            assert props is not None
            version = f"build {props.get('build_info', '?')}, model {props.get('model_path', '?')}"
            info = ServerInfo(self.url, LLAMACPP, "/completion", None, version, "")
        else:
            models = _optional(self.url, "/v1/models", None, **self.kw) or {}
            data = models.get("data") if isinstance(models, dict) else None
            model = (
                str(data[0]["id"]) if isinstance(data, list) and data and isinstance(data[0], dict) else None
            )
            ver = _optional(self.url, "/version", None, **self.kw)
            version = f"version {ver.get('version', '?')}" if isinstance(ver, dict) else "version unknown"
            info = ServerInfo(self.url, OPENAI, "/v1/completions", model, f"{version}, model {model}", "")
        self.check_returns_ids(info)
        self.check_tokenizer(info, enable_thinking)
        template = self.check_template(info, props, enable_thinking)
        return ServerInfo(info.url, info.kind, info.endpoint, info.model, info.version, template)

    def check_returns_ids(self, info: ServerInfo) -> None:
        prompt = tuple(encode_text(self.tokenizer, "Hello"))
        request = Request(key="probe", prompt_ids=prompt, max_new_tokens=2)
        body = (
            llamacpp_body(request)
            if info.kind == LLAMACPP
            else openai_body(request, self.eos_ids, info.model)
        )
        try:
            answer = _probe(self.url, info.endpoint, body, **self.kw)
        except _Refused as e:
            raise self.refuse(f"POST {info.endpoint} with a token-id prompt was refused ({e})") from None
        ids = answer_ids(info.kind, answer)
        if not ids:
            what = "`tokens`" if info.kind == LLAMACPP else "`choices[0].token_ids` (return_token_ids)"
            raise self.refuse(
                f"POST {info.endpoint} returned no generated token ids in {what}, and dflashkit never "
                "re-tokenises text; use llama.cpp's server, vLLM >= 0.10.2 or SGLang"
            )

    def tokenize(self, info: ServerInfo, text: str) -> list[int]:
        if info.kind == LLAMACPP:
            calls = [("/tokenize", {"content": text, "add_special": False, "parse_special": True})]
        else:
            body = {"prompt": text, "add_special_tokens": False}
            calls = [("/tokenize", body), ("/v1/tokenize", body)]
            if info.model:
                calls = [(p, {**b, "model": info.model}) for p, b in calls]
        for path, body in calls:
            ids = tokens_in(_optional(self.url, path, body, **self.kw))
            if ids is not None:
                return ids
        raise self.refuse(
            "it has no tokenize endpoint (/tokenize or /v1/tokenize), so its tokenizer cannot be checked "
            "against the target's"
        )

    def check_tokenizer(self, info: ServerInfo, enable_thinking: bool) -> None:
        for text in probe_texts(self.tokenizer, enable_thinking):
            diff = tokenizer_mismatch(self.tokenizer, text, self.tokenize(info, text))
            if diff:
                raise self.refuse(
                    f"its tokenizer differs from the target's ({diff}); serve the target's own model and "
                    "tokenizer there"
                )

    def check_template(self, info: ServerInfo, props: dict[str, Any] | None, enable_thinking: bool) -> str:
        ours = template_text(self.tokenizer)
        if props is not None and isinstance(props.get("chat_template"), str):
            diff = template_mismatch(ours, props["chat_template"])
            if diff:
                raise self.refuse(
                    f"its chat template differs from the target's ({diff}); serve the target's own model "
                    "(or start it with the target's template)"
                )
            return "identical (/props)"
        if info.kind == OPENAI:
            body: dict[str, Any] = {
                "messages": list(PROBE_MESSAGES),
                "add_generation_prompt": True,
                "add_special_tokens": False,
                "chat_template_kwargs": {"enable_thinking": enable_thinking},
            }
            if info.model:
                body["model"] = info.model
            theirs = tokens_in(_optional(self.url, "/tokenize", body, **self.kw))
            if theirs is not None:
                ours_ids = generation_prompt_ids(
                    self.tokenizer, PROBE_MESSAGES, enable_thinking=enable_thinking
                )
                if theirs != ours_ids:
                    k = _first_difference(theirs, ours_ids)
                    raise self.refuse(
                        "its chat template renders a probe conversation differently from the target's (at "
                        f"token {k} the server has {_piece(self.tokenizer, theirs, k)} where the target has "
                        f"{_piece(self.tokenizer, ours_ids, k)}); serve the target's own model and template"
                    )
                return "renders identically (/tokenize with messages)"
        return "not exposed by the server (prompts are rendered here, so it is not used)"


def make_server_backend(
    urls: Sequence[str],
    *,
    tokenizer: Any,
    eos_ids: list[int],
    concurrency: int = 64,
    timeout_s: float = 300,
    retries: int = 5,
    backoff_s: float = 0.5,
    enable_thinking: bool = False,
) -> ServerBackend:
    """Probe and check each server, then return the backend that generates through them.

    Per server: wait for ``/health`` (retrying while a model loads), tell llama.cpp (``/props``) from
    vLLM/SGLang (``/v1/models``, ``/version``), check that a short token-id completion comes back as
    token ids, that its tokenize endpoint matches `tokenizer` on fixed probe texts, and that its chat
    template (where exposed) matches the target's rendered with `enable_thinking`. Each refusal is one
    `ServerError` naming the server and the first difference."""
    if not urls:
        raise ServerError("no server given: pass --server URL (repeatable)")
    normalized = [normalize_url(u) for u in urls]
    if len(set(normalized)) != len(normalized):
        raise ServerError(f"a server is given twice in --server {list(urls)}: give each once")
    kw = {"timeout_s": min(timeout_s, 60.0), "retries": retries, "backoff_s": backoff_s}
    infos = [_Probe(url, tokenizer, eos_ids, kw).info(enable_thinking) for url in normalized]
    for info in infos:
        log.info("generation server %s", info.describe())
    return ServerBackend(
        infos,
        eos_ids=eos_ids,
        concurrency=concurrency,
        timeout_s=timeout_s,
        retries=retries,
        backoff_s=backoff_s,
    )
