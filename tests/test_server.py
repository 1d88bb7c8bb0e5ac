"""The ``"server"`` generation backend against a fake OpenAI-compatible server (CPU, a few seconds).

The fake answers like vLLM (``/v1/completions`` with ``return_token_ids``) or like llama.cpp's server
(``/completion`` with ``return_tokens``), with deterministic token ids, and can be told to fail: down,
429 and 500 answers, malformed JSON, time-outs, killed mid-run, another tokenizer or chat template.
Every test checks that the request source saw each request completed exactly once, on the calling
thread, with the reply the fake produced (cut at the target's end token).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dflashkit.data.chat import encode_text, generation_prompt_ids, template_text
from dflashkit.data.generation import Reply, Request, cut_reply
from dflashkit.data.server import (
    LLAMACPP,
    OPENAI,
    ServerBackend,
    backoff_delay,
    make_server_backend,
    normalize_url,
    retry_after_seconds,
)
from dflashkit.errors import DflashkitError

EOS = 2  # the embedded target's <|im_end|>
FAST = {"retries": 3, "backoff_s": 0.01, "timeout_s": 5.0}


def fake_reply(prompt: Sequence[int]) -> list[int]:
    """What the fake server generates for a prompt: deterministic ids; a third of the replies end with
    the end token, a third go on past it (as a server that does not stop on it would), a third do not
    end."""
    s = sum((i + 1) * t for i, t in enumerate(prompt))
    ids = [100 + (s * 31 + 7 * k) % 5000 for k in range(4 + s % 9)]
    if s % 3 == 0:
        ids += [EOS, 101, 102]
    elif s % 3 == 1:
        ids += [EOS]
    return ids


def expected(request: Request) -> Reply:
    return cut_reply(fake_reply(request.prompt_ids), [EOS], request.max_new_tokens)


class FakeServer:
    """A threaded HTTP server answering like vLLM (`kind` OPENAI) or llama.cpp's server (LLAMACPP)."""

    def __init__(self, tokenizer: Any, kind: str = OPENAI) -> None:
        self.tokenizer = tokenizer
        self.kind = kind
        self.lock = threading.Lock()
        self.script: list[str] = []  # what the next completions do: ok, 429, 500, 400, garbage, sleep
        self.kill_after: int | None = None  # answered completions after which the server dies
        self.answered = 0
        self.sleep_s = 1.0
        self.skew_tokenizer = False
        self.skew_template = False
        self.return_ids = True
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.fake = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.dead = False
        self._stopped = False
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()

    def stop(self) -> None:
        with self.lock:
            if self._stopped:
                return
            self._stopped = True
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- endpoints: (status, JSON object or raw bytes, headers); None drops the connection ---

    def get(self, path: str) -> tuple[int, Any, dict[str, str]] | None:
        if path == "/health":
            return 200, {"status": "ok"}, {}
        if path == "/props" and self.kind == LLAMACPP:
            template = template_text(self.tokenizer) + (" " if self.skew_template else "")
            return 200, {"build_info": "fake", "model_path": "fake.gguf", "chat_template": template}, {}
        if path == "/v1/models":
            return 200, {"object": "list", "data": [{"id": "fake-model"}]}, {}
        if path == "/version" and self.kind == OPENAI:
            return 200, {"version": "fake"}, {}
        return 404, {"error": {"message": f"no {path}"}}, {}

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]] | None:
        if path == "/tokenize":
            return 200, {"tokens": self.tokenize(body)}, {}
        completion = "/completion" if self.kind == LLAMACPP else "/v1/completions"
        if path == completion:
            return self.complete(body)
        return 404, {"error": {"message": f"no {path}"}}, {}

    def tokenize(self, body: dict[str, Any]) -> list[int]:
        if "messages" in body:
            ids = generation_prompt_ids(self.tokenizer, body["messages"], enable_thinking=False)
            return ids[:-1] + [ids[-1] + 1] if self.skew_template else ids
        ids = encode_text(self.tokenizer, body["content" if self.kind == LLAMACPP else "prompt"])
        if self.skew_tokenizer and "Unicode" in (body.get("content") or body.get("prompt") or ""):
            ids[3] += 1
        return ids

    def complete(self, body: dict[str, Any]) -> tuple[int, Any, dict[str, str]] | None:
        with self.lock:
            if self.dead:
                return None
            if self.kill_after is not None and self.answered >= self.kill_after:
                self.dead = True
                threading.Thread(target=self.stop, daemon=True).start()
                return None
            action = self.script.pop(0) if self.script else "ok"
            if action == "ok":
                self.answered += 1
        if action == "429":
            return 429, {"error": {"message": "too many requests"}}, {"Retry-After": "0"}
        if action == "500":
            return 500, {"error": {"message": "internal error"}}, {}
        if action == "400":
            return 400, {"error": {"message": "prompt is longer than the context"}}, {}
        if action == "garbage":
            return 200, b'{"choices": [{"tok', {}
        if action == "sleep":
            time.sleep(self.sleep_s)
        ids = fake_reply(body["prompt"])[: body["max_tokens" if self.kind == OPENAI else "n_predict"]]
        if self.kind == LLAMACPP:
            return (
                200,
                {"content": "text", "tokens": ids if self.return_ids else [], "stop_type": "limit"},
                {},
            )
        choice: dict[str, Any] = {"index": 0, "text": "text", "finish_reason": "length"}
        if self.return_ids:
            choice["token_ids"] = ids
        return 200, {"object": "text_completion", "choices": [choice]}, {}


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:
        pass

    def do_GET(self) -> None:
        self._send(self.server.fake.get(self.path))  # type: ignore[attr-defined]

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(self.server.fake.post(self.path, body))  # type: ignore[attr-defined]

    def _send(self, answer: tuple[int, Any, dict[str, str]] | None) -> None:
        if answer is None:
            self.close_connection = True
            return
        status, obj, headers = answer
        data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
        try:
            self.send_response(status)
            for k, v in {
                "Content-Type": "application/json",
                "Content-Length": str(len(data)),
                **headers,
            }.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a time-out)
            pass


