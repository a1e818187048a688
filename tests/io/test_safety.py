"""What an adversary can plant in outputs/ or pass on the command line, and what must hold anyway.

* Links: a symbolic link planted where the project expects its own folder or file (``<run>.failed``,
  ``.versions/<run>``, ``.locks/<run>.lock``, a study folder, a run pointer) is never followed: a
  victim folder outside the outputs root is byte-for-byte untouched by runs, failures and ``clean``.
* Markup: a data-derived string (``-p`` values in the provenance and the parameter table, a failed
  run's error, the NetCDF ``device`` attribute, a figure's file name) reaches the site's HTML as text,
  never as a tag (checked with ``html.parser`` on every page: no element carries ``onerror``).
* Damage: a run without its record or its hashes, a replaced or added figure, a folder, FIFO or link in
  a file's place, a compression bomb: each a named, skipped damaged run, never a crash or a hang.
* Inputs: YAML aliases and deep nesting refused, decode errors naming the file, ``--timeout`` below 1,
  the same ``-p`` key twice and a ``-p`` key also swept: refused before any folder exists.
* ``clean-results``: refused while a run is live; a run starting during the deletion waits for it and
  keeps its folders (the run locks are held from the check to the last deletion).
* Failures: the record names the kernel's own error (or that it reported none, or that the kernel died);
  a kernel killed in a cell ends the run; an address-space limit too small for a kernel is refused first.
* Sizes and devices: a list past its limit and a grid past its size refused naming the limit; your own
  kernel test-run on the run's device; an outputs folder that takes no files; in JupyterLab a misspelled
  name in the parameters cell ("did you mean"), and a refused value shown as its one message.

Runs use ``robust_helpers.fake_execute`` in place of papermill (a real results.nc in milliseconds).
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
from html.parser import HTMLParser
from pathlib import Path

import netCDF4
import numpy as np
import papermill
import pytest

import attnum.site
from attnum import cli, ncio, runs
from attnum.paths import UnsafePathError

import robust_helpers as rh

STUDY = "length_scaling"
PAYLOAD = "x`<img src=x onerror=alert(1)>`"


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.setattr(papermill, "execute_notebook", rh.fake_execute)
    monkeypatch.setattr(runs.store, "_SWAP_HOOK", None)
    monkeypatch.delenv("FAKE_VALUE", raising=False)
    return rh.fake_execute


@pytest.fixture
def victim(tmp_path):
    """A folder outside the outputs root, with a file and a subfolder: what a planted link points at."""
    v = tmp_path / "victim"
    (v / "sub").mkdir(parents=True)
    (v / "sub" / "data.txt").write_text("keep me\n")
    (v / "precious.txt").write_text("precious\n")
    return v


def _tree(folder: Path) -> list[tuple[str, str]]:
    return sorted((str(p.relative_to(folder)), p.read_text() if p.is_file() else "<dir>") for p in folder.rglob("*"))


def _failing(input_path, output_path, parameters=None, **kwargs):
    raise RuntimeError(PAYLOAD)


# -- links: never followed --

def test_a_failure_never_deletes_what_a_planted_failed_link_points_at(outputs, fake, victim, monkeypatch):
    runs.run(STUDY, "smoke", progress=False)
    before = _tree(victim)
    (outputs / STUDY / "smoke.failed").symlink_to(victim)
    monkeypatch.setattr(papermill, "execute_notebook", _failing)
    with pytest.raises(runs.RunError):
        runs.run(STUDY, "smoke", progress=False)
    assert _tree(victim) == before
    failed = outputs / STUDY / "smoke.failed"  # now the run's own failure record
    assert ncio.read_record(failed)["status"] == "failed"


def test_a_planted_versions_link_is_refused_by_clean_and_by_a_run(outputs, fake, victim):
    runs.run(STUDY, "smoke", progress=False, name="other")
    versions = outputs / STUDY / runs.store.VERSIONS
    (versions / "smoke").symlink_to(victim)
    before = _tree(victim)
    removed = runs.clean()
    assert _tree(victim) == before
    assert [line for line in removed if line.startswith(f"refused {versions / 'smoke'}")]
    with pytest.raises(UnsafePathError, match=r"\.versions/smoke is a symbolic link"):
        runs.run(STUDY, "smoke", progress=False)
    assert _tree(victim) == before


def test_a_planted_lock_link_is_never_written_through(outputs, fake, victim):
    runs.run(STUDY, "smoke", progress=False, name="other")
    lock = outputs / STUDY / runs.store.LOCKS / "smoke.lock"
    lock.symlink_to(victim / "precious.txt")
    before = _tree(victim)
    with pytest.raises(UnsafePathError, match=r"smoke\.lock is a symbolic link"):
        runs.run(STUDY, "smoke", progress=False)
    runs.clean()
    assert _tree(victim) == before
    assert not (outputs / STUDY / "smoke").exists()


def test_a_study_folder_that_is_a_link_is_not_cleaned(outputs, fake, victim):
    stale = victim / runs.store.VERSIONS / "smoke" / "20260101T000000-1-abcdef"
    stale.mkdir(parents=True)
    (stale / "results.nc").write_text("someone else's file\n")
    outputs.mkdir()
    (outputs / STUDY).symlink_to(victim)
    before = _tree(victim)
    removed = runs.clean()
    assert _tree(victim) == before
    assert [line for line in removed if line.startswith(f"refused {outputs / STUDY}")]


def test_a_planted_run_pointer_is_not_read_as_a_run(outputs, fake, tmp_path):
    (good,) = [runs.run(STUDY, "smoke", {"head_dim": 32}, sweep_dims=["head_dim"], progress=False)]
    elsewhere = tmp_path / "elsewhere"
    runs.run(STUDY, "smoke", {"head_dim": 64}, sweep_dims=["head_dim"], progress=False,
             outputs=tmp_path / "other")
    src = tmp_path / "other" / STUDY / "smoke@head_dim=64"
    elsewhere.mkdir()
    for f in src.iterdir():
        (elsewhere / f.name).write_bytes(f.read_bytes())
    (outputs / STUDY / "smoke@head_dim=64").symlink_to(elsewhere)  # a complete, consistent run, outside
    assert ncio.run_folders(STUDY) == [good]
    merged = ncio.open_study(STUDY)
    assert merged["head_dim"].values.tolist() == [32]
    with pytest.raises(attnum.site.PublishError, match=r"smoke@head_dim=64 is a symbolic link"):
        attnum.site.publish()


# -- data never becomes markup --

class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.text = [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))

    def handle_data(self, data):
        self.text.append(data)


def _parse(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text())
    return page


def _forge(folder: Path, **changes) -> None:
    """Rewrite a run's record consistently (what anyone who can write the folder can do)."""
    record = ncio.read_record(folder)
    record.update(changes)
    record.pop("checksum", None)
    ncio.write_record(folder, record)


