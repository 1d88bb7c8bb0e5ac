"""Precompiled steps (`dflashkit.runtime.precompiled`): their files, their fall-backs, and the graphs
engine's use of them, without compiling (the compiling test is in test_graph_engine.py)."""

from __future__ import annotations

import json

import pytest
import torch

import test_engine
from dflashkit.infer import graph_engine
from dflashkit.infer.graph_engine import GraphEngine
from dflashkit.infer.speculative import speculative_generate
from dflashkit.runtime import precompiled
from dflashkit.runtime.compile import CompileAfterWarmupError
from dflashkit.runtime.compile_cache import CompileCacheError, write_keyed
from dflashkit.runtime.precompiled import Precompiled, compile_step, guarded, load_step, step_path
from test_engine import B, prompts

target, drafter = test_engine.target, test_engine.drafter  # the module-scoped fixtures


def test_a_step_file_sits_beside_its_compile_cache(tmp_path):
    assert step_path(tmp_path / "graphs-0123.cache", "target-8") == tmp_path / "graphs-0123.target-8.step"


def test_a_step_file_of_another_kind_environment_or_length_is_refused_in_one_line(tmp_path, monkeypatch):
    path = tmp_path / "x.target-1.step"
    write_keyed(path, "something-else", b"payload")
    with pytest.raises(CompileCacheError, match="is not a dflashkit precompiled step"):
        load_step(path, precompiled._probe, ())
    write_keyed(path, precompiled.STEP_FORMAT, b"payload")
    path.write_bytes(path.read_bytes()[:-3])
    with pytest.raises(CompileCacheError, match="is truncated"):
        load_step(path, precompiled._probe, ())
    write_keyed(path, precompiled.STEP_FORMAT, b"payload")
    header, _, data = path.read_bytes().partition(b"\n")
    other = json.loads(header)
    other["key"]["torch.version"] = "0.0.0"
    path.write_bytes(json.dumps(other).encode() + b"\n" + data)
    with pytest.raises(CompileCacheError, match="built by another environment"):
        load_step(path, precompiled._probe, ())


def test_compile_step_never_raises_and_says_why(tmp_path, monkeypatch):
    path = tmp_path / "x.draft-4.step"
    monkeypatch.setattr(precompiled, "available", lambda: False)
    out = compile_step(path, precompiled._probe, (torch.zeros(2),))
    assert out.fn is None and "cannot precompile steps" in out.note
    monkeypatch.setattr(precompiled, "available", lambda: True)

    def fails(*args):
        raise NotImplementedError("no serializer for this backend")

    monkeypatch.setattr(precompiled, "build_step", fails)
    path.write_bytes(b"not a step file\n")  # unreadable: loading fails, then building fails: both said
    out = compile_step(path, precompiled._probe, (torch.zeros(2),))
    assert out.fn is None and not out.loaded and not out.built
    assert "not precompiled (NotImplementedError: no serializer for this backend)" in out.note


def test_a_guard_failure_of_a_precompiled_step_is_a_compile_after_warmup_error():
    def refuses(*args):
        raise RuntimeError("GuardManager check failed, reason: kv_len == 64\nmore")

    step = guarded(refuses, "the graphs engine's target step", "GraphEngine.warm_up()")
    with pytest.raises(
        CompileAfterWarmupError, match=r"target step would compile after warm-up .*kv_len == 64"
    ):
        step(torch.zeros(1))

    def other(*args):
        raise RuntimeError("CUDA out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        guarded(other, "x", "y")()


def test_the_graphs_engine_runs_its_precompiled_steps(target, drafter, tmp_path, monkeypatch):
    """With a compile cache the compiled engine asks for a precompiled target step per shape and a draft
    step, and runs them in place of the compiled regions (here: the eager steps, recorded, standing in for
    what torch would precompile); without one, or with precompile=False, it asks nothing."""
    asked: list[str] = []
    ran: list[str] = []

    def fake_compile_step(path, fn, args):
        asked.append(path.name.split(".")[-2])
        label = path.name.split(".")[-2]

        def step(*a):
            ran.append(label)
            return fn(*a)

        return Precompiled(fn=step, loaded=True)

    monkeypatch.setattr(graph_engine, "compile_step", fake_compile_step)
    cache = tmp_path / "graphs-x.cache"
    engine = GraphEngine(target, drafter, capacity=48, graphs=False, compile=True, compile_cache=cache)
    warmed = engine.warm_up()
    assert sorted(asked) == sorted(["target-1", f"target-{B}", f"draft-{B}"])
    assert warmed.precompiled_loaded == 3 and warmed.precompiled_built == 0 and warmed.compiled == 0
    assert warmed.cache_warm  # nothing compiled, everything from files
    ran.clear()
    out = speculative_generate(target, drafter, prompts(7)[0], 12, engine=engine)
    assert f"target-{B}" in ran and f"draft-{B}" in ran and len(out.tokens) == 12
    asked.clear()
    GraphEngine(
        target, drafter, capacity=48, graphs=False, compile=True, precompile=False, compile_cache=cache
    )
    assert not GraphEngine(target, drafter, capacity=48, graphs=False, compile=True).precompile
    assert asked == []


def test_a_step_file_torch_cannot_load_or_check_is_refused_in_one_line(tmp_path, monkeypatch):
    """A payload torch fails on (to read, or to check its guards) is a CompileCacheError: compile_step then
    precompiles the step again instead of ending the warm-up in a traceback."""
    path = tmp_path / "x.target-1.step"
    write_keyed(path, precompiled.STEP_FORMAT, b"payload")

    class Unchecked:
        def guard_check(self, *args):
            raise TypeError("guards of another torch")

    def unreadable(*args, **kwargs):
        raise ValueError("bad pickle")

    for loader in (unreadable, lambda *args, **kwargs: Unchecked()):
        monkeypatch.setattr(torch.compiler, "load_compiled_function", loader)
        with pytest.raises(CompileCacheError, match="could not be loaded by torch"):
            load_step(path, precompiled._probe, ())