class ListSource:
    """A list of requests; records every completion and checks it comes on the calling thread."""

    def __init__(self, requests: Sequence[Request]) -> None:
        self.pending = list(requests)
        self.completed: list[tuple[Request, Reply]] = []
        self.thread = threading.get_ident()

    def take(self, n: int, idle: bool = False) -> list[Request]:
        self.pending.sort(key=lambda r: len(r.prompt_ids))
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def complete(self, request: Request, reply: Reply) -> None:
        assert threading.get_ident() == self.thread, "complete() called off the calling thread"
        self.completed.append((request, reply))

    def assert_each_once(self, keys: set[str]) -> None:
        counts = Counter(r.key for r, _ in self.completed)
        assert set(counts) == keys
        assert max(counts.values()) == 1
        for request, reply in self.completed:
            assert reply == expected(request), request.key


class MultiTurnSource(ListSource):
    """As multi-turn prepare does: completing round r makes round r + 1 of that conversation ready,
    its prompt extended by the reply and a user turn."""

    def __init__(self, requests: Sequence[Request], rounds: int) -> None:
        super().__init__(requests)
        self.rounds = rounds

    def complete(self, request: Request, reply: Reply) -> None:
        super().complete(request, reply)
        record, r = request.key.split("#")
        if int(r) + 1 < self.rounds:
            prompt = (*request.prompt_ids, *reply.ids, 1, 9, 2)
            self.pending.append(
                Request(f"{record}#{int(r) + 1}", prompt, request.max_new_tokens, seed=int(r) + 1)
            )


class HoldingSource(ListSource):
    """A source that holds its requests back until the backend is idle (as one that renders prompts
    in batches may): `take` without `idle` gives nothing."""

    def take(self, n: int, idle: bool = False) -> list[Request]:
        return super().take(n) if idle else []


def make_requests(n: int) -> list[Request]:
    return [
        Request(f"c{i}#0", tuple(range(30 + i, 40 + 2 * i)), max_new_tokens=6 + i % 8, seed=i)
        for i in range(n)
    ]


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from dflashkit.target.hf import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("embedded")[0])


@pytest.fixture
def servers(tokenizer: Any) -> Iterator[Any]:
    made: list[FakeServer] = []

    def start(kind: str = OPENAI) -> FakeServer:
        made.append(FakeServer(tokenizer, kind))
        return made[-1]

    yield start
    for s in made:
        s.stop()


def backend(tokenizer: Any, *fakes: FakeServer, concurrency: int = 4, **kw: Any) -> ServerBackend:
    return make_server_backend(
        [f.url for f in fakes], tokenizer=tokenizer, eos_ids=[EOS], concurrency=concurrency, **{**FAST, **kw}
    )


def one_line_error(excinfo: pytest.ExceptionInfo[DflashkitError]) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


# --- probing -------------------------------------------------------------------------------------


def test_probe_picks_the_endpoint_and_checks_both_kinds(tokenizer, servers):
    vllm, llama = servers(OPENAI), servers(LLAMACPP)
    b = backend(tokenizer, vllm, llama)
    by_url = {s.url: s for s in b.servers}
    assert (by_url[vllm.url].kind, by_url[vllm.url].endpoint, by_url[vllm.url].model) == (
        OPENAI,
        "/v1/completions",
        "fake-model",
    )
    assert by_url[vllm.url].template == "renders identically (/tokenize with messages)"
    assert (by_url[llama.url].kind, by_url[llama.url].endpoint) == (LLAMACPP, "/completion")
    assert by_url[llama.url].template == "identical (/props)"
    lines = b.describe()
    assert len(lines) == 2 and all("token ids" in line and "tokenizer checked" in line for line in lines)