def _markdown_of_a_parameter(input_path, output_path, parameters=None, **kwargs):
    """A run whose notebook shows a parameter in ``display(Markdown(...))``, as notebook 04 does (through
    ``site.render_finding``, which escapes the value)."""
    import nbformat

    rh.fake_execute(input_path, output_path, parameters, **kwargs)
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("display(Markdown(render_finding(TEMPLATE, {'kernel': kernel})))")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/markdown": attnum.site.render_finding(
        "the kernel {glue:text}`kernel` is compared", {"kernel": PAYLOAD})})]
    nb.cells = [nbformat.v4.new_markdown_cell("# 01 · Length scaling"), cell]
    nbformat.write(nb, output_path)


@pytest.fixture
def planted_site(outputs, fake, monkeypatch):
    """A published site whose data carry ``PAYLOAD`` in every place data reach a page."""
    monkeypatch.setattr(papermill, "execute_notebook", _markdown_of_a_parameter)  # the notebook's Markdown
    run = runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False, name="default")
    monkeypatch.setattr(papermill, "execute_notebook", rh.fake_execute)
    results = run / "results.nc"
    ds = ncio.open_results(results)
    ds.attrs["device"] = PAYLOAD  # the NetCDF device attribute: on index.html
    results.unlink()
    ds.to_netcdf(results, engine="netcdf4")
    record = ncio.read_record(run)
    _forge(run, param_set="default", overrides={"kernel": PAYLOAD},  # provenance "overrides"
           parameters={**record["parameters"], "kernel": PAYLOAD},  # the parameter table
           results_sha256=ncio.file_sha256(results))
    monkeypatch.setattr(papermill, "execute_notebook", _failing)  # a failed run's error: on runs.html
    with pytest.raises(runs.RunError):
        runs.run(STUDY, "smoke", {"head_dim": 64}, progress=False)
    monkeypatch.setattr(papermill, "execute_notebook", rh.fake_execute)
    named = runs.run(STUDY, "smoke", {"head_dim": 16}, progress=False)
    (named / f"{PAYLOAD}.png").write_bytes(b"\x89PNG\r\n")  # a figure's file name: named as damage
    with contextlib.suppress(attnum.site.PublishError):  # that run is damaged: publish exits non-zero
        attnum.site.publish()
    return outputs / "site"


def test_data_reaches_the_site_as_text_never_as_a_tag(planted_site):
    site = planted_site
    pages = sorted(site.rglob("*.html"))
    live = [(p.name, tag, attrs) for p in pages for tag, attrs in _parse(p).tags
            if "onerror" in attrs or (tag == "img" and attrs.get("src") == "x")]
    assert live == []
    shown = "<img src=x onerror=alert(1)>"  # and each payload is on its page, as text
    index = "".join(_parse(site / "index.html").text)
    assert index.count(shown) >= 2  # the device attribute, the damaged run's figure name
    assert shown in "".join(_parse(site / "runs.html").text)  # the failed run's error
    page = "".join(_parse(site / STUDY / "default" / "notebook.html").text)
    assert page.count(shown) >= 4  # overrides, parameter table, device, the notebook's Markdown


