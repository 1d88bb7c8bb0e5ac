"""The project speaks of the product: a measurement or a plan is named by its date, device and commit, never by
an ordinal of the work period that made it. This scans every tracked text file and the names of tracked files
(`benchmarks/house.py`, which also counts them into results/house.json) and names each offending file:line."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import house  # noqa: E402


def test_no_tracked_file_names_a_measurement_by_its_work_period():
    assert house.tracked(), "git ls-files listed nothing: run the tests from a git checkout"
    found = house.tracked_process_words()
    assert not found, "name these by date, device and commit instead:\n" + "\n".join(found[:50])


def test_the_scan_finds_each_form_and_passes_the_products_own_words():
    said = "a (" + "twenty-" + "ninth se" + "ssion) run"
    assert house.process_words("f.md", "ok\n" + said) == [f"f.md:2: {'twenty-' + 'ninth se' + 'ssion'!r}"]
    across = "RESULTS.md, thirty-" + "third\n    # se" + "ssion)."
    assert len(house.process_words("f.py", across)) == 1
    assert len(house.process_words("f.md", "bench-b16-" + "s37.md and decode_steps-rows{0,16}-" + "s41")) == 2
    clean = "2026-12-06, one H100, commit 8f45671: bench-b16.md; a training session; scope='session'; ls -s1"
    assert house.process_words("f.md", clean) == []


def test_the_house_counts_follow_the_checkout():
    counts = house.measure()
    assert set(counts) == {
        "readme_lines",
        "process_word_lines",
        "engines",
        "src_lines",
        "configs",
        "benchmark_scripts",
    }
    assert counts["readme_lines"] == len((ROOT / "README.md").read_text().splitlines())
    assert counts["configs"] == len(list((ROOT / "configs").glob("*.yaml")))
    assert 0 < counts["benchmark_scripts"] <= 12 and counts["engines"] >= 1 and counts["src_lines"] > 1000
