"""Prompt sources: every format parses, malformed records fail loudly (file and line) or are counted,
selection and splits are deterministic and never overlap."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflashkit.data.sources import (
    CHITCHAT_MIN_CHARS,
    detect_format,
    load_prompts,
    make_prompt,
    read_mtbench,
    select_prompts,
    split_prompts,
)
from dflashkit.errors import DataError


def write_jsonl(path: Path, records: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


CHAT = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "And 3+3?"},
            {"role": "assistant", "content": "6"},
        ]
    },
    {"messages": [{"role": "user", "content": "Name a planet."}]},
]


def test_chat_jsonl_keeps_system_and_user_turns_and_drops_replies(tmp_path: Path) -> None:
    ps = load_prompts(str(write_jsonl(tmp_path / "c.jsonl", CHAT)))
    assert ps.format == "chat"
    assert [p.turns for p in ps.prompts] == [("What is 2+2?", "And 3+3?"), ("Name a planet.",)]
    assert ps.prompts[0].system == "Be brief." and ps.prompts[1].system is None
    assert ps.prompts[0].origin.endswith("c.jsonl:1")
    assert ps.prompts[0].messages(["4"]) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    # The id is a hash of the content: the same conversation in another file has the same id.
    again = load_prompts(str(write_jsonl(tmp_path / "other.jsonl", list(reversed(CHAT)))))
    assert {p.id for p in again.prompts} == {p.id for p in ps.prompts}
    assert load_prompts(str(tmp_path / "c.jsonl"), max_turns=1).prompts[0].turns == ("What is 2+2?",)


def test_sharegpt_jsonl_and_json_array(tmp_path: Path) -> None:
    conv = {
        "id": "x",
        "conversations": [
            {"from": "system", "value": "You help."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello"},
            {"from": "human", "value": "Bye"},
        ],
    }
    jl = load_prompts(str(write_jsonl(tmp_path / "s.jsonl", [conv])))
    arr_path = tmp_path / "s.json"
    arr_path.write_text(json.dumps([conv, {"conversations": [{"from": "human", "value": "Other"}]}]))
    arr = load_prompts(str(arr_path))
    assert jl.format == arr.format == "sharegpt"
    assert jl.prompts[0].turns == ("Hi", "Bye") and jl.prompts[0].system == "You help."
    assert [p.turns for p in arr.prompts] == [("Hi", "Bye"), ("Other",)]
    assert arr.prompts[0].id == jl.prompts[0].id


def test_prompt_lists_txt_and_jsonl(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("first prompt\n\nsecond prompt\n")
    ps = load_prompts(str(txt))
    assert ps.format == "prompts"
    assert [p.turns for p in ps.prompts] == [("first prompt",), ("second prompt",)]
    assert ps.counts() == {"records": 3, "prompts": 2, "malformed": 0, "empty": 1, "duplicates": 0}
    assert ps.prompts[1].origin.endswith("p.txt:3")
    jl = load_prompts(str(write_jsonl(tmp_path / "p.jsonl", [{"prompt": "first prompt"}, {"prompt": "x y"}])))
    assert jl.format == "prompts" and [p.turns[0] for p in jl.prompts] == ["first prompt", "x y"]
    assert jl.prompts[0].id == ps.prompts[0].id


def test_detect_format_and_explicit_format(tmp_path: Path) -> None:
    assert detect_format(write_jsonl(tmp_path / "a.jsonl", CHAT)) == "chat"
    assert detect_format(write_jsonl(tmp_path / "b.jsonl", [{"conversations": []}])) == "sharegpt"
    assert detect_format(write_jsonl(tmp_path / "c.jsonl", [{"prompt": "x"}])) == "prompts"
    with pytest.raises(DataError, match="--format"):
        detect_format(write_jsonl(tmp_path / "d.jsonl", [{"text": "x"}]))
    # An explicit format that does not fit names the first record.
    with pytest.raises(DataError, match=r"a\.jsonl:1: expected \{\"conversations\""):
        load_prompts(str(tmp_path / "a.jsonl"), "sharegpt")


@pytest.mark.parametrize(
    ("line", "why"),
    [
        ('{"messages": [{"role": "user", "content": "ok"}', "invalid JSON"),
        ('{"messages": [{"role": "robot", "content": "beep"}]}', "role 'robot'"),
        ('{"messages": [{"role": "user", "content": ["parts"]}]}', "must be a string"),
        ('{"messages": [{"role": "user"}]}', 'needs "role" and "content"'),
        (
            '{"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "b"}]}',
            "only come first",
        ),
        ('{"messages": [{"role": "user", "content": "  "}]}', "empty user turn"),
        ('["not", "an", "object"]', "expected"),
    ],
)
def test_malformed_record_names_file_and_line_or_is_skipped(tmp_path: Path, line: str, why: str) -> None:
    path = write_jsonl(
        tmp_path / "bad.jsonl", [CHAT[1], {"messages": [{"role": "user", "content": "Fine."}]}, line]
    )
    with pytest.raises(DataError) as e:
        load_prompts(str(path), "chat")
    msg = str(e.value)
    assert f"{path}:3:" in msg and why in msg and "--skip-malformed" in msg
    ps = load_prompts(str(path), "chat", skip_malformed=True)
    assert len(ps.prompts) == 2
    assert ps.malformed == 1 and ps.records == 3


def test_malformed_sharegpt_array_record_and_prompt_list(tmp_path: Path) -> None:
    arr = tmp_path / "s.json"
    arr.write_text(
        json.dumps(
            [
                {"conversations": [{"from": "human", "value": "Hi"}]},
                {"conversations": [{"from": "bot", "value": "x"}]},
            ]
        )
    )
    with pytest.raises(DataError, match=r"s\.json record 1: turn 0 is from 'bot'"):
        load_prompts(str(arr))
    assert load_prompts(str(arr), skip_malformed=True).malformed == 1
    bad = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ok"}, {"prompt": 3}])
    with pytest.raises(DataError, match=r"p\.jsonl:2: expected \{\"prompt\""):
        load_prompts(str(bad))
    truncated = tmp_path / "t.json"
    truncated.write_text('[{"conversations": []},\n{"conv')
    with pytest.raises(DataError, match=r"t\.json:2: invalid JSON"):
        load_prompts(str(truncated), "sharegpt")


def test_duplicates_are_removed_and_counted(tmp_path: Path) -> None:
    txt = tmp_path / "p.txt"
    txt.write_text("Tell me a joke.\ntell me  a JOKE.\nSomething else\nTell me a joke.\n")
    ps = load_prompts(str(txt))
    assert [p.turns[0] for p in ps.prompts] == ["Tell me a joke.", "Something else"]
    assert ps.duplicates == 2


def test_unknown_source_and_format() -> None:
    with pytest.raises(DataError, match="neither a file nor one of chitchat, sharegpt, mtbench"):
        load_prompts("/no/such/file.jsonl")
    with pytest.raises(DataError, match="unknown format"):
        load_prompts("chitchat", "csv")


def test_chitchat_user_turns_are_single_turn_prompts() -> None:
    ps = load_prompts("chitchat")
    assert ps.format == "chitchat"
    assert len(ps.prompts) > 100_000  # 138,737 turns, minus short ones and duplicates
    assert ps.records == len(ps.prompts) + ps.empty + ps.duplicates
    assert all(len(p.turns) == 1 and len(p.turns[0]) >= CHITCHAT_MIN_CHARS for p in ps.prompts[:2000])
    assert len({p.id for p in ps.prompts}) == len(ps.prompts)
    assert ps.prompts[0].origin.startswith("chitchat:")


def test_mtbench_first_turns_by_default() -> None:
    first = read_mtbench()
    both = read_mtbench(all_turns=True)
    assert len(first) == len(both) == 80
    assert all(len(p.turns) == 1 for p in first) and all(len(p.turns) == 2 for p in both)
    assert [p.turns[0] for p in first] == [p.turns[0] for p in both]
    assert first[0].meta == {"question_id": "81", "category": "writing"}
    assert len({p.meta["category"] for p in first}) == 8
    assert [len(p.turns) for p in load_prompts("mtbench", max_turns=1).prompts] == [1] * 80


def test_selection_is_seeded_and_grows_as_a_superset() -> None:
    prompts = [make_prompt([f"prompt {i}"]) for i in range(50)]
    a = select_prompts(prompts, 10, seed=1)
    assert a == select_prompts(prompts, 10, seed=1)
    assert a != select_prompts(prompts, 10, seed=2)
    assert select_prompts(prompts, 20, seed=1)[:10] == a
    assert len(select_prompts(prompts, None, seed=1)) == 50


def test_split_never_overlaps_and_has_the_requested_size() -> None:
    prompts = select_prompts([make_prompt([f"prompt {i}"]) for i in range(40)], None, seed=0)
    train, val = split_prompts(prompts, 0.25)
    assert len(val) == 10 and len(train) == 30
    assert not {p.id for p in train} & {p.id for p in val}
    assert split_prompts(prompts[:3], 0.01)[1] == prompts[:1]  # a positive fraction holds out at least one
    assert split_prompts(prompts, 0.0) == (prompts, [])
    with pytest.raises(DataError, match="between 0 and 1"):
        split_prompts(prompts, 1.5)


def test_tokenizer_pool_matches_in_process_work() -> None:
    """Rendering and encoding in worker processes give what the same calls give in-process."""
    from transformers import AutoTokenizer

    from dflashkit.data.dataset import encode_record
    from dflashkit.data.parallel import TokenizerPool
    from dflashkit.data.regenerate import round_prompt_ids
    from dflashkit.target.hf import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("embedded")[0])
    items = [([{"role": "user", "content": f"question {i}?"}], False) for i in range(40)]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    with TokenizerPool(tok, workers=2, min_items=1) as pool:
        assert pool.map(round_prompt_ids, items) == [round_prompt_ids(tok, x) for x in items]
        (enc,) = pool.map(encode_record, [(chat, [True], [2], False)])
    here = encode_record(tok, (chat, [True], [2], False))
    assert (
        enc.input_ids.tolist() == here.input_ids.tolist()
        and enc.loss_mask.tolist() == here.loss_mask.tolist()
    )
    assert enc.loss_mask.sum() > 0 and (enc.assistant_turns, enc.masked_turns) == (1, 1)


def test_a_json_array_cut_off_mid_record_keeps_every_complete_record() -> None:
    from dflashkit.data.sources import json_array_records

    whole = '[\n  {"a": 1},\n  {"b": [1, 2]} ,{"c": "x]"}\n]'
    assert json_array_records(whole) == ([{"a": 1}, {"b": [1, 2]}, {"c": "x]"}], False)
    assert json_array_records(whole[:-2]) == ([{"a": 1}, {"b": [1, 2]}, {"c": "x]"}], True)
    assert json_array_records('[{"a": 1}, {"b": "cut') == ([{"a": 1}], True)
    assert json_array_records("[]") == ([], False)


def test_sharegpt_package_reader(tmp_path, monkeypatch) -> None:
    """ShareGPT's packaged file, cut off inside its last record: every complete conversation's user
    turns; assistant-first conversations keep their user turns; unreadable ones are counted, not fatal."""
    from dflashkit.data import sources

    convs = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Hi"},
                {"from": "gpt", "value": "Hello"},
                {"from": "human", "value": "More"},
            ],
        },
        {
            "id": "b",
            "conversations": [{"from": "gpt", "value": "...continued"}, {"from": "human", "value": "Go on"}],
        },
        {
            "id": "c",
            "conversations": [{"from": "human", "value": "x"}, {"from": "system", "value": "late system"}],
        },
        {"id": "d", "conversations": []},
        {"id": "e", "conversations": [{"from": "human", "value": "Hi"}, {"from": "chatgpt", "value": "dup"}]},
    ]
    text = json.dumps(convs, indent=2)
    path = tmp_path / "ShareGPT.json"
    path.write_text(text[:-40])  # cut inside the last record
    monkeypatch.setattr(sources, "sharegpt_path", lambda: path)
    ps = sources.load_prompts("sharegpt", max_turns=2)
    assert [p.turns for p in ps.prompts] == [("Hi", "More"), ("Go on",)]
    assert (ps.records, ps.malformed, ps.empty, ps.duplicates) == (4, 1, 1, 0)
    assert sources.load_prompts("sharegpt", max_turns=1).prompts[0].turns == ("Hi",)