def test_no_planted_payload_runs_script_in_a_browser(planted_site):
    """Every page of the planted site in headless Chromium: no ``alert()`` fires (no dialog opens)."""
    import shutil

    chromium = os.environ.get("ATTNUM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    if not chromium:
        pytest.skip("no Chromium browser on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    from playwright.sync_api import sync_playwright

    pages = sorted(planted_site.rglob("*.html"))
    assert len(pages) >= 3
    fired = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.on("dialog", lambda dialog: (fired.append((page.url, dialog.message)), dialog.dismiss()))
            for path in pages:
                page.goto(path.as_uri(), wait_until="load")
                page.wait_for_timeout(100)  # an <img onerror> fires once its load fails
        finally:
            browser.close()
    assert fired == []


# -- damage: named and skipped, never a crash or a hang --

def _sweep_runs(*head_dims):
    return [runs.run(STUDY, "smoke", {"head_dim": d}, sweep_dims=["head_dim"], progress=False) for d in head_dims]


def _with_figure(input_path, output_path, parameters=None, **kwargs):
    rh.fake_execute(input_path, output_path, parameters, **kwargs)
    (Path(parameters["output_dir"]) / "fig.png").write_bytes(b"\x89PNG\r\n\x1a\nfigure")


def _bomb(path: Path, n: int) -> None:
    """A results file whose one variable decodes to ``8 n`` bytes of zeros and takes a few hundred KB."""
    path.unlink()
    with netCDF4.Dataset(path, "w") as nc:
        nc.createDimension("i", n)
        var = nc.createVariable("zeros", "f8", ("i",), zlib=True, complevel=9, chunksizes=(1 << 20,))
        block = np.zeros(1 << 22)
        for start in range(0, n, block.size):
            var[start:start + block.size] = block[: n - start]


def _damage(bad: Path, kind: str, monkeypatch) -> None:
    record, results = bad / "RUN.json", bad / "results.nc"
    if kind == "record deleted":
        record.unlink()
    elif kind == "hash keys removed":
        body = {k: v for k, v in json.loads(record.read_text()).items() if k not in ("results_sha256", "checksum")}
        record.write_text(json.dumps(body))
    elif kind == "results replaced, hash dropped":
        results.write_bytes(results.read_bytes())  # rewritten, and the record forged without its hash
        _forge(bad, results_sha256=None)
    elif kind == "figure replaced":
        (bad / "fig.png").write_bytes(b"\x89PNG\r\n\x1a\nanother figure")
    elif kind == "figure added":
        (bad / "extra.png").write_bytes(b"\x89PNG\r\n\x1a\nplanted")
    elif kind == "results.nc a folder":
        results.unlink()
        results.mkdir()
    elif kind == "RUN.json a FIFO":
        record.unlink()
        os.mkfifo(record)
    elif kind == "results.nc a link":
        elsewhere = bad.parent.parent / "elsewhere.nc"
        elsewhere.write_bytes(results.read_bytes())
        results.unlink()
        results.symlink_to(elsewhere)
    elif kind == "compression bomb":
        monkeypatch.setenv("ATTNUM_MAX_RESULTS_BYTES", str(64 * 2**20))
        _bomb(results, 1 << 25)  # 256 MiB decoded
        _forge(bad, results_sha256=ncio.file_sha256(results))  # a consistent record: only the size tells
    else:
        raise AssertionError(kind)


DAMAGE = ["record deleted", "hash keys removed", "results replaced, hash dropped", "figure replaced",
          "figure added", "results.nc a folder", "RUN.json a FIFO", "results.nc a link", "compression bomb"]


def _guarded(fn, limit=120.0):
    """Call ``fn`` in a thread; a hang (a FIFO read) fails the test instead of blocking it forever."""
    out = {}

    def target():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed back to the test
            out["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(limit)
    assert not t.is_alive(), "hung (a FIFO read, a lost scheduler)"
    if "error" in out:
        raise out["error"]
    return out["value"]


@pytest.mark.parametrize("kind", DAMAGE)
def test_each_kind_of_damage_is_a_named_skipped_run(outputs, fake, monkeypatch, kind):
    monkeypatch.setattr(papermill, "execute_notebook", _with_figure)
    good, bad = _sweep_runs(32, 64)
    _damage(bad, kind, monkeypatch)
    with pytest.raises(ncio.DamagedRunError, match=bad.name):  # the bomb's record is consistent: its size tells
        _guarded(lambda: (ncio.verify_run(bad), ncio.open_results(bad / "results.nc")))
    with pytest.warns(ncio.DamagedRunWarning, match=bad.name):
        merged = _guarded(lambda: ncio.open_study(STUDY))
    assert merged["head_dim"].values.tolist() == [32]
    assert bad.name in json.loads(merged.attrs["skipped_runs"])
    ncio.verify_run(good)


def test_publish_names_every_damaged_run_and_publishes_the_rest(outputs, fake, monkeypatch):
    monkeypatch.setattr(papermill, "execute_notebook", _with_figure)
    head_dims = list(range(16, 16 + len(DAMAGE) + 1))
    good, *bad = _sweep_runs(*head_dims)
    assert ncio.read_record(good)["figures_sha256"] == {"fig.png": ncio.file_sha256(good / "fig.png")}
    for folder, kind in zip(bad, DAMAGE):
        _damage(folder, kind, monkeypatch)
    with pytest.raises(attnum.site.PublishError) as err:
        _guarded(attnum.site.publish)
    assert [b.name for b in bad if b.name not in str(err.value)] == []
    html = "".join(_parse(outputs / "site" / "runs.html").text)
    assert [b.name for b in bad if b.name not in html] == []
    assert (outputs / "site" / STUDY / good.name / "fig.png").read_bytes() == (good / "fig.png").read_bytes()
    assert not (outputs / "site" / STUDY / bad[DAMAGE.index("figure added")].name / "extra.png").exists()


@pytest.mark.parametrize("record", ["bare", "checksummed, no hashes"])
def test_clean_never_recovers_a_planted_unverified_running_folder(outputs, record):
    study = outputs / STUDY
    planted = study / ".smoke.running-999999999-1"
    ncio.write_results(rh.dataset(0.5), planted / "results.nc", study=STUDY, params={}, variables=rh.TABLE)
    if record == "bare":
        (planted / "RUN.json").write_text(json.dumps({"status": "ok"}))
    else:
        ncio.write_record(planted, {"status": "ok"})
    runs.clean()
    assert not (study / "smoke").exists() and not (study / "smoke").is_symlink()
    assert not list(study.glob(f"{runs.store.VERSIONS}/*/recovered-*"))


# -- inputs refused before any work --

ALIASES = ("[&a [1, 1, 1, 1, 1, 1, 1, 1], &b [*a, *a, *a, *a, *a, *a, *a, *a], "
           "&c [*b, *b, *b, *b, *b, *b, *b, *b], &d [*c, *c, *c, *c, *c, *c, *c, *c]]")


def test_yaml_aliases_are_refused_in_values_and_grid_files(tmp_path):
    with pytest.raises(runs.ParameterError, match="aliases"):
        runs.parse_value(ALIASES)
    grid = tmp_path / "grid.yaml"
    grid.write_text(f"seeds: {ALIASES}\n")
    with pytest.raises(runs.ParameterError, match=r"grid\.yaml, line 1: YAML anchors and aliases"):
        runs.parse_grid(str(grid))


def test_deep_nesting_and_undecodable_files_are_refused_by_name(tmp_path):
    with pytest.raises(runs.ParameterError, match="nested more than 32 levels"):
        runs.parse_value("[" * 5000 + "]" * 5000)
    grid = tmp_path / "grid.yaml"
    grid.write_bytes(b"seeds: [0, 1]\n# \xff\xfe\n")
    with pytest.raises(runs.ParameterError, match=r"grid\.yaml: not UTF-8"):
        runs.parse_grid(str(grid))


def test_a_timeout_below_one_second_is_refused(outputs, fake, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["run", STUDY, "--params", "smoke", "--timeout", "-5", "--outputs", str(outputs)])
    assert exit_.value.code == 2 and "--timeout: must be >= 1, got -5" in capsys.readouterr().err
    with pytest.raises(runs.ParameterError, match="timeout must be"):
        runs.run(STUDY, "smoke", timeout=-5, progress=False)
    assert not outputs.exists()


def test_a_key_given_twice_or_both_swept_and_fixed_is_refused(outputs, fake, capsys):
    code = cli.main(["run", STUDY, "--params", "smoke", "-p", "head_dim", "32", "-p", "head_dim", "64",
                     "--outputs", str(outputs), "--no-progress"])
    assert code == 2 and "-p head_dim is given twice" in capsys.readouterr().err
    code = cli.main(["sweep", STUDY, "--params", "smoke", "--grid", "head_dim=32,64", "-p", "head_dim", "16",
                     "--outputs", str(outputs), "--dry-run"])
    assert code == 2 and "head_dim: given both in --grid and with -p" in capsys.readouterr().err
    assert not outputs.exists()


def _as_owner_without_rights(fn):
    """Call ``fn`` as a user whom permissions bind: this one, or (as root, who reads everything) a forked
    child switched to ``nobody``; returns what ``fn`` returned, or the text of what it raised."""
    if os.geteuid() != 0:
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - compared by the test
            return f"raised {type(exc).__name__}: {exc}"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            try:
                out = fn()
            except Exception as exc:  # noqa: BLE001
                out = f"raised {type(exc).__name__}: {exc}"
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as fh:
        data = fh.read()
    os.waitpid(pid, 0)
    return json.loads(data.decode())


def _publish_names(name: str) -> str:
    try:
        attnum.site.publish()
    except attnum.site.PublishError as exc:
        return "PublishError naming it" if name in str(exc) and "cannot be read" in str(exc) else str(exc)
    return "published without naming it"


def test_an_unreadable_run_folder_is_a_named_damaged_run(fake, monkeypatch):
    import shutil
    import tempfile

    scratch = Path(tempfile.mkdtemp(prefix="attnum-unreadable-"))  # outside pytest's 0700 folders
    try:
        scratch.chmod(0o755)
        outputs = scratch / "outputs"
        monkeypatch.setenv("ATTNUM_OUTPUTS", str(outputs))
        good, bad = _sweep_runs(32, 64)
        if os.geteuid() == 0:
            for p in [outputs, *outputs.rglob("*")]:
                os.chown(p, 65534, 65534, follow_symlinks=False)
        os.chmod(bad.resolve(), 0)

        def probe():
            import warnings

            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                merged = ncio.open_study(STUDY)
            return {"merged": merged["head_dim"].values.tolist(),
                    "skipped": sorted(json.loads(merged.attrs["skipped_runs"])),
                    "clean": [line for line in runs.clean() if bad.name in line],
                    "site": [bool(damage and "cannot be read" in damage)  # what publish names as damaged
                             for _, folder, damage in attnum.site.collect._run_folders(outputs) if folder.name == bad.name],
                    "publish": _publish_names(bad.name)}

        monkeypatch.setattr(attnum.site.build, "_sphinx", _quick_sphinx)  # the page build is not what is tested
        out = _as_owner_without_rights(probe)
        assert out == {"merged": [32], "skipped": [bad.name], "clean": [], "site": [True],
                       "publish": "PublishError naming it"}, out
    finally:
        for p in scratch.rglob("*"):
            if not p.is_symlink():
                with contextlib.suppress(OSError):
                    os.chmod(p, 0o755)
        shutil.rmtree(scratch, ignore_errors=True)


def test_clean_removes_the_old_site_a_killed_publish_left(outputs):
    old = outputs / ".site.old-999999999-abcdef"
    (old / "_static").mkdir(parents=True)
    (old / "index.html").write_text("<html></html>")
    removed = runs.clean()
    assert not old.exists() and str(old) in removed


def test_an_outputs_path_that_is_a_file_is_refused(tmp_path, capsys):
    file = tmp_path / "passwd"
    file.write_text("root:x:0:0\n")
    for argv in (["run", STUDY, "--params", "smoke"], ["publish"], ["clean"]):
        with pytest.raises(SystemExit) as exit_:
            cli.main([*argv, "--outputs", str(file)])
        assert exit_.value.code == 2 and f"--outputs: {file} is not a folder" in capsys.readouterr().err
    assert file.read_text() == "root:x:0:0\n"


# -- hangs --

class _Future:
    def __init__(self, key):
        self.key = key

    def done(self):
        return False  # its scheduler is gone: it never finishes


class _LostClient:
    """A client whose scheduler dies once the first run is handed to it (``status`` as distributed sets it)."""

    status = "running"

    class scheduler:  # noqa: N801 - the attribute distributed.Client has
        address = "tcp://127.0.0.1:8786"

    def wait_for_workers(self, n, timeout=None):
        return None

    def nthreads(self):
        return {"w": 1}

    def scheduler_info(self, n_workers=-1):
        return {"workers": {"w": {"nthreads": 1}}, "services": {}}

    def run_on_scheduler(self, fn):
        return False

    def subscribe_topic(self, topic, handler):
        return None

    def unsubscribe_topic(self, topic):
        return None

    def submit(self, *args, key=None, **kwargs):
        self.status = "closed"
        return _Future(key)

    def cancel(self, futures):
        raise RuntimeError("ClosedClientError")


def test_a_lost_scheduler_fails_the_sweep_with_its_summary(outputs):
    from attnum.runs import batch

    tasks = batch.plan_sweep(STUDY, {"head_dim": [32, 64]}, "smoke", {})
    lines = []
    with pytest.raises(batch.BatchError, match="lost the Dask scheduler"):
        _guarded(lambda: batch.run_batch(tasks, outputs=outputs, client=_LostClient(), log=lines.append), 60)
    summary = [line for line in lines if "lost the Dask scheduler" in line or "not started" in line]
    assert summary and not (outputs / STUDY).exists()


# -- clean-results: the run locks held from the check to the last deletion --

def test_clean_results_refuses_a_live_run_and_deletes_nothing(outputs, fake):
    run = runs.run(STUDY, "smoke", progress=False)
    with runs.store.run_lock(outputs / STUDY, "smoke"):
        with pytest.raises(runs.RunLocked, match=f"{STUDY}/smoke"):
            runs.store.clean_results()
    assert ncio.verify_run(run)["status"] == "ok"


def test_a_run_starting_during_clean_results_waits_and_keeps_its_folders(outputs, fake, monkeypatch):
    old = runs.run(STUDY, "smoke", {"head_dim": 32}, progress=False)
    started = {}

    def start_a_run():  # clean_results holds its locks and has not deleted anything yet
        started["thread"] = threading.Thread(target=lambda: started.setdefault(
            "run", runs.run(STUDY, "smoke", {"head_dim": 16}, progress=False)), daemon=True)
        started["thread"].start()

    monkeypatch.setattr(runs.store, "_CLEAN_RESULTS_HOOK", start_a_run)
    removed = runs.store.clean_results()
    started["thread"].join(120)
    assert str(outputs / STUDY) in removed and not os.path.lexists(old)
    new = started["run"]  # made after the deletion: its version folder and record are whole
    assert ncio.verify_run(new)["status"] == "ok"
    assert sorted(p.name for p in (outputs / STUDY).iterdir()) == [".locks", ".versions", new.name]


def test_make_clean_results_deletes_through_the_locked_python_step(outputs, fake, capsys):
    text = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    target = text.split("\nclean-results:", 1)[1].split("\n\n", 1)[0]
    assert "-m attnum clean-results --yes" in target and "git clean" not in target
    runs.run(STUDY, "smoke", progress=False)
    assert cli.main(["clean-results", "--outputs", str(outputs)]) == 2  # --yes is required
    assert (outputs / STUDY / "smoke").exists()
    assert cli.main(["clean-results", "--yes", "--outputs", str(outputs)]) == 0
    assert sorted(p.name for p in outputs.iterdir()) == [runs.store.RUNS_LOCK]


# -- the failure record says why: the kernel's own error, or that the kernel died --

def _raising(exc):
    def execute(input_path, output_path, parameters=None, **kwargs):
        raise exc
    return execute


KERNEL_ERRORS = [
    (papermill.PapermillExecutionError(5, 3, "a = np.ones(10**12)", "MemoryError", "Unable to allocate 7.28 TiB",
                                       ["\x1b[0;31m----\x1b[0m", "\x1b[0;31mMemoryError\x1b[0m: Unable to allocate"]),
     "MemoryError: Unable to allocate 7.28 TiB (notebook cell In [3])"),
    (papermill.PapermillExecutionError(5, 3, "import torch", "CellExecutionError", "", []),  # ulimit -v 1900000
     "the kernel reported CellExecutionError with no message or traceback (notebook cell In [3]); "
     "it may have run out of memory"),
    (papermill.PapermillExecutionError(5, 3, "a = f()", "", "", ["-" * 75, "\x1b[0;31mRecursionError\x1b[0m: deep"]),
     "RecursionError: deep (notebook cell In [3])"),
    (papermill.PapermillExecutionError(5, 3, "a = f()", "", "", []),
     "the kernel reported an error with no message or traceback (notebook cell In [3]); it may have run out of memory"),
]


@pytest.mark.parametrize("exc, error", KERNEL_ERRORS)
def test_a_failed_cell_records_the_kernels_own_error(outputs, fake, monkeypatch, exc, error):
    monkeypatch.setattr(papermill, "execute_notebook", _raising(exc))
    with pytest.raises(runs.RunError) as err:
        runs.run(STUDY, "smoke", progress=False)
    record = ncio.read_record(outputs / STUDY / "smoke.failed")
    assert record["error"] == error and str(err.value).endswith(error)


def test_a_kernel_that_dies_ends_the_run_and_says_so(outputs, monkeypatch, tmp_path):
    import nbformat

    notebook = tmp_path / "99_dies.ipynb"  # a real kernel, killed in its second cell (as a memory limit does)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell("import os, signal\n"
                                                                             "os.kill(os.getpid(), signal.SIGKILL)")]
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    nbformat.write(nb, notebook)
    monkeypatch.setattr(runs.execute, "notebook_path", lambda study: notebook)
    with pytest.raises(runs.RunError):
        _guarded(lambda: runs.run(STUDY, "smoke", progress=False), 300)
    record = ncio.read_record(outputs / STUDY / "smoke.failed")
    assert record["status"] == "failed" and record["error"].startswith("the kernel died: ")


def test_a_run_under_a_small_address_space_limit_is_refused_before_its_kernel_starts(outputs):
    import resource
    import subprocess
    import sys

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # ulimit -v 2097152: below the 3 GiB floor

    proc = subprocess.run([sys.executable, "-m", "attnum", "run", STUDY, "--params", "smoke", "--no-progress",
                           "--outputs", str(outputs)], capture_output=True, text=True, preexec_fn=limit,
                          timeout=600, env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(runs.__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 2, proc.stderr
    assert "address-space limit (ulimit -v) is 2.00 GiB, below the 3 GiB" in proc.stderr
    assert not (outputs / STUDY).exists()


# -- sizes bounded before any work --

def test_a_list_longer_than_its_limit_is_refused_naming_the_parameter(outputs, fake):
    with pytest.raises(runs.ParameterError, match=r"parameter 'seeds' takes at most 4096 entries \(attnum's limit "
                                                  r"for a list parameter\), got 1000000"):
        runs.run(STUDY, "smoke", {"seeds": list(range(1_000_000))}, progress=False)
    assert not outputs.exists()


def test_a_grid_too_large_is_refused_counting_its_points_first(outputs, tmp_path):
    grid = {"batch": list(range(1, 21)), "heads": list(range(1, 21)), "head_dim": list(range(1, 33)),
            "block_q": list(range(1, 33))}  # 20 x 20 x 32 x 32 = 409,600 valid points
    from attnum.runs import batch

    with pytest.raises(runs.ParameterError, match=r"the grid has 409600 points \(20 batch x 32 block_q x "
                                                  r"32 head_dim x 20 heads\), more than the 1024 runs"):
        _guarded(lambda: batch.plan_sweep(STUDY, grid, "smoke", {}), 60)
    file = tmp_path / "grid.yaml"
    file.write_text("".join(f"{k}: {v}\n" for k, v in grid.items()))
    with pytest.raises(runs.ParameterError, match="the grid has 409600 points"):
        _guarded(lambda: runs.parse_grid(str(file)), 60)
    assert not outputs.exists()


# -- your own kernel is checked on the run's device --

CUDA_ONLY = '''
def attention(q, k, v, is_causal=False, attn_mask=None, scale=None):
    if not q.is_cuda:
        raise RuntimeError("this kernel runs on CUDA only")
    import torch.nn.functional as F
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, attn_mask=attn_mask, scale=scale)
'''


@pytest.fixture
def cuda_only_kernel(tmp_path, monkeypatch):
    (tmp_path / "cuda_only_kernel.py").write_text(CUDA_ONLY)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "cuda_only_kernel:attention"


def test_your_own_kernel_is_test_run_on_the_runs_device(cuda_only_kernel, monkeypatch):
    from attnum import kernels

    asked = []
    monkeypatch.setattr(runs.params, "check_device", lambda device: None)  # as if the GPU were there
    monkeypatch.setattr(kernels, "check_runs", lambda kernel, device="cpu", **kw: asked.append(device))
    runs.check_parameters(STUDY, {"device": "cuda", "real_kernels": [cuda_only_kernel]})
    runs.check_parameters(STUDY, {"real_kernels": [cuda_only_kernel], "device": "cuda:1"})
    assert asked == ["cuda", "cuda:1"]


def test_a_cuda_run_on_a_cpu_machine_is_refused_for_its_device_first(outputs, cuda_only_kernel):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(runs.ParameterError, match="'cuda' was asked for but torch sees no CUDA device"):
        runs.run(STUDY, "smoke", {"real_kernels": [cuda_only_kernel], "device": "cuda"}, progress=False)
    with pytest.raises(runs.ParameterError, match="this kernel runs on CUDA only"):  # on the CPU: its own error
        runs.run(STUDY, "smoke", {"real_kernels": [cuda_only_kernel]}, progress=False)
    assert not outputs.exists()


# -- an outputs folder that takes no files --

def test_an_outputs_folder_that_takes_no_files_is_refused(capsys):
    # /proc takes no new files, even from root (for whom os.access says it is writable)
    for argv in (["run", STUDY, "--params", "smoke"], ["clean"], ["publish"]):
        for folder in ("/proc", "/proc/attnum-outputs"):
            with pytest.raises(SystemExit) as exit_:
                cli.main([*argv, "--outputs", folder])
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and f"--outputs: {folder} is not writable by this user (/proc: " in err


# -- JupyterLab: the parameters cell is checked as the runner checks -p --

LAB_STUDY = "late_training_gradient_blowup"


def _lab_namespace(extra_line: str = "") -> dict:
    """What a Lab kernel holds after Run All reaches ``runs.start``: the parameters cell (with one more line)
    executed, its names in the namespace, and IPython's input history ``In``."""
    import nbformat

    nb = nbformat.read(runs.notebook_path(LAB_STUDY), 4)
    cell = next(c.source for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    source = cell + ("\n" + extra_line if extra_line else "")
    namespace = {"In": ["", source, "PARAMS, OUT = runs.start(STUDY, globals())"]}
    exec(compile(source, "<parameters cell>", "exec"), namespace)  # noqa: S102 - the notebook's own cell
    return namespace


def test_a_misspelled_name_in_the_parameters_cell_is_refused_in_lab(outputs):
    with pytest.raises(runs.ParameterError, match=r"the parameters cell assigns 'n_layers' \(did you mean "
                                                  r"'n_layer'\?\), not a parameter of study"):
        runs.start(LAB_STUDY, _lab_namespace("n_layers = 4"))
    assert not outputs.exists()  # refused before the lab folder is made
    params, out = runs.start(LAB_STUDY, _lab_namespace())  # the cell as committed passes
    assert params["n_layer"] == runs.notebook_defaults(LAB_STUDY)["n_layer"] and out.parent == outputs / LAB_STUDY


def test_an_unknown_injected_name_gets_a_did_you_mean(outputs):
    with pytest.raises(runs.ParameterError, match=r"unknown parameter 'n_layers' for study '[a-z_]+' "
                                                  r"\(did you mean 'n_layer'\?\)"):
        runs.check_parameters(LAB_STUDY, {"n_layers": 4})


def test_a_refused_value_shows_in_ipython_as_its_one_message():
    import subprocess
    import sys

    code = ("from IPython.core.interactiveshell import InteractiveShell\n"
            "shell = InteractiveShell.instance(colors='NoColor')\n"
            "shell.run_cell('from attnum import runs\\nruns.check_parameters(\"length_scaling\", {\"head_dim\": 100000})')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              [str(Path(runs.__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")])})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        "ParameterError: parameter 'head_dim': 100000 is out of range; allowed: 1 <= value <= 512"]


