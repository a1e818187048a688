"""Start-up of a run: what the runner and the notebook kernel import and do besides the study's work.

papermill is imported without building rfc3987_syntax's grammar (loaded on first use, same answers);
--no-progress silences the notebook's own progress lines too; the kernel is stopped at once after the
last cell; schema.yaml is parsed once per version; a figure saved with plots.save_figure is shown in
the notebook as the saved file instead of being drawn again.
"""
import base64
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import papermill  # noqa: E402
import pytest  # noqa: E402

from attnum import plots, progress, runs  # noqa: E402

STUDY = "length_scaling"
TINY = {"seq_lens": [16, 32, 64], "dtypes": ["bf16"], "seeds": [0], "block_configs": ["16x16"],
        "attribution_seq_lens": [32]}


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_papermill_is_imported_without_the_iri_grammar_and_iri_checks_still_work():
    proc = _python("""
        import sys
        from attnum import runs
        runs.params.import_papermill()
        import nbformat, jsonschema
        assert "papermill" in sys.modules and "nbformat.validator" in sys.modules
        # the grammar module was not imported; a placeholder stands in for it
        assert "rfc3987_syntax.syntax_helpers" not in sys.modules, "grammar built at import"
        assert getattr(sys.modules["rfc3987_syntax"], "__attnum_deferred__", False)
        # notebooks still validate
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("1")])
        nbformat.validate(nb)
        assert "rfc3987_syntax.syntax_helpers" not in sys.modules
        # an IRI check gives the real module's answers, loading it on first use
        check = jsonschema.Draft7Validator({"format": "iri"}, format_checker=jsonschema.Draft7Validator.FORMAT_CHECKER)
        answers = [not list(check.iter_errors(s)) for s in ("http://example.org/a", "http://a b", "no scheme")]
        assert "rfc3987_syntax.syntax_helpers" in sys.modules
        real = sys.modules["rfc3987_syntax"]
        assert not getattr(real, "__attnum_deferred__", False)
        expected = [real.is_valid_syntax("iri", s) for s in ("http://example.org/a", "http://a b", "no scheme")]
        assert answers == expected == [True, False, False], (answers, expected)
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_an_imported_module_is_never_replaced():
    proc = _python("""
        import sys
        import rfc3987_syntax
        from attnum import runs
        runs.params.import_papermill()
        assert sys.modules["rfc3987_syntax"] is rfc3987_syntax
        print("ok")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.parametrize("progress_arg,env_seen,bar", [(False, "off", False), ("lines", None, False),
                                                       (True, None, True)])
def test_progress_reaches_the_kernel_as_asked_and_the_kernel_stops_at_once(outputs, monkeypatch, progress_arg,
                                                                          env_seen, bar):
    """--no-progress (progress=False) runs the kernel with ATTNUM_PROGRESS=off, whatever the environment says."""
    monkeypatch.setenv(progress.ENV, "terminal")
    monkeypatch.delenv(progress.ENV) if env_seen is None else None
    seen = {}

    def fake(input_path, output_path, **kwargs):
        seen.update(kwargs, env=os.environ.get(progress.ENV))
        raise RuntimeError("stop here")

    monkeypatch.setattr(papermill, "execute_notebook", fake)
    with pytest.raises(runs.RunError, match="stop here"):
        runs.run(STUDY, "smoke", TINY, progress=progress_arg)
    assert seen["env"] == env_seen
    assert seen["progress_bar"] is bar
    assert seen["shutdown_kernel"] == "immediate"
    assert os.environ.get(progress.ENV) == (None if env_seen is None else "terminal")  # restored


def test_no_progress_prints_no_progress_lines(tmp_path):
    """End to end: the notebook's bars would print a line per update (interval 0); --no-progress prints none."""
    cmd = [sys.executable, "-m", "attnum", "run", STUDY, "--params", "smoke", "--outputs", str(tmp_path / "out")]
    for key, value in TINY.items():
        cmd += ["-p", key, json.dumps(value)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", progress.INTERVAL_ENV: "0", progress.ENV: "terminal"}
    proc = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    assert f"[{STUDY}/" not in text and "it/s" not in text, text[-3000:]
    run = tmp_path / "out" / STUDY
    assert (next(run.glob("smoke__*")) / "results.nc").exists()


def test_the_schema_is_parsed_once_per_version(tmp_path, monkeypatch):
    study_dir = tmp_path / "params" / "toy"
    study_dir.mkdir(parents=True)
    path = study_dir / "schema.yaml"
    path.write_text("a: {type: int, min: 0}\n")
    monkeypatch.setattr(runs.params, "params_dir", lambda: tmp_path / "params")
    parsed = []
    real = runs.params.load_yaml_file
    monkeypatch.setattr(runs.params, "load_yaml_file", lambda p: parsed.append(p) or real(p))
    first = runs.schema("toy")
    first["a"]["min"] = 99  # a caller's change does not reach the cache
    assert runs.schema("toy") == {"a": {"type": "int", "min": 0}}
    assert len(parsed) == 1
    path.write_text("a: {type: int, min: 1}\nb: {type: str}\n")  # a new version is read again
    os.utime(path, ns=(1, 1))
    assert runs.schema("toy") == {"a": {"type": "int", "min": 1}, "b": {"type": "str"}}
    assert len(parsed) == 2


@pytest.fixture
def shell():
    """An IPython shell with the inline backend's PNG printer for figures, as in a notebook kernel."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.pylabtools import select_figure_formats

    sh = InteractiveShell.instance()
    select_figure_formats(sh, {"png"})
    yield sh
    InteractiveShell.clear_instance()


def test_a_saved_figure_is_shown_as_the_saved_file_not_drawn_again(shell, tmp_path, monkeypatch):
    from matplotlib.backend_bases import FigureCanvasBase

    plots.set_theme()
    fig, axes = plots.subplots(1, 2)
    axes[0][0].plot([1, 2, 3], [1, 4, 9], label="x")
    axes[0][1].semilogy([1, 2, 3], [1, 10, 100])
    path = plots.save_figure(fig, tmp_path, "fig")
    fmt = shell.display_formatter.formatters["image/png"]
    drawn = []
    real_print = FigureCanvasBase.print_figure
    monkeypatch.setattr(FigureCanvasBase, "print_figure", lambda self, *a, **k: drawn.append(1) or real_print(self, *a, **k))
    data, meta = shell.display_formatter.format(fig)
    assert not drawn, "the figure was drawn again"
    assert base64.b64decode(data["image/png"]) == path.read_bytes()
    width, height = plots._png_size(path.read_bytes())
    dpi = plt.rcParams["savefig.dpi"]
    # the width alone, so a page that caps the width keeps the aspect ratio (no squashed figures)
    assert meta["image/png"] == {"width": round(width * fig.dpi / dpi)}
    # changed after saving: drawn as before
    axes[0][0].set_title("changed")
    data, meta = shell.display_formatter.format(fig)
    assert drawn and base64.b64decode(data["image/png"]) != path.read_bytes()
    assert "image/png" not in meta
    # a figure never saved: drawn as before
    other, ax = plt.subplots()
    ax.plot([0, 1])
    drawn.clear()
    shell.display_formatter.format(other)
    assert drawn
    plt.close("all")


def test_saving_writes_the_same_file_as_before(tmp_path):
    """The PNG on disk is savefig's own output, byte for byte (the display reuses it, nothing else)."""
    plots.set_theme()
    fig, axes = plots.subplots()
    axes[0][0].plot([1, 2, 3], [3, 1, 2])
    path = plots.save_figure(fig, tmp_path, "a")
    fig.savefig(tmp_path / "b.png", bbox_inches="tight")
    assert path.read_bytes() == (tmp_path / "b.png").read_bytes()
    plt.close("all")


def test_the_kernel_gets_this_attnum_and_absolute_pythonpath_entries(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(["site", "/abs/dir", "", "site"]))
    lib = str(Path(runs.__file__).resolve().parents[2])
    assert runs.kernel_pythonpath().split(os.pathsep) == [lib, str(tmp_path / "site"), "/abs/dir"]
    monkeypatch.delenv("PYTHONPATH")
    assert runs.kernel_pythonpath() == lib


def test_registry_names_accepted_before_by_the_same_code_skip_the_torch_import(tmp_path):
    code = """
        import json, sys
        from attnum import runs
        runs.check_parameters("length_scaling", {"real_kernels": ["sdpa:math", "emulator:fa2_bf16:bk64"]})
        print(json.dumps({"torch": "torch" in sys.modules}))
    """
    env = {**os.environ, "OMP_NUM_THREADS": "1", runs.params.KERNEL_CACHE_ENV: str(tmp_path)}
    run = lambda c: subprocess.run([sys.executable, "-c", textwrap.dedent(c)], capture_output=True, text=True,
                                   env=env)
    first, second = run(code), run(code)
    assert first.returncode == 0 and second.returncode == 0, first.stderr[-2000:] + second.stderr[-2000:]
    assert json.loads(first.stdout) == {"torch": True}  # checked through the registry
    assert json.loads(second.stdout) == {"torch": False}  # the same names, the same code: no torch import
    (cache,) = tmp_path.glob("registry-names-*.json")
    assert json.loads(cache.read_text()) == ["emulator:fa2_bf16:bk64", "sdpa:math"]
    # a name never accepted is still checked and refused, and not remembered
    bad = run("""
        from attnum import runs
        runs.check_parameters("length_scaling", {"real_kernels": ["sdpa:math", "sdpa:nope"]})
    """)
    assert bad.returncode != 0 and "sdpa:nope" in bad.stderr and "ParameterError" in bad.stderr
    assert "sdpa:nope" not in cache.read_text()


def test_kernels_of_your_own_and_other_code_are_never_taken_from_the_cache(tmp_path, monkeypatch):
    from attnum import kernels

    monkeypatch.setenv(runs.params.KERNEL_CACHE_ENV, str(tmp_path))
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "kernels"))
    assert runs.params._kernel_problem("byo_kernel_example:sdpa_math") is None  # ran a tiny input
    assert runs.params._kernel_problem("byo_kernel_example:broken") is not None
    monkeypatch.setattr(kernels.registry, "_FAMILIES", dict(kernels.registry._FAMILIES))
    kernels.register("toyfam", lambda options, **kw: kernels.get("golden"), doc="a test family", examples=("toyfam",))
    assert runs.params._kernel_problem("toyfam") is None
    assert runs.params._kernel_problem("golden") is None
    cached = json.loads(next(tmp_path.glob("registry-names-*.json")).read_text())
    assert cached == ["golden"]  # attnum's own family only
    monkeypatch.setattr(runs.params, "_code_key", lambda: "other-code")  # other code: the cache does not apply
    assert runs.params._known_registry_names() == set()


