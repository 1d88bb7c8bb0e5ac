import copy
import json
import subprocess
import sys

import pytest

from dflashkit.cli import main
from dflashkit.runtime import fingerprint
from dflashkit.runtime.checks import known_issues, run_checks


@pytest.fixture(scope="module")
def fp():
    return fingerprint.collect()


def test_fingerprint_has_the_exact_torch_build(fp):
    import torch

    assert fp["torch"]["version"] == torch.__version__
    assert fp["torch"]["git_version"] == torch.version.git_version
    assert len(fp["torch"]["git_version"]) == 40
    assert fp["torch"]["cuda"] == torch.version.cuda
    assert fp["gpu"]["count"] == torch.cuda.device_count()
    assert fp["packages"]["torch"].split("+")[0] == torch.__version__.split("+")[0]
    assert len(fp["package_set"]["hash"]) == 16 and fp["package_set"]["count"] > 10
    assert fp["inductor_cache"]["state"] in ("cold", "warm")
    assert fp["python"]["version"].startswith(f"{sys.version_info.major}.{sys.version_info.minor}")


def test_the_critical_entries_are_the_fingerprints_read_once(fp, monkeypatch):
    """``critical()`` (what the compile caches key their files by) equals the whole fingerprint's critical
    entries, and is read once a process: a warm start checks several files."""
    from dflashkit.runtime.compile_cache import cache_key

    flat = fingerprint.flatten(fp)
    assert fingerprint.critical() == {k: flat.get(k) for k in fingerprint.CRITICAL_KEYS} == cache_key()
    monkeypatch.setattr(fingerprint, "collect", lambda: pytest.fail("the whole fingerprint read for a key"))
    monkeypatch.setattr(fingerprint.metadata, "version", lambda name: pytest.fail("read again"))
    assert cache_key() == fingerprint.critical()
    assert cache_key(fp) == fingerprint.critical()  # a given fingerprint is flattened as before


def test_env_vars_are_recorded(monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_FOO", "1")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,6,7")
    monkeypatch.setenv("UNRELATED_VARIABLE", "x")
    env = fingerprint.collect()["env"]
    assert env["TORCHINDUCTOR_FOO"] == "1"
    assert env["NCCL_DEBUG"] == "INFO"
    assert env["CUDA_VISIBLE_DEVICES"] == "5,6,7"
    assert "UNRELATED_VARIABLE" not in env


def test_inductor_cache_counts_entries(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert fingerprint.collect()["inductor_cache"]["state"] == "cold"
    (tmp_path / "fxgraph").mkdir()
    (tmp_path / "fxgraph" / "entry").write_bytes(b"x" * 2048)
    info = fingerprint.collect()["inductor_cache"]
    assert info["state"] == "warm" and info["entries"] == 1 and info["path"] == str(tmp_path)


def test_json_round_trip(fp, tmp_path):
    path = fingerprint.save(fp, tmp_path / "a.json")
    assert fingerprint.load(path) == json.loads(json.dumps(fp))
    # A folder holding a fingerprint (run or checkpoint folder) is accepted too.
    fingerprint.save(fp, tmp_path)
    assert fingerprint.load(tmp_path)["torch"] == fp["torch"]


def test_diff_semantics(fp):
    b = copy.deepcopy(fp)
    assert fingerprint.diff(fp, b) == []
    b["created"] = "another time"
    assert fingerprint.diff(fp, b) == []  # timestamps are not a change
    b["packages"]["numpy"] = "0.0.1"
    changes = fingerprint.diff(fp, b)
    assert [c.key for c in changes] == ["packages.numpy"] and not fingerprint.has_critical(changes)
    for key, value in [
        (("torch", "git_version"), "0" * 40),
        (("torch", "version"), "2.11.0+cu130"),
        (("torch", "cuda"), "13.0"),
        (("gpu", "names"), ["NVIDIA H100"]),
    ]:
        c = copy.deepcopy(fp)
        c[key[0]][key[1]] = value
        ch = fingerprint.diff(fp, c)
        assert fingerprint.has_critical(ch), key
        assert ch[0].key == ".".join(key) and ch[0].critical
    c = copy.deepcopy(fp)
    c["packages"]["triton"] = "9.9.9"
    assert fingerprint.has_critical(fingerprint.diff(fp, c))


def _run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "dflashkit", *args], capture_output=True, text=True, timeout=300
    )


