"""The compile runtime: warm-up then no compiles, threads that never see a dense path, the FX-flag
race, recompile-limit exhaustion, shape buckets, the dense pre-flight and the portable compile cache.

One compile (the doctor's shape, shared with test_backends and the doctor checks) warms the module."""

import dataclasses
import json
import threading
import time

import pytest
import torch
import torch.fx._symbolic_trace as fx_st
import torch.nn.attention.flex_attention as fa_mod
from torch._dynamo.utils import counters

from dflashkit.attention import flex
from dflashkit.attention.backends import attention, build_mask
from dflashkit.attention.block_mask import flex_block_mask
from dflashkit.attention.buckets import (
    ShapeBucketError,
    bucket_layout,
    pad_keys,
    pad_layout,
    pad_to,
    pick_bucket,
)
from dflashkit.attention.checks import DOCTOR_SHAPE
from dflashkit.attention.dense_budget import (
    DEFAULT_DENSE_BUDGET_GIB,
    DENSE_BUDGET_ENV,
    DenseBudgetError,
    dense_budget_gib,
    preflight_dense,
)
from dflashkit.attention.flex import (
    ConcurrentTraceError,
    DenseFallbackError,
    _run,
    compiled_graphs,
    entry_state,
    flex_attention_entry,
    reset_recompile_limit,
    shape_key,
)
from dflashkit.attention.masks import BlockLayout, dense_mask
from dflashkit.attention.warm_up import example_inputs, example_layout, warm_up
from dflashkit.errors import DflashkitError
from dflashkit.runtime.compile import (
    CompileAfterWarmupError,
    frozen_compiles,
    is_frozen,
    recompile_limit_reaches_threads,
)
from dflashkit.runtime.compile_cache import (
    CompileCacheError,
    load_compile_cache,
    portable_cache,
    read_compile_cache,
    save_compile_cache,
)
from dflashkit.runtime.compiled_region import CompiledRegion

SHAPE = DOCTOR_SHAPE  # batch 1, 4/2 heads, head_dim 16, context 3072, 64 anchors, B 16, fp32


@pytest.fixture(scope="module")
def warm():
    records = warm_up([SHAPE], ["cpu"], slack=0)
    yield records
    reset_recompile_limit()  # slack 0 is this module's: later modules compile shapes of their own


