"""`dflashkit prepare` on the embedded target with tiny settings: the folder it writes, an interrupted
run resumed to exactly the records of an uninterrupted one, a torn cache line recovered, and greedy
regeneration (both backends) equal to transformers' own greedy decoding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from dflashkit.cli import main
from dflashkit.data.chat import encode_chat, generation_prompt_ids, template_identity
from dflashkit.data.dataset import (
    CACHE_FILE,
    PrepareSettings,
    check_dataset_folder,
    load_dataset,
    prepare_dataset,
    read_manifest,
)
from dflashkit.data.generation import ListSource, Request
from dflashkit.data.generator import SlotGenerator, SlotSettings
from dflashkit.data.hf_generate import generate_replies
from dflashkit.data.regenerate import eos_token_ids, load_target, read_cache
from dflashkit.errors import ConfigError, DataError
from dflashkit.integrity import file_digest
from dflashkit.target.hf import identity_of_folder

PROMPTS = [
    "What is the capital of France?",
    "Name three colours.",
    "Say hello in Spanish.",
    "What is 2 + 2?",
    "Write one word about the sea.",
    "Who wrote Hamlet?",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Any:
    """One intra-op thread: on a shared 2-core machine, two OpenMP threads competing with other
    processes made each decode step ~20x slower (measured 3.8 s vs 0.16 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("src") / "prompts.txt"
    path.write_text("\n".join(PROMPTS) + "\n")
    return path


def settings(out: Path, source: Path, **kw: Any) -> PrepareSettings:
    base: dict[str, Any] = {
        "out": out,
        "source": str(source),
        "max_prompts": 6,
        "max_new_tokens": 8,
        "batch_size": 3,
        "val_fraction": 0.34,
    }
    return PrepareSettings(**{**base, **kw})


def records(folder: Path) -> dict[str, list[tuple[str, list[int], list[bool]]]]:
    return {
        split: [(r.id, r.input_ids.tolist(), r.loss_mask.tolist()) for r in load_dataset(folder, split)]
        for split in ("train", "validation")
    }


def cache_lines(folder: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (folder / CACHE_FILE).read_text().splitlines()]


@pytest.fixture(scope="module")
def full_run(tmp_path_factory: pytest.TempPathFactory, prompts_file: Path) -> tuple[Path, dict[str, Any]]:
    out = tmp_path_factory.mktemp("full") / "data"
    return out, prepare_dataset(settings(out, prompts_file), progress=False)


@pytest.fixture(scope="module")
def target() -> tuple[Any, Any]:
    return load_target("embedded", dtype="float32")


def test_prepare_writes_manifest_and_records(full_run: tuple[Path, dict[str, Any]]) -> None:
    out, manifest = full_run
    assert read_manifest(out) == manifest
    assert manifest["target"] == identity_of_folder("embedded")  # what training checks data against
    assert manifest["template"]["enable_thinking"] is False
    assert manifest["settings"]["max_new_tokens"] == 8
    counts = manifest["counts"]
    assert (
        counts["prompts"] == 6
        and counts["records"] == 6
        and counts["generated"] == 6
        and counts["cached"] == 0
    )
    assert counts["skipped"] == 0
    assert manifest["splits"]["train"]["records"] == 4 and manifest["splits"]["validation"]["records"] == 2
    assert manifest["generation"]["new_tokens"] == counts["new_tokens"] > 0
    assert manifest["generation"]["new_tokens_per_second"] > 0
    stages = manifest["stage_seconds"]  # where the command's time went, stage by stage
    assert list(stages) == [
        "read_sources",
        "load_target",
        "start_generator",
        "generate",
        "generate.resume",  # generate's parts: the cache read and checked,
        "generate.first_round",  # every record's first prompt rendered and queued,
        "generate.backend",  # the generator's own run,
        "generate.flush",  # the last records written
        "read_cache",
        "encode_records",
        "write_splits",
    ]
    assert all(v >= 0 for v in stages.values()) and stages["generate"] >= manifest["generation"]["seconds"]
    parts = [v for k, v in stages.items() if k.startswith("generate.")]
    assert stages["generate.backend"] >= manifest["generation"]["seconds"] - 0.002  # (rounding)
    assert abs(sum(parts) - stages["generate"]) < 0.01
    # 6 records: too few for the tokenizer's worker processes, everything ran in-process
    assert manifest["tokenizer_pool"] == {"workers": 0, "ready_seconds": None, "wait_seconds": 0.0}
    assert (out / "fingerprint.json").is_file()

    train, val = load_dataset(out, "train"), load_dataset(out, "validation")
    assert not {r.id for r in train} & {r.id for r in val}
    assert sum(int(r.input_ids.numel()) for r in train) == manifest["splits"]["train"]["tokens"]
    cache = {rec["id"]: rec for rec in cache_lines(out)}
    assert len(cache) == 6
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(manifest["target"]["path"])
    for r in train + val:
        assert r.input_ids.dtype == torch.long and r.loss_mask.dtype == torch.bool
        assert r.input_ids.shape == r.loss_mask.shape
        rec = cache[r.id]
        # The supervised tokens are the target's reply, token for token (and its EOS when it stopped).
        reply_ids = rec["reply_ids"][0]
        assert r.input_ids[r.loss_mask].tolist() == reply_ids
        text = rec["messages"][-1]["content"] + (tok.eos_token if rec["finished"][0] else "")
        assert tok.decode(r.input_ids[r.loss_mask].tolist(), skip_special_tokens=False) == text
        # ...and follow the exact prompt the target was given.
        prompt = generation_prompt_ids(tok, rec["messages"][:-1], enable_thinking=False)
        assert r.input_ids[: len(prompt) + len(reply_ids)].tolist() == prompt + reply_ids


def test_tokenizer_workers_started_early_give_the_same_dataset(
    tmp_path: Path,
    prompts_file: Path,
    full_run: tuple[Path, dict[str, Any]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the tokenizer's worker processes (started while the target loads) rendering the prompts and
    encoding the records, the cache and the splits are those of the in-process run."""
    import functools

    from dflashkit.data import dataset
    from dflashkit.data.parallel import TokenizerPool

    monkeypatch.setattr(dataset, "TokenizerPool", functools.partial(TokenizerPool, workers=2, min_items=1))
    out = tmp_path / "data"
    manifest = prepare_dataset(settings(out, prompts_file), progress=False)
    assert manifest["tokenizer_pool"]["workers"] == 2
    assert manifest["tokenizer_pool"]["ready_seconds"] > 0
    assert cache_lines(out) == cache_lines(full_run[0])
    assert records(out) == records(full_run[0])


def test_interrupted_prepare_resumes_to_the_same_records(
    tmp_path: Path, prompts_file: Path, full_run: tuple[Path, dict[str, Any]]
) -> None:
    flushed: list[int] = []

    def stop_after_first(done: int, total: int) -> None:
        assert total == 6
        flushed.append(done)
        raise KeyboardInterrupt

    out = tmp_path / "data"
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset(
            settings(out, prompts_file), on_flush=stop_after_first, progress=False, flush_records=2
        )
    on_disk = len(cache_lines(out))
    assert flushed and 1 <= flushed[0] <= on_disk < 6  # what was flushed is on disk, the rest is not
    with pytest.raises(DataError, match="no finished dataset.*resume it"):
        read_manifest(out)

    seen: list[tuple[int, int]] = []
    manifest = prepare_dataset(
        settings(out, prompts_file), on_flush=lambda d, t: seen.append((d, t)), progress=False
    )
    assert seen[-1] == (6, 6) and seen[0][0] > on_disk  # only the missing records were generated
    assert manifest["counts"]["cached"] == on_disk and manifest["counts"]["generated"] == 6 - on_disk
    full_out, _ = full_run
    assert records(out) == records(full_out)
    by_id = {r["id"]: r for r in cache_lines(full_out)}
    lines = cache_lines(out)
    assert len(lines) == 6 and {r["id"]: r for r in lines} == by_id  # nothing lost, nothing duplicated


def test_torn_last_line_is_dropped_and_regenerated(
    tmp_path: Path, prompts_file: Path, full_run: tuple[Path, dict[str, Any]]
) -> None:
    full_out, _ = full_run
    out = tmp_path / "data"
    out.mkdir()
    for name in (CACHE_FILE, "generation.json"):
        shutil.copy(full_out / name, out / name)
    raw = (out / CACHE_FILE).read_bytes()
    last_start = raw.rstrip(b"\n").rfind(b"\n") + 1
    (out / CACHE_FILE).write_bytes(raw[: last_start + (len(raw) - last_start) // 2])  # a write cut mid-line

    manifest = prepare_dataset(settings(out, prompts_file), progress=False)
    counts = manifest["counts"]
    assert counts["torn_lines"] == 1 and counts["cached"] == 5 and counts["generated"] == 1
    assert records(out) == records(full_out)
    assert cache_lines(out) == cache_lines(full_out)


def test_corrupt_line_inside_the_cache_is_an_error(tmp_path: Path) -> None:
    cache = tmp_path / CACHE_FILE
    cache.write_text('{"id": "a"}\n{"id": "b", "mess\n{"id": "c"}\n')
    with pytest.raises(DataError, match=rf"{CACHE_FILE}:2: corrupt line"):
        read_cache(cache)
    cache.write_text('{"id": "a"}\n{"id": "b", "mess\n\x00\x00')  # a torn tail may span lines
    found, torn = read_cache(cache)
    assert list(found) == ["a"] and torn == 2
    assert cache.read_text() == '{"id": "a"}\n'


def test_resume_with_other_generation_settings_is_refused(
    tmp_path: Path, prompts_file: Path, full_run: tuple[Path, dict[str, Any]]
) -> None:
    full_out, _ = full_run
    out = tmp_path / "data"
    shutil.copytree(full_out, out)
    (out / "manifest.json").unlink()  # an unfinished dataset: its cache resumes
    with pytest.raises(ConfigError, match=r"generation\.max_new_tokens: 8 vs 9.*another --out"):
        prepare_dataset(settings(out, prompts_file, max_new_tokens=9), progress=False)
    with pytest.raises(ConfigError, match=r"template\.enable_thinking: False vs True"):
        prepare_dataset(settings(out, prompts_file, enable_thinking=True), progress=False)


def test_a_finished_dataset_is_not_re_split_in_place(
    tmp_path: Path,
    prompts_file: Path,
    full_run: tuple[Path, dict[str, Any]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    full_out, manifest = full_run
    for split in ("train", "validation"):  # each split's identity, what a run records and checks on resume
        assert manifest["splits"][split]["sha256"] == file_digest(full_out / f"{split}.safetensors")
    out = tmp_path / "data"
    shutil.copytree(full_out, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    argv = ["prepare", "--out", str(out), "--source", str(prompts_file), "--max-prompts", "6"]
    argv += ["--max-new-tokens", "8", "--batch-size", "3", "--val-fraction", "0.5", "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert "val_fraction 0.34 -> 0.5" in err and "--out" in err and "--replace" in err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    check_dataset_folder(settings(out, prompts_file, batch_size=6))  # speed only: the same dataset
    check_dataset_folder(settings(out, prompts_file, val_fraction=0.5), replace=True)  # told to


def test_prepare_never_writes_into_a_training_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    (run / "fingerprint.json").write_text('{"the run": "s"}')
    assert main(["prepare", "--out", str(run), "--max-prompts", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "a training run's folder" in err and "another --out" in err
    assert (run / "fingerprint.json").read_text() == '{"the run": "s"}'
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "fingerprint.json", "metrics.jsonl"]


def test_greedy_regeneration_equals_transformers_generate(target: tuple[Any, Any]) -> None:
    model, tok = target
    eos = eos_token_ids(model, tok)
    prompts = [
        generation_prompt_ids(tok, [{"role": "user", "content": text}], enable_thinking=False)
        for text in ("Tell me about the moon.", "hi", "What is the capital of France?")
    ]
    refs = []
    for ids in prompts:
        ref = model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=10,
            do_sample=False,
        )
        new = ref[0, len(ids) :].tolist()
        stop = next((k for k, t in enumerate(new) if t in eos), None)
        refs.append(new if stop is None else new[: stop + 1])
        (reply,) = generate_replies(model, [ids], max_new_tokens=10, eos_ids=eos, pad_id=tok.pad_token_id)
        assert reply.ids == refs[-1]
        assert reply.finished == (stop is not None)
    # Left padding: a batch of different lengths gives each prompt its single-prompt reply.
    singles = [
        generate_replies(model, [p], max_new_tokens=10, eos_ids=eos, pad_id=tok.pad_token_id)[0]
        for p in prompts
    ]
    assert (
        generate_replies(model, prompts, max_new_tokens=10, eos_ids=eos, pad_id=tok.pad_token_id) == singles
    )
    assert any(r.finished for r in singles) and any(not r.finished for r in singles)
    # The slot generator, two slots for three prompts (one refill), prompts prefilled in chunks of 16.
    gen = SlotGenerator.create(model, eos, SlotSettings(slots=2, capacity=128, max_chunk=16))
    source = ListSource([Request(f"r{i}", tuple(p), 10) for i, p in enumerate(prompts)])
    gen.run(source)
    assert [source.replies[f"r{i}"] for i in range(3)] == singles


def test_sampling_is_fixed_by_each_request_seed(target: tuple[Any, Any]) -> None:
    """A sampled reply depends on its request's seed, not on the requests generated beside it."""
    model, tok = target
    eos = eos_token_ids(model, tok)
    texts = ("Tell a story.", "Describe a cat.", "Invent a word.")
    ids = [
        tuple(generation_prompt_ids(tok, [{"role": "user", "content": t}], enable_thinking=False))
        for t in texts
    ]

    def run(seeds: list[int], slots: int) -> list[list[int]]:
        gen = SlotGenerator.create(model, eos, SlotSettings(slots=slots, capacity=96))
        reqs = [
            Request(f"r{i}", p, 8, temperature=1.5, top_p=0.95, seed=s)
            for i, (p, s) in enumerate(zip(ids, seeds, strict=True))
        ]
        source = ListSource(reqs)
        gen.run(source)
        return [source.replies[f"r{i}"].ids for i in range(len(reqs))]

    together = run([1, 2, 3], slots=3)
    assert together == run([1, 2, 3], slots=1)  # one at a time
    assert together != run([4, 5, 6], slots=3)


def test_multi_turn_and_too_long_prompts(tmp_path: Path, target: tuple[Any, Any]) -> None:
    model, tok = target
    src = tmp_path / "chat.jsonl"
    conv = [
        {
            "messages": [
                {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "old"},
                {"role": "user", "content": "Bye!"},
            ]
        },
        {
            "messages": [
                {"role": "system", "content": "Be terse."},
                {"role": "user", "content": "Count to three."},
            ]
        },
        {"messages": [{"role": "user", "content": "word " * 200}]},
    ]
    src.write_text("".join(json.dumps(c) + "\n" for c in conv))
    out = tmp_path / "data"
    manifest = prepare_dataset(
        settings(out, src, max_new_tokens=6, val_fraction=0.0, max_prompt_tokens=120, dtype="float32"),
        progress=False,
    )
    assert manifest["counts"]["prompt_too_long"] == 1 and manifest["counts"]["records"] == 2
    cache = {len(r.get("messages", [])): r for r in cache_lines(out)}
    two = cache[4]  # user, assistant, user, assistant
    assert [m["role"] for m in two["messages"]] == ["user", "assistant", "user", "assistant"]
    assert two["messages"][1]["content"] != "old" and len(two["reply_ids"]) == 2
    # The second reply was generated on the target's own first reply.
    eos = eos_token_ids(model, tok)
    ids = generation_prompt_ids(tok, two["messages"][:3], enable_thinking=False)
    (again,) = generate_replies(model, [ids], max_new_tokens=6, eos_ids=eos, pad_id=tok.pad_token_id)
    assert again.ids == two["reply_ids"][1]
    (rec,) = [r for r in load_dataset(out, "train") if r.id == two["id"]]
    enc = encode_chat(tok, two["messages"], enable_thinking=False, finished=two["finished"], eos_ids=eos)
    assert rec.input_ids.tolist() == enc.input_ids and enc.masked_turns == 2
    assert rec.input_ids[rec.loss_mask].tolist() == two["reply_ids"][0] + two["reply_ids"][1]
    assert cache[3]["messages"][0] == {"role": "system", "content": "Be terse."}
    assert manifest["template"] == template_identity(tok, enable_thinking=False)


def test_settings_forbid_unknown_keys(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="bogus"):
        PrepareSettings(out=tmp_path, bogus=1)
    with pytest.raises(ValidationError):
        PrepareSettings(out=tmp_path, batch_size=0)


def test_cli(tmp_path: Path, prompts_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "data"
    argv = ["prepare", "--out", str(out), "--source", str(prompts_file), "--max-prompts", "3"]
    argv += ["--max-new-tokens", "4", "--batch-size", "3", "--val-fraction", "0", "--no-progress"]
    assert main(argv) == 0
    assert "new tokens/s" in capsys.readouterr().out
    assert read_manifest(out)["counts"]["records"] == 3 and load_dataset(out, "validation") == []
    with pytest.raises(SystemExit) as refused:  # dflashkit.commands.values, while the line is read
        main(["prepare", "--out", str(out), "--batch-size", "0"])
    assert refused.value.code == 2
    assert "argument --batch-size: takes a whole number >= 1, got '0'" in capsys.readouterr().err
    assert main(["prepare", "--out", str(tmp_path / "x"), "--source", str(tmp_path / "missing.jsonl")]) == 2
    assert "neither a file nor" in capsys.readouterr().err


def test_a_mixture_with_samples_and_fixed_held_out_sets(tmp_path: Path, prompts_file: Path) -> None:
    """Two sources, each with its own count, held-out set and sampling: per-source counts in the
    manifest, K records per training prompt (sampled apart), one greedy record per held-out prompt, and
    the same held-out prompts whatever the count."""
    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}) + "\n"
            for i in range(5)
        )
    )
    mixture = [
        {
            "source": str(prompts_file),
            "count": 4,
            "val_count": 1,
            "samples_per_prompt": 3,
            "temperature": 1.0,
        },
        {"source": str(chat), "val_count": 2},
    ]
    out = tmp_path / "data"
    manifest = prepare_dataset(
        PrepareSettings(out=out, sources=mixture, max_new_tokens=6, batch_size=4, dtype="float32"),
        progress=False,
    )
    a, b = manifest["sources"][str(prompts_file)], manifest["sources"][str(chat)]
    assert (a["selected"], a["train_prompts"], a["validation_prompts"]) == (4, 3, 1)
    assert (a["train_records"], a["validation_records"]) == (9, 1)
    assert (b["selected"], b["train_records"], b["validation_records"]) == (5, 3, 2)
    lines = {r["id"]: r for r in cache_lines(out)}
    sampled = [
        r for r in lines.values() if r["source"] == str(prompts_file) and r["sampling"]["temperature"] == 1.0
    ]
    assert len(sampled) == 9 and {r["sample"] for r in sampled} == {0, 1, 2}
    by_prompt: dict[str, list[Any]] = {}
    for r in sampled:
        by_prompt.setdefault(r["id"].split(".")[0], []).append(r["reply_ids"][0])
    assert any(len({tuple(x) for x in replies}) > 1 for replies in by_prompt.values())  # samples differ
    held = [r.id for r in load_dataset(out, "validation")]
    assert len(held) == 3 and all(
        lines[rid]["sampling"] == {"temperature": 0.0, "top_p": 1.0} for rid in held
    )
    # A larger count holds out the same prompts (the first of the seeded order).
    bigger = PrepareSettings(out=tmp_path / "x", sources=[{**mixture[0], "count": 6}, mixture[1]])
    from dflashkit.data.dataset import plan_records

    small_plan = plan_records(PrepareSettings(out=tmp_path / "x", sources=mixture))
    big_plan = plan_records(bigger)
    assert [j.record_id for j in big_plan[0].validation] == [j.record_id for j in small_plan[0].validation]
    assert {j.prompt.id for j in big_plan[0].train}.isdisjoint(j.prompt.id for j in small_plan[0].validation)
    # Another sampling seed: new samples of the same training prompts, the same held-out records.
    resampled = tmp_path / "resampled"
    prepare_dataset(
        PrepareSettings(
            out=resampled, sources=mixture, max_new_tokens=6, batch_size=4, dtype="float32", sample_seed=7
        ),
        progress=False,
    )
    again = {r["id"]: r for r in cache_lines(resampled)}
    assert again.keys() == lines.keys()
    assert all(again[rid]["reply_ids"] == lines[rid]["reply_ids"] for rid in held)
    assert any(again[r["id"]]["reply_ids"] != r["reply_ids"] for r in sampled)
    assert read_manifest(resampled)["settings"]["sample_seed"] == 7


