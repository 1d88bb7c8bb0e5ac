"""The decoder kernels' compiled binaries in the portable compile cache's sibling (``runtime.triton_cache``):
the named kernels' entries of Triton's cache folder are packed, unpacked into another machine's folder (an
entry already there kept), refused when built by another environment or holding anything but plain files,
and a warm-up of the kernels engine with a compile cache says when it had nothing to write."""

import io
import json
import tarfile
from pathlib import Path

import pytest

from dflashkit.runtime import triton_cache
from dflashkit.runtime.compile_cache import CompileCacheError


def fake_entry(folder, entry: str, kernel: str) -> None:
    """A Triton cache entry as Triton writes one: a folder of the kernel's metadata and binary."""
    d = folder / entry
    d.mkdir(parents=True)
    (d / f"{kernel}.json").write_text(json.dumps({"name": kernel}))
    (d / f"{kernel}.cubin").write_bytes(entry.encode() * 10)


def test_the_named_kernels_entries_travel_to_another_cache_folder(tmp_path, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    fake_entry(here, "AAA", "qkv_kernel")
    fake_entry(here, "BBB", "walk_kernel")
    fake_entry(here, "CCC", "triton_poi_fused_add_0")  # Inductor's, not the engine's
    monkeypatch.setenv("TRITON_CACHE_DIR", str(here))
    file = triton_cache.sibling(tmp_path / "engine.compile-cache")
    assert file.name == "engine.compile-cache.triton"
    assert triton_cache.save(file, ["qkv_kernel", "walk_kernel", "merge_kernel"]) == 2
    assert triton_cache.held(file) == {"AAA", "BBB"}
    assert triton_cache.held(tmp_path / "missing.triton") == set()
    monkeypatch.setenv("TRITON_CACHE_DIR", str(there))
    fake_entry(there, "BBB", "walk_kernel")
    (there / "BBB" / "walk_kernel.cubin").write_bytes(b"its own")
    assert triton_cache.load(file) == 1  # AAA; BBB was there already and is kept
    assert (there / "AAA" / "qkv_kernel.cubin").read_bytes() == b"AAA" * 10
    assert (there / "BBB" / "walk_kernel.cubin").read_bytes() == b"its own"
    assert not (there / "CCC").exists()
    assert sorted(p.name for p in there.iterdir()) == ["AAA", "BBB"], "no temporary folder left"
    assert triton_cache.load(file) == 0
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "empty"))
    with pytest.raises(CompileCacheError, match="no compiled kernel"):
        triton_cache.save(file, ["qkv_kernel"])


def fake_launcher(folder, entry: str, name: str = "__triton_launcher") -> None:
    """A module Triton built with the C compiler (a kernel signature's launcher), as it stores one."""
    d = folder / entry
    d.mkdir(parents=True)
    (d / f"{name}.cpython-311-x86_64-linux-gnu.so").write_bytes(entry.encode())


def test_the_launchers_a_warm_up_built_travel_with_its_kernels(tmp_path, monkeypatch):
    here, there = tmp_path / "here", tmp_path / "there"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(here))
    fake_launcher(here, "OLD")  # another program's, there before the warm-up
    before = triton_cache.listing()
    fake_entry(here, "AAA", "qkv_kernel")
    fake_launcher(here, "LLL")
    fake_launcher(here, "UUU", "cuda_utils")
    fake_entry(here, "CCC", "triton_poi_fused_add_0")  # Inductor's, not the engine's
    new = triton_cache.listing() - before
    assert new == {"AAA", "LLL", "UUU", "CCC"}
    launchers = triton_cache.launchers(new)
    assert [d.name for d in launchers] == ["LLL", "UUU"]
    file = tmp_path / "engine.compile-cache.triton"
    assert triton_cache.save(file, ["qkv_kernel"], launchers) == 3
    assert triton_cache.held(file) == {"AAA", "LLL", "UUU"}
    # a later warm-up on the machine that unpacked it keeps the held launchers in its file
    monkeypatch.setenv("TRITON_CACHE_DIR", str(there))
    assert triton_cache.load(file) == 3
    assert [d.name for d in triton_cache.launchers(triton_cache.held(file))] == ["LLL", "UUU"]


def test_the_launchers_a_warm_up_loaded_are_named_as_triton_stores_them(tmp_path, monkeypatch):
    """Triton's own ``compile_module_from_src``, as the driver calls it: a launcher built in the block, and one
    found in the folder (built by an earlier process), are both recorded under the entry Triton's cache manager
    stored them in, whatever its naming scheme. (A real extension module stands in for the C compiler's
    output.)"""
    import array
    import shutil

    from triton.backends.nvidia import driver
    from triton.runtime import build

    if not getattr(array, "__file__", None):
        pytest.skip(
            "this Python has the array module built in: no extension module to stand in for a launcher"
        )
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    builds = []

    def compiler(name, src, tmpdir, *args):
        builds.append(name)
        return shutil.copy(array.__file__, f"{tmpdir}/built.so")

    monkeypatch.setattr(build, "_build", compiler)
    with triton_cache.launchers_loaded() as built:
        module = driver.compile_module_from_src(src="int launch;", name="array")
    assert builds == ["array"] and hasattr(module, "array")
    with triton_cache.launchers_loaded() as found:  # a later process: found in the folder, not built
        driver.compile_module_from_src(src="int launch;", name="array")
    driver.compile_module_from_src(src="int other;", name="array")
    assert builds == ["array", "array"], "the second call found it; the third, outside any block, built"
    entry = Path(module.__file__).parent
    assert entry.parent == tmp_path / "cache" and found == built == {entry.name}, (
        "recorded within the block only"
    )
    for f in list(entry.iterdir()):  # a launcher's entry as ``launchers`` knows one
        f.rename(entry / f.name.replace("array", "__triton_launcher"))
    fake_launcher(tmp_path / "cache", "OTHER")
    assert [d.name for d in triton_cache.launchers(found)] == [entry.name]


def test_a_foreign_or_unsafe_file_is_refused(tmp_path, monkeypatch):
    here = tmp_path / "here"
    fake_entry(here, "AAA", "qkv_kernel")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(here))
    file = tmp_path / "c.triton"
    triton_cache.save(file, ["qkv_kernel"])
    first, data = file.read_bytes().split(b"\n", 1)
    header = json.loads(first)
    header["key"]["torch.version"] = "0.0.0-elsewhere"
    file.write_bytes(json.dumps(header).encode() + b"\n" + data)
    with pytest.raises(CompileCacheError, match="another environment"):
        triton_cache.load(file)
    buffer = io.BytesIO()  # a payload reaching outside the cache folder
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    triton_cache.write_keyed(file, triton_cache.FORMAT, buffer.getvalue())
    with pytest.raises(CompileCacheError, match="no Triton cache file"):
        triton_cache.load(file)
    assert not (tmp_path / "escape").exists()