# -- the adversarial review's findings not covered above --

_wait_for = rh.wait_for


def test_a_run_stopped_by_sigterm_never_deletes_what_a_planted_failed_link_points_at(outputs, fake, victim,
                                                                                     tmp_path):
    """Finding 1 as reported: the planted ``<run>.failed`` link, then the run stopped with SIGTERM."""
    runs.run(STUDY, "smoke", progress=False)
    failed = outputs / STUDY / "smoke.failed"
    failed.symlink_to(victim)
    before = _tree(victim)
    proc = rh.sigterm_run(outputs, tmp_path)
    assert proc.returncode != 0
    assert _tree(victim) == before
    own = (outputs / STUDY / runs.store.VERSIONS / "smoke").resolve()
    assert failed.resolve().parent == own  # the pointer now names the run's own version, not the victim
    assert ncio.read_record(failed)["status"] == "interrupted"
    assert "SIGTERM" in ncio.read_record(failed)["error"]
    ncio.verify_run(outputs / STUDY / "smoke")  # the earlier run stays


def _quick_sphinx(src, out, doctrees):
    """The site build without Sphinx (what is tested here is the swap into outputs/site)."""
    out.mkdir(parents=True)
    (out / "index.html").write_text(f"<html>{os.getpid()} {id(src)}</html>")