def test_one_source_flags_clash_with_a_mixture(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "run.yaml"
    cfg.write_text(
        "data:\n  dir: %s\n  sources:\n    - source: chitchat\n      count: 4\n" % (tmp_path / "d")
    )
    assert main(["prepare", "-c", str(cfg), "--source", "sharegpt", "--temperature", "0.5"]) == 2
    err = capsys.readouterr().err
    assert "--source, --temperature set one source" in err and "data.sources" in err


class _EchoBackend:
    """Answers each request, in the order the source hands them out, with ids fixed by the request's
    prompt (the last 5 prompt tokens, then an end token on every other request): a stand-in for a
    generator whose replies depend on the request only."""

    name = "echo"

    def __init__(self, eos: int, hold: int):
        self.eos, self.hold = eos, hold

    def run(self, source: Any, *, on_progress: Any = None) -> Any:
        from dflashkit.data.generation import GenerationStats, Reply

        stats, running = GenerationStats(), []
        while True:
            running += source.take(self.hold - len(running), idle=not running)
            if not running:
                return stats
            req = running.pop(0)  # one ends, the others keep their slots (replies hand on in between)
            ids = list(req.prompt_ids[-5:]) + ([self.eos] if len(req.prompt_ids) % 2 else [])
            stats.requests += 1
            source.complete(req, Reply(ids, ids[-1] == self.eos))


def test_later_rounds_batched_or_not_give_the_same_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two- and three-round conversations: later rounds rendered as each reply arrives (1 worker) and in
    batches that fill while replies are handed on (2 workers, a batch of 3) give the same records."""
    from dflashkit.data import regenerate as rg
    from dflashkit.data.parallel import TokenizerPool
    from dflashkit.data.sources import make_prompt

    _, tok = load_target("embedded", weights=False)
    prompts = [make_prompt([f"Question {i}?", "And then?", "Why?"][: 2 + i % 2]) for i in range(9)]
    jobs = [rg.Job(p.id, p) for p in prompts]
    gen = rg.GenerationSettings(max_new_tokens=8)
    monkeypatch.setattr(rg, "DEFERRED_BATCH", 3)
    got = {}
    for workers in (1, 2):
        cache = tmp_path / f"cache-{workers}.jsonl"
        pool = TokenizerPool(tok, workers=workers, min_items=10**9)  # in-process: the batching logic only
        rg.regenerate(
            jobs, _EchoBackend(tok.eos_token_id, hold=4), tok, cache, gen, progress=False, pool=pool
        )
        got[workers] = read_cache(cache)[0]
    assert got[1] == got[2] and len(got[1]) == len(prompts)
    assert [len(got[1][p.id]["reply_ids"]) for p in prompts] == [len(p.turns) for p in prompts]


def test_skip_takes_the_prompts_after_an_earlier_rounds(tmp_path: Path) -> None:
    """`skip`: the training prompts start after the first `skip` of the seeded order past the held-out ones,
    so a later round (greedy replies repeat on a prompt) takes prompts the earlier one did not, and the
    held-out prompts stay the same; refused where it cannot keep that promise."""
    from dflashkit.config import SourceSpec
    from dflashkit.data.dataset import plan_records

    chat = tmp_path / "chat.jsonl"
    chat.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Tell me about the number {i}."}]}) + "\n"
            for i in range(12)
        )
    )
    first = {"source": str(chat), "count": 5, "val_count": 2}
    (one,) = plan_records(PrepareSettings(out=tmp_path / "a", sources=[first]))
    (two,) = plan_records(PrepareSettings(out=tmp_path / "b", sources=[{**first, "count": 6, "skip": 3}]))
    (whole,) = plan_records(PrepareSettings(out=tmp_path / "c", sources=[{**first, "count": 12}]))
    ids = [j.prompt.id for j in whole.train]  # the seeded order past the held-out prompts
    assert [j.record_id for j in two.validation] == [j.record_id for j in one.validation]
    assert [j.prompt.id for j in one.train] == ids[:3]
    assert [j.prompt.id for j in two.train] == ids[3:7]  # count 6: 2 held out + 4 after the 3 passed over
    assert (two.counts["selected"], two.counts["passed_over"], two.counts["train_prompts"]) == (6, 3, 4)
    # past the end: what is left
    (end,) = plan_records(PrepareSettings(out=tmp_path / "d", sources=[{**first, "skip": 8}]))
    assert [j.prompt.id for j in end.train] == ids[8:]
    with pytest.raises(ValueError, match="val_count"):
        SourceSpec(source=str(chat), skip=3)
    with pytest.raises(ValueError, match="sample_seed"):
        SourceSpec(source="self", count=4, skip=3)
