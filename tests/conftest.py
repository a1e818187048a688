import pytest
import torch


@pytest.fixture
def outputs(tmp_path, monkeypatch):
    """A private outputs root, so tests never touch outputs/."""
    root = tmp_path / "outputs"
    monkeypatch.setenv("ATTNUM_OUTPUTS", str(root))
    return root


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run through the device tool (see README)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def without_triton_interpreter():
    """TRITON_INTERPRET=0 while a module's tests run. tests/kernels/test_triton_fa2.py sets it to 1 for the whole
    pytest session (it must precede triton's import); modules that check what a CPU without the interpreter
    records (the CUDA-only kernels as unavailable) make this an autouse module fixture (subprocesses that want
    the interpreter set it themselves)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        yield