def test_url_forms_are_normalized():
    assert normalize_url(" http://h:8000/v1/ ") == "http://h:8000"
    with pytest.raises(DflashkitError, match="not an http"):
        normalize_url("h:8000")


def test_server_down_at_start_is_one_clear_error(tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(DflashkitError) as e:
        make_server_backend([f"http://127.0.0.1:{port}"], tokenizer=tokenizer, eos_ids=[EOS], **FAST)
    msg = one_line_error(e)
    assert f"http://127.0.0.1:{port}" in msg and "/health" in msg and "is the server running" in msg


def test_tokenizer_mismatch_is_refused(tokenizer, servers):
    for kind in (OPENAI, LLAMACPP):
        fake = servers(kind)
        fake.skew_tokenizer = True
        with pytest.raises(DflashkitError) as e:
            backend(tokenizer, fake)
        msg = one_line_error(e)
        assert fake.url in msg and "tokenizer differs" in msg and "Unicode" in msg and "at token 3" in msg


def test_template_mismatch_is_refused(tokenizer, servers):
    llama = servers(LLAMACPP)
    llama.skew_template = True
    with pytest.raises(DflashkitError) as e:
        backend(tokenizer, llama)
    msg = one_line_error(e)
    assert llama.url in msg and "chat template differs" in msg and "at character" in msg
    vllm = servers(OPENAI)
    vllm.skew_template = True
    with pytest.raises(DflashkitError) as e:
        backend(tokenizer, vllm)
    msg = one_line_error(e)
    assert vllm.url in msg and "chat template renders a probe conversation differently" in msg


def test_server_without_token_ids_is_refused(tokenizer, servers):
    for kind in (OPENAI, LLAMACPP):
        fake = servers(kind)
        fake.return_ids = False
        with pytest.raises(DflashkitError) as e:
            backend(tokenizer, fake)
        msg = one_line_error(e)
        assert fake.url in msg and "no generated token ids" in msg and "never re-tokenises" in msg


# --- generating ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [OPENAI, LLAMACPP])
def test_replies_are_the_servers_token_ids_cut_at_the_end_token(tokenizer, servers, kind):
    b = backend(tokenizer, servers(kind))
    requests = make_requests(24)
    source = ListSource(requests)
    progress: list[int] = []
    stats = b.run(source, on_progress=progress.append)
    source.assert_each_once({r.key for r in requests})
    replies = [reply for _, reply in source.completed]
    assert any(r.finished for r in replies) and any(not r.finished for r in replies)
    for reply in replies:
        assert (reply.ids[-1] == EOS) == reply.finished and EOS not in reply.ids[:-1]
    assert stats.requests == 24 and stats.new_tokens == sum(len(r.ids) for r in replies) == sum(progress)
    assert stats.prompt_tokens == sum(len(r.prompt_ids) for r in requests)
    assert stats.extra["retried_attempts"] == 0


def test_multi_turn_follow_ups_spread_over_two_servers(tokenizer, servers):
    a, b_ = servers(OPENAI), servers(LLAMACPP)
    b = backend(tokenizer, a, b_)
    source = MultiTurnSource(make_requests(10), rounds=3)
    stats = b.run(source)
    source.assert_each_once({f"c{i}#{r}" for i in range(10) for r in range(3)})
    assert stats.requests == 30
    assert stats.extra[f"answered {a.url}"] > 0 and stats.extra[f"answered {b_.url}"] > 0


def test_a_source_that_holds_requests_back_until_idle_is_drained(tokenizer, servers):
    b = backend(tokenizer, servers(OPENAI))
    requests = make_requests(10)
    source = HoldingSource(requests)
    stats = b.run(source)
    source.assert_each_once({r.key for r in requests})
    assert stats.requests == 10


def test_429_500_and_malformed_answers_are_retried(tokenizer, servers):
    fake = servers(OPENAI)
    b = backend(tokenizer, fake)
    fake.script = ["429", "500", "garbage", "429", "500"]
    source = MultiTurnSource(make_requests(8), rounds=2)
    stats = b.run(source)
    source.assert_each_once({f"c{i}#{r}" for i in range(8) for r in range(2)})
    assert stats.extra["retried_attempts"] == 5


def test_a_time_out_is_retried(tokenizer, servers):
    fake = servers(LLAMACPP)
    b = backend(tokenizer, fake, timeout_s=0.3)
    fake.script, fake.sleep_s = ["sleep"], 1.0
    requests = make_requests(6)
    source = ListSource(requests)
    stats = b.run(source)
    source.assert_each_once({r.key for r in requests})
    assert stats.extra["retried_attempts"] == 1


def test_a_server_killed_mid_run_hands_its_work_to_the_other(tokenizer, servers):
    doomed, spare = servers(OPENAI), servers(OPENAI)
    b = backend(tokenizer, doomed, spare)
    doomed.kill_after = doomed.answered + 3
    requests = make_requests(30)
    source = MultiTurnSource(requests, rounds=2)
    stats = b.run(source)
    source.assert_each_once({f"c{i}#{r}" for i in range(30) for r in range(2)})
    assert doomed.dead
    assert stats.extra[f"answered {doomed.url}"] == 3
    assert stats.extra[f"answered {spare.url}"] == 57
    assert stats.extra["servers_failing_at_end"] == 1


def test_the_only_server_killed_mid_run_is_one_clear_error(tokenizer, servers):
    fake = servers(LLAMACPP)
    b = backend(tokenizer, fake, concurrency=2)
    fake.kill_after = fake.answered + 3
    requests = make_requests(20)
    source = ListSource(requests)
    with pytest.raises(DflashkitError) as e:
        b.run(source)
    msg = one_line_error(e)
    assert fake.url in msg and "failed 4 times" in msg and "is the server running" in msg and "resume" in msg
    assert len(source.completed) == 3  # what the server answered before it died, each once
    source.assert_each_once({r.key for r, _ in source.completed})


def test_persistent_failures_are_one_clear_error(tokenizer, servers):
    for action, words in (("500", "HTTP 500: internal error"), ("garbage", "malformed JSON")):
        fake = servers(OPENAI)
        b = backend(tokenizer, fake, concurrency=1)
        fake.script = [action] * 100
        source = ListSource(make_requests(3))
        with pytest.raises(DflashkitError) as e:
            b.run(source)
        msg = one_line_error(e)
        assert fake.url in msg and words in msg and "failed 4 times" in msg
        assert source.completed == []


def test_a_refused_request_stops_at_once(tokenizer, servers):
    fake = servers(OPENAI)
    b = backend(tokenizer, fake, concurrency=1)
    fake.script = ["ok", "400"]
    source = ListSource(make_requests(3))
    with pytest.raises(DflashkitError) as e:
        b.run(source)
    msg = one_line_error(e)
    assert fake.url in msg and "refused request" in msg and "HTTP 400" in msg and "context" in msg
    assert len(source.completed) == 1 and fake.script == []
    source.assert_each_once({source.completed[0][0].key})


def test_backoff_and_retry_after():
    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("1000000") == 120.0 and retry_after_seconds("soon") is None
    assert retry_after_seconds("Wed, 21 Oct 2015 07:28:00 GMT") == 0.0  # a date in the past
    for attempt in range(5):
        assert 0.5 <= backoff_delay(attempt, 0.5, None) <= 0.5 * 2**attempt
    assert backoff_delay(0, 0.5, 7.0) == 7.0 and backoff_delay(20, 0.5, None) <= 30.0


def test_prepare_through_a_server_resumes_after_it_dies(tokenizer, servers, tmp_path, capsys):
    """`dflashkit prepare --server URL` end to end: the dataset holds the server's token ids; a server
    that dies mid-run ends prepare with one clear error, the replies it gave are kept, and a run
    against a new server generates only what is missing."""
    from dflashkit.cli import main
    from dflashkit.data.dataset import CACHE_FILE, load_dataset

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Question number {i}: what is {i} + {i}?\n" for i in range(12)))
    out = tmp_path / "data"
    argv = [
        "prepare",
        "--out",
        str(out),
        "--source",
        str(prompts),
        "--max-prompts",
        "12",
        "--val-fraction",
        "0",
    ]
    argv += ["--max-new-tokens", "6", "--concurrency", "2", "--server-retries", "1", "--no-progress"]
    dying = servers()
    dying.kill_after = 5
    assert main([*argv, "--server", dying.url]) == 2
    err = capsys.readouterr().err
    assert "resume" in err and len(err.strip().splitlines()) == 1
    lines = [json.loads(x) for x in (out / CACHE_FILE).read_text().splitlines()]
    assert 1 <= len(lines) <= 5 and len({r["id"] for r in lines}) == len(lines)

    fresh = servers()
    assert main([*argv, "--server", fresh.url]) == 0
    assert fresh.answered == 1 + 12 - len(lines)  # its token-id probe, then only the missing records
    assert len(load_dataset(out, "train")) == 12
    cached = [json.loads(x) for x in (out / CACHE_FILE).read_text().splitlines()]
    assert len(cached) == 12 and len({r["id"] for r in cached}) == 12  # nothing lost, nothing twice
    for rec in cached:  # each reply is the server's token ids for the prompt rendered here
        prompt = generation_prompt_ids(tokenizer, rec["messages"][:-1], enable_thinking=False)
        assert rec["reply_ids"] == [cut_reply(fake_reply(prompt), [EOS], 6).ids]