def test_publish_replaces_the_site_in_one_step_so_a_kill_there_leaves_a_site(outputs, fake, monkeypatch):
    """Finding 11: at the moment between the old site leaving and the new one arriving, outputs/site exists
    (renameat2 exchange); where the exchange is missing, the kill leaves .site.old-*, which clean removes."""
    runs.run(STUDY, "smoke", progress=False)
    monkeypatch.setattr(attnum.site.build, "_sphinx", _quick_sphinx)
    attnum.site.publish()
    site = outputs / "site"
    seen = []

    def killed_here(step):
        seen.append((step, (site / "index.html").is_file()))
        raise KeyboardInterrupt(f"killed at {step}")

    monkeypatch.setattr(attnum.site.build, "_SWAP_HOOK", killed_here)
    with pytest.raises(KeyboardInterrupt):
        attnum.site.publish()
    assert seen == [("exchanged", True)] and (site / "index.html").is_file()
    seen.clear()
    monkeypatch.setattr(attnum.site.build, "_exchange", lambda a, b: False)  # a filesystem without renameat2
    with pytest.raises(KeyboardInterrupt):
        attnum.site.publish()
    assert seen == [("old-moved-away", False)]
    (old,) = outputs.glob(".site.old-*")
    removed = runs.clean()
    assert str(old) in removed and not old.exists()
    monkeypatch.setattr(attnum.site.build, "_SWAP_HOOK", None)
    assert attnum.site.publish().is_file()


