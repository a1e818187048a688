"""attnum.glue: values glued for prose are plain Python, keys are checked, references are found."""
import math
from pathlib import Path

import numpy as np
import pytest

from attnum import glue, ncio


def test_plain_converts_numpy_and_marks_missing():
    assert glue.plain(np.float64(0.25)) == 0.25 and type(glue.plain(np.float64(0.25))) is float
    assert glue.plain(np.int64(7)) == 7 and type(glue.plain(np.int64(7))) is int
    assert glue.plain(np.bool_(True)) is True
    assert glue.plain(np.array(3.5)) == 3.5
    assert glue.plain(float("nan")) == glue.MISSING and glue.plain(None) == glue.MISSING
    with pytest.raises(glue.GlueError):
        glue.plain(np.arange(3))
    with pytest.raises(glue.GlueError):
        glue.plain([1, 2])


def test_glue_values_outputs_are_read_back(monkeypatch):
    stored = {}
    import myst_nb

    monkeypatch.setattr(myst_nb, "glue", lambda k, v, display=True: stored.setdefault(k, (v, display)))
    table = glue.glue_values({"ratio": np.float64(1.5), "word": "passes", "n": np.int32(4)})
    assert stored == {"ratio": (1.5, False), "word": ("passes", False), "n": (4, False)}
    assert list(table.index) == ["ratio", "word", "n"] and list(table["value"]) == ["1.5", "passes", "4"]
    with pytest.raises(glue.GlueError, match="lower-case identifier"):
        glue.glue_values({"Bad Key": 1})


def _output(name, text):
    return {"output_type": "display_data", "metadata": {"scrapbook": {"name": name, "mime_prefix": glue_prefix()}},
            "data": {glue_prefix() + "text/plain": text}}


def glue_prefix():
    return "application/papermill.record/"


def test_keys_referenced_and_glued():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "growth {glue:text}`growth:.2f`, verdict {glue}`verdict` {glue:text}`absent`"},
        {"cell_type": "code", "source": "", "outputs": [_output("growth", "1.234"), _output("verdict", "'passes'")]},
    ]}
    assert glue.referenced_keys(nb) == {"growth", "verdict", "absent"}
    assert glue.glued_keys(nb) == {"growth", "verdict"}
    assert glue.missing_keys(nb) == {"absent"}
    values = glue.read_glued(nb)
    assert values["growth"] == pytest.approx(1.234) and values["verdict"] == "passes"


def test_committed_run_respects_outputs_root(tmp_path, monkeypatch):
    import xarray as xr

    folder = tmp_path / "length_scaling" / "gpu"
    folder.mkdir(parents=True)
    xr.Dataset({"x": ("i", np.arange(3.0))}).to_netcdf(folder / "results.nc")
    ncio.write_record(folder, {"status": "ok", "results_sha256": ncio.file_sha256(folder / "results.nc")})
    monkeypatch.setenv("ATTNUM_OUTPUTS", str(tmp_path))
    ds = ncio.committed_run("length_scaling")
    assert ds is not None and ds.attrs["run"] == "length_scaling/gpu" and float(ds["x"].sum()) == 3.0
    assert ncio.committed_run("length_scaling", "other") is None
    with pytest.raises(ValueError, match="run name"):
        ncio.committed_run("length_scaling", "../x")
    assert math.isfinite(float(ds["x"][0]))


def test_missing_values_lose_their_number_format():
    nb = {"cells": [
        {"cell_type": "markdown", "source": "a {glue:text}`gone:.2f` b {glue:text}`here:.1%`"},
        {"cell_type": "code", "source": "", "outputs": [_output("gone", "'n/a'"), _output("here", "0.25")]},
    ]}
    glue.unformat_missing(nb)
    assert nb["cells"][0]["source"] == "a {glue:text}`gone` b {glue:text}`here:.1%`"


def test_the_site_refuses_a_page_whose_prose_refers_to_values_not_glued():
    import nbformat

    from attnum.site import pages

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("x {glue:text}`absent:.2f`")])
    with pytest.raises(pages.GlueMissing, match="absent"):
        pages._page_notebook({"nb": nb, "study": "length_scaling", "run": "smoke", "dir": Path("/nonexistent")}, "")