def test_cli_json_stdout_shows_git_hash():
    import torch

    r = _run_cli("doctor", "--json", "-")
    assert r.returncode == 0, r.stderr
    data = json.loads(r.stdout)
    assert data["torch"]["git_version"] == torch.version.git_version


def test_cli_diff_exit_codes(fp, tmp_path, capsys):
    a = fingerprint.save(fp, tmp_path / "a.json")
    same = fingerprint.save(copy.deepcopy(fp), tmp_path / "same.json")
    other = copy.deepcopy(fp)
    other["torch"]["git_version"] = "70d99e998b4955e0049d13a98d77ae1b14db1f45"
    b = fingerprint.save(other, tmp_path / "b.json")
    assert main(["doctor", "--diff", str(a), str(same)]) == 0
    capsys.readouterr()
    assert main(["doctor", "--diff", str(a), str(b)]) == 1
    out = capsys.readouterr().out
    assert "torch.git_version" in out and "CRITICAL" in out and "70d99e998b49" in out
    minor = copy.deepcopy(fp)
    minor["env"]["NCCL_DEBUG"] = "WARN"
    m = fingerprint.save(minor, tmp_path / "m.json")
    assert main(["doctor", "--diff", str(a), str(m)]) == 0


def test_cli_diff_bad_input_is_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert main(["doctor", "--diff", str(bad), str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not valid JSON" in err and "Traceback" not in err
    assert main(["doctor", "--diff", str(tmp_path / "missing.json"), str(bad)]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["doctor", "--diff", str(tmp_path), str(bad)]) == 2
    assert "without a fingerprint.json" in capsys.readouterr().err


def test_diff_of_a_folder_without_a_fingerprint_never_uses_a_subfolders(fp, tmp_path, capsys):
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    fingerprint.save(fp, run / "best" / fingerprint.FINGERPRINT_FILE)
    a = fingerprint.save(fp, tmp_path / "a.json")
    assert main(["doctor", "--diff", str(run / "best"), str(a)]) == 0  # a folder that holds one
    capsys.readouterr()
    assert main(["doctor", "--diff", str(run), str(a)]) == 2
    err = capsys.readouterr().err
    assert f"{run} is a folder without a fingerprint.json" in err and "subfolders best have one" in err


def test_check_passes_and_reports_each_line():
    results = run_checks()
    names = [r.name for r in results]
    assert "imports" in names and "cuda allocation" in names
    assert all(r.ok for r in results), [(r.name, r.detail) for r in results if not r.ok]


def test_check_cli_output():
    r = _run_cli("doctor", "--check")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "known issues" in r.stdout
    assert "FX-tracing flag" in r.stdout


def test_known_issues_inspect_torch(monkeypatch):
    import torch
    import torch.fx._symbolic_trace as symbolic_trace

    issues = {k.name: k for k in known_issues()}
    fx = issues["FX-tracing flag is process-global"]
    assert fx.present is isinstance(getattr(symbolic_trace, "_is_fx_tracing_flag", None), bool)
    assert issues["silent fall-back settings"].present is False
    # The table reads the live objects: a dangerous setting shows up.
    with torch._dynamo.config.patch(suppress_errors=True):
        assert {k.name: k for k in known_issues()}["silent fall-back settings"].present is True


def test_the_diff_ignores_the_cache_variable_torch_sets_in_the_process(fp, monkeypatch):
    """torch's cache_dir() (read for the inductor cache entry) exports TORCHINDUCTOR_CACHE_DIR: a run
    started without it and resumed in a process that read the cache folder is no environment change."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    before = copy.deepcopy(fp)
    before["env"].pop("TORCHINDUCTOR_CACHE_DIR", None)
    after = copy.deepcopy(before)
    after["env"]["TORCHINDUCTOR_CACHE_DIR"] = fingerprint.collect()["inductor_cache"]["path"]
    assert fingerprint.diff(before, after) == []
    moved = copy.deepcopy(after)
    moved["inductor_cache"]["path"] = "/elsewhere"  # a cache folder the user moved is still a change
    assert [c.key for c in fingerprint.diff(after, moved)] == ["inductor_cache.path"]