@pytest.fixture
def frozen(warm):
    """Each test runs with compiles frozen, after the warm-up."""
    with frozen_compiles():
        yield


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def in_thread(fn):
    """Run fn in a new thread; return its result or the exception it raised."""
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as e:  # handed back to the test
            box["value"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join(120)
    return box["value"]


def step(seed: int) -> torch.Tensor:
    layout = example_layout(SHAPE, seed=seed)
    q, k, v = example_inputs(SHAPE, seed=seed)
    return flex_attention_entry(q, k, v, flex_block_mask(layout))


def test_warmup_compiles_each_shape_once_and_sizes_the_limit(warm):
    assert [(r.device, r.shape, r.backward) for r in warm] == [("cpu", SHAPE, False)]  # no CPU backward
    state = entry_state()
    assert not state["frozen"] and state["compiled_graphs"] >= 1  # the caller freezes: frozen_compiles()
    if recompile_limit_reaches_threads():  # else torch's process-wide limit (never lowered) applies
        assert state["recompile_limit"] == state["compiled_graphs"]  # slack 0: no room for another


def test_warm_steps_with_new_anchors_do_not_compile(frozen):
    graphs = counters["stats"]["unique_graphs"]
    layout = example_layout(SHAPE, seed=42)
    layout.block_valid[0, -3:] = False
    q, k, v = example_inputs(SHAPE, seed=42)
    out = flex_attention_entry(q, k, v, flex_block_mask(layout))
    ref = attention(q, k, v, build_mask(layout, "eager"), backend="eager")
    assert rel_err(out, ref) < 1e-5
    for seed in range(3):
        step(seed)
    assert counters["stats"]["unique_graphs"] == graphs


def test_unwarmed_shape_raises_naming_device_and_shape(frozen):
    q, k, v = example_inputs(SHAPE)
    with pytest.raises(CompileAfterWarmupError, match=r"device cpu, float32, q \[1, 2, 1024, 16\]"):
        flex_attention_entry(q[:, :2], k, v, flex_block_mask(example_layout(SHAPE)))


def test_torch_recompile_error_after_warmup_becomes_ours(frozen):
    """Past our own shape check (here: called directly), torch's fail_on_recompile stance fires; we
    re-raise it as CompileAfterWarmupError."""
    q, k, v = example_inputs(SHAPE)
    q = q[:, :2]
    bm = flex_block_mask(example_layout(SHAPE))
    key = shape_key(q, k, v, bm, 0.25)
    with pytest.raises(CompileAfterWarmupError, match="would compile after warm-up"):
        _run(q, k, v, bm, 0.25, key)


def test_import_after_warmup_that_changes_guards_fails_loudly(frozen):
    """Registering a pytree node (importing transformers does) changes a global Dynamo guards on: a warm
    shape would recompile. After warm-up that is a clear error naming the guard, not a silent compile."""
    import torch.utils._pytree as pytree

    class Late:
        pass

    pytree.register_pytree_node(Late, lambda x: ([], None), lambda xs, ctx: Late())
    try:
        with pytest.raises(
            CompileAfterWarmupError, match="guard failed: .*SUPPORTED_NODES.*after all imports"
        ):
            step(0)
    finally:
        pytree._deregister_pytree_node(Late)
    assert torch.isfinite(step(0)).all()  # the guard holds again


def test_shape_buckets_pad_into_a_warmed_bucket(frozen):
    g = torch.Generator().manual_seed(9)
    S, N, Bs = 2500, 50, SHAPE.block_size
    docs = torch.zeros(1, S, dtype=torch.long)
    docs[0, 1200:] = 1
    raw = BlockLayout(
        torch.randint(0, S - Bs, (1, N), generator=g).sort(dim=1).values,
        torch.ones(1, N, dtype=torch.bool),
        docs,
        Bs,
    )
    buckets = dict(context_buckets=(1024, 3072), anchor_buckets=(32, 64))
    padded = bucket_layout(raw, **buckets)
    assert (padded.context_len, padded.num_blocks) == (3072, 64)
    # Padding changes no visibility of the real rows, and the padded keys and rows see nothing.
    m_raw, m_pad = dense_mask(raw)[0, 0], dense_mask(padded)[0, 0]
    Q = raw.q_len
    assert torch.equal(m_pad[:Q, :S], m_raw[:, :S])
    assert torch.equal(m_pad[:Q, 3072 : 3072 + Q], m_raw[:, S:])
    assert not m_pad[:, S:3072].any() and not m_pad[Q:].any()

    q = torch.randn(1, SHAPE.q_heads, Q, SHAPE.head_dim, generator=g)
    k = torch.randn(1, SHAPE.kv_heads, S + Q, SHAPE.head_dim, generator=g)
    v = torch.randn(1, SHAPE.kv_heads, S + Q, SHAPE.head_dim, generator=g)
    qp = pad_to(q, 2, padded.q_len)
    kp, vp = (pad_keys(x, S, padded.context_len, padded.q_len) for x in (k, v))
    out = flex_attention_entry(qp, kp, vp, flex_block_mask(padded))[:, :, :Q]
    ref = attention(q, k, v, build_mask(raw, "eager"), backend="eager")
    assert rel_err(out, ref) < 1e-5
    with pytest.raises(ShapeBucketError, match="context length 3500 is larger than the largest bucket"):
        bucket_layout(pad_layout(raw, 3500, N), **buckets)


def test_bucket_helpers():
    assert pick_bucket(1, (512, 256)) == 256 and pick_bucket(257, (512, 256)) == 512
    with pytest.raises(ShapeBucketError):
        pick_bucket(513, (512, 256), "anchor count")
    x = torch.arange(6).view(1, 6)
    assert pad_to(x, 1, 8, -1).tolist() == [[0, 1, 2, 3, 4, 5, -1, -1]]
    assert pad_keys(x, 2, 4, 6, dim=1).tolist() == [[0, 1, 0, 0, 2, 3, 4, 5, 0, 0]]


def test_concurrent_threads_step_while_new_shapes_appear(frozen):
    """Four threads step warm attention (fresh anchors each step, raw lengths padded into the warm bucket)
    while a fifth brings new shapes and a sixth keeps grabbing the FX-tracing flag, as a concurrent
    compile or export would: zero errors, zero compiles, every new shape either runs in a warmed bucket
    or fails loudly."""
    graphs, compiled_before = counters["stats"]["unique_graphs"], entry_state()["compiled_shapes"]
    waits = entry_state()["fx_waits"]
    buckets = dict(context_buckets=(SHAPE.context_len,), anchor_buckets=(SHAPE.num_blocks,))
    errors, outcomes, steps = [], [], [0] * 4
    stop = threading.Event()

    def stepper(i):
        g = torch.Generator().manual_seed(i)
        try:
            while not stop.is_set() or steps[i] < 5:
                S = int(torch.randint(2049, SHAPE.context_len + 1, (1,), generator=g))
                N = int(torch.randint(33, SHAPE.num_blocks + 1, (1,), generator=g))
                raw = BlockLayout(
                    torch.randint(0, S - 16, (1, N), generator=g).sort(dim=1).values,
                    torch.ones(1, N, dtype=torch.bool),
                    torch.zeros(1, S, dtype=torch.long),
                    16,
                )
                lay = bucket_layout(raw, **buckets)
                q, k, v = example_inputs(SHAPE, seed=i)
                out = flex_attention_entry(q, k, v, flex_block_mask(lay))
                if not torch.isfinite(out).all():
                    errors.append(f"thread {i}: non-finite")
                steps[i] += 1
        except Exception as e:
            errors.append(f"thread {i}: {type(e).__name__}: {e}")

    def new_shapes():
        q, k, v = example_inputs(SHAPE)
        trials = [
            ("bucketed", lambda: bucket_layout(example_layout(SHAPE), **buckets)),
            (
                "too long",
                lambda: pad_layout(example_layout(SHAPE), SHAPE.context_len + 128, SHAPE.num_blocks),
            ),
        ]
        for name, make in trials:
            try:
                flex_attention_entry(q, k, v, flex_block_mask(bucket_layout(make(), **buckets)))
                outcomes.append((name, "ran"))
            except DflashkitError as e:
                outcomes.append((name, type(e).__name__))
        try:  # a shape nobody warmed (other head count)
            flex_attention_entry(q[:, :1], k[:, :1], v[:, :1], flex_block_mask(example_layout(SHAPE)))
            outcomes.append(("unwarmed heads", "ran"))
        except DflashkitError as e:
            outcomes.append(("unwarmed heads", type(e).__name__))

    def flag_grabber():
        while not stop.is_set():
            old = fx_st._is_fx_tracing_flag
            fx_st._is_fx_tracing_flag = True  # what make_fx does in a concurrent compile
            time.sleep(0.02)
            fx_st._is_fx_tracing_flag = old
            time.sleep(0.01)

    threads = [threading.Thread(target=stepper, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=new_shapes), threading.Thread(target=flag_grabber)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join(60)
    assert not fx_st._is_fx_tracing_flag
    assert errors == []
    assert min(steps) >= 5
    assert entry_state()["fx_waits"] > waits  # the flag was met, waited out, and the call ran compiled
    assert outcomes == [
        ("bucketed", "ran"),
        ("too long", "ShapeBucketError"),
        ("unwarmed heads", "CompileAfterWarmupError"),
    ]
    assert counters["stats"]["unique_graphs"] == graphs
    assert entry_state()["compiled_shapes"] == compiled_before


def test_fx_flag_held_by_another_thread_then_released_runs_compiled(frozen):
    """The threaded compile race's error (another thread inside make_fx): our entry waits for the flag and then runs the
    compiled kernel; the sentinel proves it was not the dense path."""
    waits = entry_state()["fx_waits"]
    fx_st._is_fx_tracing_flag = True
    try:
        t = threading.Timer(0.3, lambda: setattr(fx_st, "_is_fx_tracing_flag", False))
        t.start()
        t0 = time.monotonic()
        out = in_thread(lambda: step(1))
        t.join()
    finally:
        fx_st._is_fx_tracing_flag = False
    assert isinstance(out, torch.Tensor), out
    assert time.monotonic() - t0 >= 0.25
    assert entry_state()["fx_waits"] == waits + 1
    assert rel_err(out, step(1)) == 0


def test_fx_flag_held_too_long_raises_a_clear_error(frozen, monkeypatch):
    monkeypatch.setattr(flex, "FX_WAIT_S", 0.2)
    fx_st._is_fx_tracing_flag = True
    try:
        err = in_thread(lambda: step(2))
    finally:
        fx_st._is_fx_tracing_flag = False
    assert isinstance(err, ConcurrentTraceError), err
    assert "FX-tracing flag" in str(err) and "\n" not in str(err)


def test_silent_fallback_settings_never_run_dense(frozen):
    """error_on_nested_fx_trace=False (per thread in torch >= 2.12) makes torch call the uncompiled
    function while the FX flag is held; suppress_errors-like stances do the same. The sentinel raises."""
    shown = set(fa_mod._WARNINGS_SHOWN)

    def with_silent_setting():
        with torch._dynamo.config.patch(error_on_nested_fx_trace=False):
            return step(3)

    fx_st._is_fx_tracing_flag = True
    try:
        err = in_thread(with_silent_setting)
    finally:
        fx_st._is_fx_tracing_flag = False
    assert isinstance(err, DenseFallbackError), err
    assert "outside torch.compile" in str(err)

    with torch.compiler.set_stance("force_eager"), pytest.raises(DenseFallbackError):
        step(4)
    assert set(fa_mod._WARNINGS_SHOWN) == shown  # flex's dense-path warning never fired


def test_recompile_limit_exhaustion_is_detected_in_any_thread(warm):
    """Warm-up sized the limit to exactly the compiled shapes (slack 0). Unfrozen, a new shape would
    make torch run the dense path; in a worker thread (whose module-level config is the default 8)
    it raises instead, without compiling."""
    if not recompile_limit_reaches_threads():
        pytest.skip("this torch has no torch.compile(recompile_limit=): the limit is process-wide config")
    assert entry_state()["recompile_limit"] == compiled_graphs()
    assert not is_frozen()
    q, k, v = example_inputs(SHAPE)
    t0 = time.monotonic()
    err = in_thread(
        lambda: flex_attention_entry(q[:, :1], k[:, :1], v[:, :1], flex_block_mask(example_layout(SHAPE)))
    )
    assert isinstance(err, DenseFallbackError), err
    assert "recompile limit (" in str(err) and time.monotonic() - t0 < 5
    assert compiled_graphs() == entry_state()["recompile_limit"]


def test_preflight_budget_from_argument_and_environment(monkeypatch):
    monkeypatch.delenv(DENSE_BUDGET_ENV, raising=False)
    assert dense_budget_gib() == DEFAULT_DENSE_BUDGET_GIB
    assert preflight_dense(1, 1, 1024, 1024, what="x") == 4 * 2**20
    # A long context: one 16-head layer at 16k is 16 GiB of fp32 scores per copy (a dense fall-back's OOM).
    with pytest.raises(DenseBudgetError, match=r"1x16x16384x16384 score matrix \(16.0 GiB > budget 4 GiB\)"):
        preflight_dense(1, 16, 16384, 16384, what="sdpa attention")
    assert preflight_dense(1, 16, 16384, 16384, what="x", budget_gib=20) == 16 * 2**30
    monkeypatch.setenv(DENSE_BUDGET_ENV, "0.001")
    with pytest.raises(DenseBudgetError):
        preflight_dense(1, 1, 1024, 1024, what="x")
    monkeypatch.setenv(DENSE_BUDGET_ENV, "lots")
    with pytest.raises(DflashkitError, match="is not a number of GiB"):
        dense_budget_gib()


def test_portable_compile_cache_round_trip_and_refusal(warm, tmp_path):
    path = save_compile_cache(tmp_path / "flex.cache")
    info = load_compile_cache(path)
    assert sum(len(v) for v in info.artifacts.values()) > 0

    header, data = read_compile_cache(path)
    assert header["key"]["torch.git_version"] == torch.version.git_version
    other = dict(header, key=dict(header["key"], **{"torch.git_version": "70d99e99" + "0" * 32}))
    foreign = tmp_path / "foreign.cache"
    foreign.write_bytes(json.dumps(other).encode() + b"\n" + data)
    with pytest.raises(CompileCacheError, match="another environment .*torch.git_version"):
        load_compile_cache(foreign)

    (tmp_path / "junk.cache").write_bytes(b"not a cache")
    with pytest.raises(CompileCacheError, match="not a dflashkit compile cache"):
        load_compile_cache(tmp_path / "junk.cache")
    (tmp_path / "short.cache").write_bytes(path.read_bytes()[:-10])
    with pytest.raises(CompileCacheError, match="truncated"):
        load_compile_cache(tmp_path / "short.cache")


def test_portable_cache_around_warmup_writes_loads_and_replaces_a_stale_file(warm, tmp_path):
    """run.compile_cache: written after a warm-up when missing, loaded when it fits, replaced when stale."""
    said: list[str] = []

    class Console:
        def print(self, text: str) -> None:
            said.append(text)

    path = tmp_path / "run.cache"
    with portable_cache(path, Console()):
        pass  # the `warm` fixture compiled already: its artifacts are this process's
    assert path.is_file() and "written" in said[-1]
    with portable_cache(path, Console()):
        pass
    assert "loaded" in said[-1]
    header, data = read_compile_cache(path)
    stale = dict(header, key=dict(header["key"], **{"packages.triton": "0.0.0"}))
    path.write_bytes(json.dumps(stale).encode() + b"\n" + data)
    with portable_cache(path, Console()):
        pass
    assert any("not used" in s and "packages.triton" in s for s in said) and "written" in said[-1]
    assert read_compile_cache(path)[0]["key"] == header["key"]
    with portable_cache(None, Console()):  # no file configured: nothing happens
        pass


def test_portable_cache_problems_are_reported_not_fatal(warm, tmp_path):
    said: list[str] = []

    class Console:
        def print(self, text: str) -> None:
            said.append(text)

    folder = tmp_path / "a-folder"  # a path that cannot be read or written as a file
    folder.mkdir()
    with portable_cache(folder, Console()):
        pass
    assert "not written" in said[-1]
    junk = tmp_path / "junk.cache"
    junk.write_bytes(b"not a cache")
    with portable_cache(junk, Console(), save=False):
        pass
    assert any("not used" in s for s in said) and not any("written to" in s for s in said)


def _breaks_the_graph(x):
    torch._dynamo.graph_break()
    return x + 1


def _doubles(x):
    return x * 2


def test_compiled_region_errors_are_one_clear_line():
    with pytest.raises(DflashkitError, match="failed to compile .*train.compile=off"):
        CompiledRegion(_breaks_the_graph, "a region")(torch.ones(3))
    region = CompiledRegion(_doubles, "the doubling region")
    assert torch.equal(region(torch.ones(4)), torch.full((4,), 2.0))
    with frozen_compiles():
        assert torch.equal(region(torch.ones(4)), torch.full((4,), 2.0))  # warm: runs
        with pytest.raises(CompileAfterWarmupError, match=r"the doubling region .*\[5\]"):
            region(torch.ones(5))
    assert region.graphs() == 1
    assert torch.equal(region(torch.ones(5)), torch.full((5,), 2.0))  # the block ended: it compiles


def test_frozen_compiles_is_scoped_nests_and_restores_the_stance():
    """The freeze holds inside the block (nested blocks, other threads alike) and ends with the
    outermost block, even one that raised: torch's stance is what it was before."""
    from torch._dynamo import eval_frame

    before = eval_frame._stance.stance
    assert not is_frozen()
    with pytest.raises(KeyError), frozen_compiles():
        assert is_frozen() and eval_frame._stance.stance == "fail_on_recompile"
        with frozen_compiles():
            assert in_thread(is_frozen) is True
        assert is_frozen() and eval_frame._stance.stance == "fail_on_recompile"
        raise KeyError("a failing run")
    assert not is_frozen() and eval_frame._stance.stance == before
    with frozen_compiles(), pytest.raises(CompileAfterWarmupError, match="inside a frozen_compiles"):
        warm_up([SHAPE], ["cpu"])  # never a silent unfreeze under running threads


def test_a_new_shape_warms_up_after_the_frozen_block_ends(warm):
    """What a second training run in one process meets: the first froze compiles for its shapes; once its
    block has ended, warming a new shape compiles it (a freeze that outlived its run made this raise), and
    the next block runs it."""
    small = dataclasses.replace(SHAPE, q_heads=2, kv_heads=1)
    with frozen_compiles():
        step(0)  # the first run
    warm_up([small], ["cpu"])
    with frozen_compiles():
        q, k, v = example_inputs(small)
        out = flex_attention_entry(q, k, v, flex_block_mask(example_layout(small)))
        assert torch.isfinite(out).all()
    reset_recompile_limit()


def test_a_region_that_fails_to_compile_names_its_off_switch():
    step = CompiledRegion(_breaks_the_graph, "a loss chunk", off_switch="train.compile=off")
    with pytest.raises(
        DflashkitError, match=r"a loss chunk failed to compile .*turn compiling off \(train.compile=off\)"
    ):
        step(torch.ones(3))