class _ReconnectingClient(_LostClient):
    """The scheduler was just killed: the client is reconnecting when the user presses Ctrl-C."""

    def submit(self, *args, key=None, **kwargs):
        self.status = "connecting"
        return _InterruptedFuture(key)


class _InterruptedFuture(_Future):
    def done(self):
        raise KeyboardInterrupt  # SIGINT while the batch polls its runs


def test_ctrl_c_after_the_scheduler_died_ends_the_batch_with_its_summary(outputs):
    """Finding 10, SIGINT case: cancel() on the closed client raises (ClosedClientError); Ctrl-C still ends
    the batch as a KeyboardInterrupt, after the summary."""
    from attnum.runs import batch

    tasks = batch.plan_sweep(STUDY, {"head_dim": [32, 64]}, "smoke", {})
    lines = []
    with pytest.raises(KeyboardInterrupt):
        _guarded(lambda: batch.run_batch(tasks, outputs=outputs, client=_ReconnectingClient(), log=lines.append), 60)
    assert [line for line in lines if "interrupted" in line], lines


@pytest.mark.slow
def test_a_real_external_scheduler_killed_mid_sweep_fails_the_batch(outputs, tmp_path, monkeypatch):
    """Finding 10 as reported: ``dask scheduler`` (loopback) and a worker; the scheduler SIGKILLed once a
    run executes; the batch ends (BatchError naming the lost scheduler) instead of looping for ever."""
    import signal
    import subprocess
    import sys
    import time

    from attnum.runs import batch

    monkeypatch.setattr(batch, "SCHEDULER_LOST_S", 5.0)
    sched_file, procs = tmp_path / "scheduler.json", []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "dask", "scheduler", "--host", "127.0.0.1", "--port",
                                       "0", "--no-dashboard", "--scheduler-file", str(sched_file)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        _wait_for(sched_file, procs[0], 60)
        procs.append(subprocess.Popen([sys.executable, "-m", "dask", "worker", "--scheduler-file", str(sched_file),
                                       "--nthreads", "1", "--host", "127.0.0.1", "--no-dashboard"],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        address = json.loads(sched_file.read_text())["address"]
        tiny = {"seq_lens": [16, 32, 64], "dtypes": ["bf16"], "seeds": [0], "block_configs": ["16x16"],
                "attribution_seq_lens": [32]}
        tasks = batch.plan_sweep(STUDY, {"head_dim": [16, 32]}, "smoke", tiny)

        def kill_when_running():
            t0 = time.monotonic()
            while time.monotonic() - t0 < 240:
                if list((outputs / STUDY).glob(".versions/*/*/RUN.json")):
                    procs[0].send_signal(signal.SIGKILL)
                    return
                time.sleep(0.1)

        killer = threading.Thread(target=kill_when_running, daemon=True)
        killer.start()
        lines = []
        t0 = time.monotonic()
        with pytest.raises(batch.BatchError, match="lost the Dask scheduler"):
            _guarded(lambda: batch.run_batch(tasks, outputs=outputs, scheduler=address, progress=False,
                                             log=lines.append), 300)
        assert procs[0].poll() is not None, "the scheduler was never killed"
        assert time.monotonic() - t0 < 240
        assert [line for line in lines if "lost the Dask scheduler" in line or "not started" in line]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(30)


def test_a_native_hang_is_ended_by_timeout_with_a_record_naming_it(outputs, monkeypatch, tmp_path):
    """A cell blocked in native code, with SIGINT blocked (Python's interrupt cannot reach it): ``timeout``
    fails the cell, the kernel is killed, and the failure record says the cell timed out."""
    import time

    import nbformat

    notebook = tmp_path / "99_hangs.ipynb"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("x = 1"), nbformat.v4.new_code_cell(
        "import ctypes, signal\nsignal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})\n"
        "ctypes.CDLL(None).sleep(3600)  # a native call that no interrupt reaches")]
    nb.metadata["kernelspec"] = {"name": "python3", "language": "python", "display_name": "Python 3"}
    nbformat.write(nb, notebook)
    monkeypatch.setattr(runs.execute, "notebook_path", lambda study: notebook)
    t0 = time.monotonic()
    with pytest.raises(runs.RunError) as err:
        _guarded(lambda: runs.run(STUDY, "smoke", progress=False, timeout=3), 300)
    assert time.monotonic() - t0 < 200
    record = ncio.read_record(outputs / STUDY / "smoke.failed")
    assert record["status"] == "failed" and "timed out" in record["error"] and "3 seconds" in record["error"], record
    assert "timed out" in str(err.value)


TOP_LEVEL = '''
import os
open(os.environ["ATTNUM_TEST_MARK"], "w").write("imported")
import torch.nn.functional as F


def attention(q, k, v, is_causal=False, attn_mask=None, scale=None):
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, attn_mask=attn_mask, scale=scale)
'''


def test_your_own_kernels_module_runs_at_the_check_also_under_dry_run(outputs, tmp_path, monkeypatch, capsys):
    """Finding 18: what the README says (importing the module runs its top-level code, also under
    --dry-run) is what happens, and the kernel is test-run on the CPU for a CPU run."""
    (tmp_path / "toplevel_kernel.py").write_text(TOP_LEVEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    mark = tmp_path / "mark"
    monkeypatch.setenv("ATTNUM_TEST_MARK", str(mark))
    code = cli.main(["sweep", STUDY, "--params", "smoke", "--grid", "head_dim=32,64", "-p", "real_kernels",
                     "[toplevel_kernel:attention]", "--outputs", str(outputs), "--dry-run"])
    assert code == 0, capsys.readouterr().err
    assert mark.read_text() == "imported" and not outputs.exists()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert "top-level code at that check, also under `--dry-run`" in readme


def test_the_batchs_own_cluster_listens_on_loopback_only_and_the_readme_recipes_do_too():
    """Finding 19: the LocalCluster run-all and sweep start binds 127.0.0.1; every ``dask scheduler`` line
    of the README binds the loopback interface or requires TLS."""
    import re

    from attnum.runs import batch

    cluster = batch.start_local_cluster(1, 0, dashboard=False)
    try:
        assert cluster.scheduler_address.startswith("tcp://127.0.0.1:"), cluster.scheduler_address
        for info in cluster.scheduler_info["workers"].values():
            assert info["host"] == "127.0.0.1"
    finally:
        cluster.close()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", readme, re.S)
    lines = [line for block in blocks for line in block.splitlines() if re.search(r"dask scheduler\b", line)]
    assert lines
    assert [line for line in lines if "--host 127.0.0.1" not in line and "--protocol tls" not in line] == []


def test_an_undecodable_params_file_and_a_deep_grid_file_are_refused_by_name(outputs, fake, tmp_path):
    """Finding 16: a non-UTF-8 ``--params FILE.yaml`` and a deeply nested grid file."""
    params = tmp_path / "mine.yaml"
    params.write_bytes(b"heads: 1\n# \xff\xfe\n")
    with pytest.raises(runs.ParameterError, match=r"mine\.yaml: not UTF-8"):
        runs.run(STUDY, str(params), progress=False)
    grid = tmp_path / "grid.yaml"
    grid.write_text("head_dim: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(runs.ParameterError, match="nested more than 32 levels"):
        runs.parse_grid(str(grid))
    assert not outputs.exists()


def test_an_outputs_folder_without_write_permission_is_refused(tmp_path):
    """Finding 16: a read-only outputs folder (chmod 555) for a user whom permissions bind: exit 2, one line."""
    import io
    import shutil
    import tempfile
    from contextlib import redirect_stderr

    scratch = Path(tempfile.mkdtemp(prefix="attnum-readonly-"))
    try:
        scratch.chmod(0o755)
        folder = scratch / "outputs"
        folder.mkdir(mode=0o555)
        folder.chmod(0o555)

        def probe():
            out = []
            for argv in (["run", STUDY, "--params", "smoke"], ["clean"], ["publish"]):
                err = io.StringIO()
                try:
                    with redirect_stderr(err):
                        code = cli.main([*argv, "--outputs", str(folder)])
                except SystemExit as exc:
                    code = exc.code
                out.append([code, err.getvalue().strip().splitlines()[-1:]])
            return out

        results = _as_owner_without_rights(probe)
        for code, last in results:
            assert code == 2 and last and f"--outputs: {folder} is not writable by this user" in last[0], results
        assert list(folder.iterdir()) == []
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