@pytest.mark.parametrize("every", [0.0, 1000.0])
def test_the_executing_notebook_is_written_at_most_every_save_every_seconds_and_complete_at_the_end(
        outputs, monkeypatch, every):
    """SAVE_EVERY 0: papermill's writes, at every cell's start and end; 1000 s: only the final ones. Both
    leave the complete executed notebook."""
    import papermill.engines
    import papermill.execute

    writes = []
    for module in (papermill.engines, papermill.execute):
        real = module.write_ipynb
        monkeypatch.setattr(module, "write_ipynb", lambda nb, path, _real=real, **kw: writes.append(path)
                            or _real(nb, path, **kw))
    monkeypatch.setattr(runs.execute, "SAVE_EVERY", every)
    folder = runs.run(STUDY, "smoke", TINY, progress=False)
    nb = json.loads((folder / "notebook.ipynb").read_text())
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] and c["metadata"]["papermill"]["status"] == "completed" for c in code)
    assert nb["metadata"]["papermill"]["end_time"]
    if every == 0:
        assert len(writes) >= 2 * len(code)
    else:
        assert len(writes) <= 4, writes  # the notebook's start, its end (papermill's two final writes)


def test_terminal_bars_print_nothing_when_short_and_never_a_state_twice(monkeypatch):
    """A bar ending within the interval prints no line; a longer one prints each state once."""
    import time

    written = []
    monkeypatch.setenv(progress.ENV, "terminal")
    monkeypatch.setattr(progress.os, "write", lambda fd, data: written.append(data.decode()) or len(data))
    monkeypatch.setenv(progress.INTERVAL_ENV, "5")
    for _ in progress.tqdm(range(3), desc="short"):
        pass
    assert written == []
    monkeypatch.setenv(progress.INTERVAL_ENV, "0.05")
    for _ in progress.tqdm(range(3), desc="long"):
        time.sleep(0.06)
    assert written, "a bar longer than the interval prints its states"
    assert all("long" in line for line in written)
    assert len(written) == len(set(written))
    assert "3/3" in written[-1]
