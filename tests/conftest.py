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
