import os

import pytest
import torch

# Tests run with a cold, private compile cache (caches are for speed only; a warm one hid the race).
os.environ.setdefault(
    "TORCHINDUCTOR_CACHE_DIR",
    os.path.join(os.environ.get("TMPDIR", "/tmp"), f"dflashkit-test-inductor-{os.getpid()}"),
)

# `make test` runs one pytest-xdist worker a core: each worker takes its share of the cores' threads
_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1) // _workers))

# Without a GPU the decoder kernels (dflashkit.infer.kernels.decoder) run in Triton's interpreter, which Triton reads
# at its first import: before any test imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # The interpreter checks every int32 add, sub and mul for overflow, which a GPU build does only in debug
    # mode; at the tests' small shapes no index comes near 2^31, and the checks cost 10-25% of the kernel tests.
    try:
        import dataclasses

        from triton.runtime import interpreter as _interpreter

        _builder = _interpreter.interpreter_builder
        _builder.options = dataclasses.replace(_builder.options, sanitize_overflow=False)
    except (ImportError, AttributeError):  # no Triton, or one without these internals: the checks stay
        pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory):
    """A small real dataset: chitchat prompts answered by the embedded target (made once per session)."""
    from dflashkit.data.dataset import PrepareSettings, prepare_dataset

    out = tmp_path_factory.mktemp("tiny-dataset")
    prepare_dataset(
        PrepareSettings(
            out=out,
            max_prompts=10,
            val_fraction=0.2,
            max_turns=1,
            max_new_tokens=40,
            batch_size=10,
            dtype="float32",
        ),
        progress=False,
    )
    return out
