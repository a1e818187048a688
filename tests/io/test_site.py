"""The published site, read in a real browser (headless Chromium through Playwright).

One site is built from: a real smoke run of study 02 (shown once as a result, to render a study page
the way a default run is, and once as a smoke run under "Other runs"), the committed GPU run of study
01, and a failed run. The browser loads the landing page and every page it links to, follows the
navigation, and checks that every figure loads and is visible, that no page shows progress output,
warnings or stderr, that no page asks the network for anything, and what each kind of run looks like.

Skips, saying why, where there is no Chromium (Debian: ``apt-get install chromium``; ``.ci/run``
installs it) or no Playwright. ``$ATTNUM_CHROMIUM`` names another Chromium binary.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import nbformat
import pytest

import attnum.site
from attnum import ncio, runs
from attnum.paths import outputs_root

CHROMIUM = os.environ.get("ATTNUM_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
COMMITTED_GPU = Path(__file__).resolve().parents[2] / "outputs" / "length_scaling" / "gpu"
STUDY = "extreme_inputs"
PROGRESS = re.compile(r"TqdmWarning|IProgress|\d+it/s\]|s/it\]|\d%\|")


# what a reader would see go wrong: the page scrolls sideways, a figure is squashed, a table runs out of the
# column without a scroll bar of its own, table cells without padding
LAYOUT = """() => {
  const art = document.querySelector('article');
  const right = art.getBoundingClientRect().right;
  const scrolls = (t) => { for (let el = t.parentElement; el && el !== art; el = el.parentElement) {
      const o = getComputedStyle(el).overflowX;
      if ((o === 'auto' || o === 'scroll') && el.getBoundingClientRect().right <= right + 1) return true; }
    return false; };
  const overflowing = [...art.querySelectorAll('table')].filter(t => t.getBoundingClientRect().right > right + 1
                                                                 && !scrolls(t)).map(t => t.outerHTML.slice(0, 80));
  const squashed = [...art.querySelectorAll('img')].filter(i => i.naturalWidth && i.width && i.height &&
      Math.abs((i.width / i.height) / (i.naturalWidth / i.naturalHeight) - 1) > 0.02).map(i => i.currentSrc);
  const padding = [...art.querySelectorAll('.cell_output table td')].map(td => parseFloat(getComputedStyle(td).paddingLeft));
  return {page: document.documentElement.scrollWidth, window: window.innerWidth, overflowing, squashed, padding};
}"""


def _browser():
    if not CHROMIUM or not Path(CHROMIUM).exists():
        pytest.skip("no Chromium browser on this machine (Debian: apt-get install chromium; .ci/run installs it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("playwright is not installed (pip install -r requirements.txt)")
    return sync_playwright


def _failed_run(base: Path) -> None:
    """A run that failed in its notebook, as the runner leaves it (``<run>.failed`` with FAILED)."""
    folder = base / "gproj_fix" / "default.failed"
    folder.mkdir(parents=True)
    nb = nbformat.v4.new_notebook(metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                           "language": "python"}})
    code = nbformat.v4.new_code_cell("raise ValueError('fixes must include none')\n# SOURCE-LINE-NOT-AN-ERROR",
                                     execution_count=3)
    code.outputs = [nbformat.v4.new_output("error", ename="ValueError", evalue="fixes must include 'none'",
                                           traceback=["\x1b[0;31mValueError\x1b[0m: fixes must include 'none'"])]
    nb.cells = [nbformat.v4.new_markdown_cell("# 05 · GProj (failed)"), code]
    nbformat.write(nb, folder / "notebook.ipynb")
    (folder / "FAILED").write_text("failed\n")
    ncio.write_record(folder, {"study": "gproj_fix", "name": "default", "param_set": "default", "overrides": {},
                               "parameters": {}, "status": "failed", "started": "2026-01-01T00:00:00+00:00",
                               "error": "PapermillExecutionError: \nException encountered at \"In [3]\":\n"
                                        "raise ValueError('fixes must include none')\n# SOURCE-LINE-NOT-AN-ERROR\n"})


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    base = tmp_path_factory.mktemp("site") / "outputs"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ATTNUM_OUTPUTS", str(base))
        mp.setenv("ATTNUM_PROGRESS", "off")
        assert outputs_root() == base.resolve() or outputs_root() == base
        runs.run(STUDY, "smoke", progress=False)
        (base / "length_scaling").mkdir()
        shutil.copytree(COMMITTED_GPU, base / "length_scaling" / "gpu")
        _failed_run(base)
        real_kind = attnum.site.build._kind

        def kind(entry):  # the smoke run of study 02 once more as a result, to render a study page
            return "result" if entry["run"] == "as_result" else real_kind(entry)

        shutil.copytree(base / STUDY / "smoke", base / STUDY / "as_result", symlinks=False)
        mp.setattr(attnum.site.build, "_kind", kind)
        _report(base)
        real_sphinx = attnum.site.build._sphinx

        def sphinx_while_a_run_finishes(*args):  # a run's files replaced after its snapshot was taken
            gpu = base / "length_scaling" / "gpu"
            (gpu / "results.nc").write_bytes((base / STUDY / "smoke" / "results.nc").read_bytes())
            (gpu / "error_vs_length.png").write_bytes(b"not the run's figure")
            return real_sphinx(*args)

        mp.setattr(attnum.site.build, "_sphinx", sphinx_while_a_run_finishes)
        index = attnum.site.publish(base)
    return index


REPORT = "my_kernel"


def _report(base: Path) -> None:
    """A kernel report as ``python -m attnum report`` leaves it (its notebook and data from the smoke run)."""
    folder = base / "report" / REPORT
    folder.mkdir(parents=True)
    for name in ("notebook.ipynb", "results.nc"):
        shutil.copy2(base / STUDY / "smoke" / name, folder / name)
    (folder / "REPORT.json").write_text(json.dumps({"kernel_names": ["mypkg.attn:forward"], "against": ["sdpa:math"],
                                                    "device": "cpu", "tier": "quick", "overrides": {}}))


def test_the_site_builds_offline_with_every_kind_of_run(site):
    html = site.read_text()
    assert "01 · Length scaling" in html and "02 · Extreme inputs" in html
    for path in (site.parent).rglob("*.html"):
        text = path.read_text()
        assert not re.search(r"<(script|link)\b[^>]*(src|href)=\"https?://", text), f"{path} loads from the network"
    assert (site.parent / "length_scaling" / "gpu" / "results.nc").exists()
    assert (site.parent / STUDY / "as_result" / "notebook.html").exists()
    assert (site.parent / "report" / REPORT / "notebook.html").exists()
    # the sources page the study pages cite (seed 000-004, the papers), linked from the landing page
    sources = (site.parent / "sources.html").read_text()
    assert "Is Flash Attention Stable?" in sources and "arxiv.org/abs/2405.02803" in sources
    assert 'href="sources.html"' in html


def test_a_run_replaced_during_publish_is_published_as_it_was_verified(site):
    """The fixture replaces the GPU run's results.nc and a figure after publish took its snapshot: the site
    holds the files that were verified, the ones RUN.json hashes."""
    record = json.loads((COMMITTED_GPU / "RUN.json").read_text())
    published = site.parent / "length_scaling" / "gpu"
    assert hashlib.sha256((published / "results.nc").read_bytes()).hexdigest() == record["results_sha256"]
    assert (published / "error_vs_length.png").read_bytes() == (COMMITTED_GPU / "error_vs_length.png").read_bytes()


def test_in_a_browser(site):
    sync_playwright = _browser()
    root = site.parent
    index_url = site.as_uri()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        network = []
        page.route(re.compile(r"^https?://"), lambda route: (network.append(route.request.url), route.abort()))
        errors = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))

        def load(url):
            page.goto(url)
            page.wait_for_load_state("load")
            return page

        def check_page(url):
            load(url)
            text = page.inner_text("body")
            assert not PROGRESS.search(text), f"{url} shows progress output or a tqdm warning"
            outputs = " ".join(page.eval_on_selector_all(".cell_output", "els => els.map(e => e.innerText)"))
            assert not re.search(r"\w*Warning\b", outputs), f"{url} shows a warning in a cell's output"
            assert not PROGRESS.search(outputs), f"{url} shows progress output"
            assert page.locator(".output.stderr, .stderr").count() == 0, f"{url} has stderr output areas"
            assert ".versions" not in text, f"{url} shows a staging path"
            images = page.eval_on_selector_all(
                "article img", "els => els.map(e => [e.currentSrc, e.complete && e.naturalWidth > 0])")
            assert all(ok for _, ok in images), f"{url}: figures that did not load: {images}"
            for i in range(page.locator("article img").count()):
                assert page.locator("article img").nth(i).is_visible(), f"{url}: figure {i} is not visible"
            layout = page.evaluate(LAYOUT)
            assert layout["page"] <= layout["window"], f"{url} scrolls sideways ({layout['page']} px)"
            assert layout["squashed"] == [], f"{url}: figures not shown at their aspect ratio {layout['squashed']}"
            assert layout["overflowing"] == [], f"{url}: tables wider than the column, not scrolling inside it"
            assert all(p >= 4 for p in layout["padding"]), f"{url}: output table cells without padding"
            assert not any(page.eval_on_selector_all("details.attnum-empty", "els => els.map(e => e.open)"))
            return text, len(images)

        # the landing page: the five studies in order, question, headline figures (full size on click)
        text, n_images = check_page(index_url)
        titles = page.eval_on_selector_all("article h2", "els => els.map(e => e.textContent.trim())")
        numbers = [t[:2] for t in titles if t[:2].isdigit()]
        assert numbers == ["01", "02", "03", "04", "05"], titles
        assert [t.rstrip("#") for t in titles if not t[:2].isdigit()] == ["Findings", "Kernel reports"], titles
        assert text.count("Question.") == 5
        # one headline figure first, then 01's GPU run and 02's run; the other studies have no result run here
        assert n_images == 3
        first_img = page.locator("article img").first.bounding_box()["y"]
        assert first_img < page.locator("article h2").first.bounding_box()["y"]  # above the findings
        findings = page.eval_on_selector_all("#findings li", "els => els.map(e => e.innerText)")
        # one finding per study whose result run glued its finding's values: 01 (the committed GPU run) and 02
        assert [f[:2] for f in findings] == ["01", "02"], findings
        for finding, (study, run) in zip(findings, [("length_scaling", "gpu"), (STUDY, "as_result")]):
            executed = nbformat.read(root.parent / study / run / "notebook.ipynb", as_version=4)
            template = attnum.site.story._finding_template(nbformat.read(runs.studies()[study], as_version=4))
            glued = attnum.glue.read_glued(executed)
            expected = [format(glued[k], spec) if spec else str(glued[k])
                        for k, spec in attnum.site.story._GLUE_ROLE.findall(template)]
            assert expected and [e for e in expected if e not in finding] == [], (study, expected, finding)
            assert finding.rstrip().endswith(f"run {run})"), finding  # names the run it comes from
        full_size = page.eval_on_selector_all("article figure a:has(img)", "els => els.map(e => e.href)")
        assert full_size and all(h.endswith(".png") for h in full_size)
        assert "GPU (cuda:0 NVIDIA H200" in text and "Finding (run" in text
        assert "mypkg.attn:forward" in text  # the kernel report, listed with its kernels
        assert "No result run of this study is published yet" in text
        assert "05 · GProj" in text and "failed run" in text  # named, not shown as a result
        assert "smoke" in text  # 02's smoke run is named as another run, not a result

        # every page the landing page links to: study pages, other runs, their pages
        links = set(page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"))
        load((root / "runs.html").as_uri())
        links |= set(page.eval_on_selector_all("a[href]", "els => els.map(e => e.href)"))
        pages = sorted({h.split("#")[0] for h in links if h.startswith("file://") and h.split("#")[0].endswith(".html")
                        and "genindex" not in h and "search" not in h})
        study_pages = [p for p in pages if p.endswith("/notebook.html")]
        assert len(study_pages) == 5, pages  # 01 gpu, 02 as_result, 02 smoke, 05 failed, the report
        for url in pages:
            check_page(url)

        # a study page: results first (headline figure, conclusions), then provenance and a folded parameter table
        url = (root / STUDY / "as_result" / "notebook.html").as_uri()
        text, n_images = check_page(url)
        assert n_images >= 3
        heads = page.eval_on_selector_all("article h2", "els => els.map(e => e.textContent.trim().replace(/#$/, ''))")
        assert heads[0] == "Conclusions" and heads.index("Parameters of this run") > 0, heads
        record = json.loads((root.parent / STUDY / "as_result" / "RUN.json").read_text())
        headline = ncio.open_results(root.parent / STUDY / "as_result" / "results.nc").attrs["headline_figure"]
        assert page.locator("article img").first.evaluate("e => e.currentSrc").endswith("/" + headline)
        y = lambda sel: page.locator(sel).first.bounding_box()["y"]  # noqa: E731
        assert y("article img") < y("#conclusions") < y(".admonition.note") < y("#parameters-of-this-run")
        folded = page.locator("details.attnum-params")
        assert folded.count() == 1 and not folded.evaluate("e => e.open")
        bold = folded.evaluate("e => [...e.querySelectorAll('tbody tr')].filter(r => r.cells[1].querySelector("
                               "'strong')).map(r => r.cells[0].textContent.trim())")
        differs = page.locator("#parameters-of-this-run p").first.inner_text()
        named = re.findall(r"(\w+) = ", differs) if differs.startswith("Differs") else []
        assert named == bold and set(bold) <= set(record["parameters"]), (differs, bold)
        assert "Parameters of this run" in text and "Provenance of this run" in text
        assert "git commit" in text and "versions" in text and "created" in text
        # study 02's smoke run has real kernels: the backend each ran as is on its page
        assert "real kernels ran as" in text and "SDPBackend.FLASH_ATTENTION the only backend enabled" in text
        assert page.locator("details.hide.above-input").count() > 0  # MyST-NB hide-input: a closed toggle
        assert not page.locator("details.hide.above-input").first.evaluate("e => e.open")
        toc = page.eval_on_selector_all(".bd-toc a, #bd-toc-nav a", "els => els.map(e => e.textContent.trim())")
        assert any("Conclusions" in t for t in toc), toc
        page.click("text=← 01 · Length scaling")
        page.wait_for_load_state("load")
        assert page.url.endswith("length_scaling/gpu/notebook.html")
        # 01's GPU run was made off the pinned versions: its page says so, naming each difference
        prov = ncio.open_results(COMMITTED_GPU / "results.nc").attrs
        off = attnum.site.off_pins(prov)
        text = page.inner_text("article")
        assert off and "made off the pins" in text
        assert [f"{k} {ran} (pinned {pin})" for k, ran, pin in off if f"{k} {ran} (pinned {pin})" not in text] == []
        assert "02 · Extreme inputs →" in page.inner_text("body")
        page.click("text=↑ All studies")
        page.wait_for_load_state("load")
        assert page.url.endswith("/index.html")

        # the failed run: its error, not its cell source
        load((root / "runs.html").as_uri())
        text = page.inner_text("body")
        assert "ValueError: fixes must include 'none'" in text and "SOURCE-LINE-NOT-AN-ERROR" not in text
        assert "Smoke runs" in text and "Failed runs" in text

        assert not network, f"pages asked the network for {network}"
        assert not errors, f"JavaScript errors: {errors}"
        browser.close()


def test_device_label_names_gathered_gpu_records_and_plain_runs():
    from attnum.site.provenance import _device_label

    gathered = {"run": "gpu_training", "provenance": {"device": "cpu AMD EPYC"},
                "record": {"parameters": {"gpu_records": "outputs/lm/records", "device": "cpu"}}}
    assert _device_label(gathered) == "GPU training records, gathered on cpu AMD EPYC"
    cpu = {"run": "default", "provenance": {"device": "cpu AMD EPYC"}, "record": {"parameters": {"device": "cpu"}}}
    assert _device_label(cpu) == "CPU (cpu AMD EPYC)"
    gpu = {"run": "gpu", "provenance": {"device": "cuda:0 NVIDIA H200"}, "record": {"parameters": {}}}
    assert _device_label(gpu).startswith("GPU (cuda:0")


def test_versions_name_the_accelerator_of_a_gpu_run_only():
    import json

    from attnum.site.provenance import _versions

    packages = json.dumps({"python": "3.12.3", "torch": "2.11.0", "numpy": "2.5", "xarray": "2026.9"})
    gpu = {"torch": "2.11.0+cu130", "cuda": "13.0", "cudnn": "91900", "triton": "3.6.0", "gpu": "NVIDIA H200",
           "gpu_capability": "9.0", "driver": "580.1"}
    text = _versions({"package_versions": packages, "accelerator_versions": json.dumps(gpu)})
    assert text == ("python 3.12.3, torch 2.11.0, numpy 2.5, xarray 2026.9; torch 2.11.0+cu130, cuda 13.0, "
                    "cudnn 91900, triton 3.6.0, driver 580.1")
    cpu = dict(gpu, gpu="none", cuda="none", cudnn="none", driver="none")
    assert _versions({"package_versions": packages, "accelerator_versions": json.dumps(cpu)}) == \
        "python 3.12.3, torch 2.11.0, numpy 2.5, xarray 2026.9"
    assert _versions({"package_versions": packages}) == "python 3.12.3, torch 2.11.0, numpy 2.5, xarray 2026.9"


def test_off_pins_names_each_package_that_differs_from_its_pin():
    from attnum.site import off_pins

    pinned = {"torch": "2.13.0", "numpy": "2.4.6", "python": "3.11", "triton": "3.6.0", "xarray": "2026.9.0"}
    prov = {"package_versions": json.dumps({"python": "3.12.3", "torch": "2.11.0", "numpy": "2.4.6",
                                            "xarray": "2026.9.0", "attnum": "not installed"}),
            "accelerator_versions": json.dumps({"torch": "2.11.0+cu130", "triton": "3.6.0", "gpu": "NVIDIA H200"})}
    assert off_pins(prov, pinned) == [("python", "3.12.3", "3.11"), ("torch", "2.11.0+cu130", "2.13.0")]
    on = {"package_versions": json.dumps({"python": "3.11.7", "torch": "2.13.0+cpu", "numpy": "2.4.6"})}
    assert off_pins(on, pinned) == []
    assert off_pins({}, pinned) == []  # nothing recorded: nothing to compare (the page says "not recorded")


def test_pins_are_read_from_the_requirements_and_the_environment():
    from attnum.site import ROOT, pins

    found = pins()
    lines = [ln.split("#")[0].strip() for ln in (ROOT / "requirements.txt").read_text().splitlines()]
    assert {ln.split("==")[0].lower(): ln.split("==")[1] for ln in lines if "==" in ln}.items() <= found.items()
    assert re.search(rf"python\s*=\s*{re.escape(found['python'])}\b", (ROOT / "environment.yml").read_text())


def test_short_labels_keep_short_names_and_shorten_long_ones_to_set_and_hash():
    from attnum.site import short_label

    assert short_label("gpu") == "gpu"
    long = "gpu__attribution_seeds=0__attribution_seq_lens=1024,8192__block_seeds=0__block_seq_len=4-h5172af6ac6"
    assert short_label(long) == "gpu…h5172af6ac6"
    assert len(short_label("x" * 80)) <= 24 + 1
    assert short_label("x" * 30) != short_label("x" * 29 + "y")  # the tail tells long names apart


def test_a_finding_states_the_runs_values_escaped_and_none_when_the_run_glued_nothing():
    from attnum.site import render_finding

    template = "rejects {glue:text}`a:.0%` of points, on {glue:text}`b`; `code` stays"
    assert render_finding(template, {"a": 0.777, "b": "x<img src=y onerror=alert(1)>`"}) == (
        "rejects 78\\% of points, on x\\<img src\\=y onerror\\=alert\\(1\\)\\>\\`; `code` stays")
    assert render_finding(template, {"a": 0.5}) == "rejects 50\\% of points, on n\\/a; `code` stays"
    assert render_finding(template, {"other": 1}) is None
    assert render_finding("", {"a": 1}) is None


def test_tables_of_only_zeros_or_nan_are_folded_and_others_left_alone():
    import numpy as np
    import pandas as pd

    from attnum.site.pages import _fold_empty_table

    empty = {"output_type": "display_data",
             "data": {"text/html": pd.DataFrame({"a": [0.0, np.nan], "b": [0, 0]}).style.format("{:.2f}").to_html()}}
    _fold_empty_table(empty)
    assert empty["data"]["text/html"].startswith('<details class="attnum-fold attnum-empty"><summary>A table whose 4 ')
    full = {"output_type": "display_data", "data": {"text/html": pd.DataFrame({"a": [0.0, 1e-9]}).to_html()}}
    before = full["data"]["text/html"]
    _fold_empty_table(full)
    assert full["data"]["text/html"] == before


def test_a_parameter_differs_from_its_default_by_value_not_by_spelling():
    import nbformat

    from attnum.site.provenance import _parameter_table

    cell = nbformat.v4.new_code_cell("real_causal: list = [False, True]  # masks\nname: str = 'bf16'  # format\n"
                                     "seeds: list = [0, 1, 2]  # seeds")
    entry = {"record": {"parameters": {"real_causal": [False, True], "name": "bf16", "seeds": [0]}}}
    head = _parameter_table(entry, cell).split("\n\n")[1]
    assert re.findall(r"`(\w+)` = ", head) == ["seeds"]


def test_a_snapshot_lost_to_a_pointer_swap_is_taken_again_from_the_new_version(tmp_path, monkeypatch):
    """A run finishing while publish copies the old version: the pointer moves and the old version goes; the
    copy is made again, whole, from the new version (never half of each)."""
    study = tmp_path / "outputs" / "length_scaling"
    for version, text in (("v1", "old"), ("v2", "new")):
        folder = study / ".versions" / "smoke" / version
        folder.mkdir(parents=True)
        for name in ("RUN.json", "results.nc", "fig.png"):
            (folder / name).write_text(f"{text} {name}")
    (study / "smoke").symlink_to(Path(".versions") / "smoke" / "v1")
    real_copy, calls = attnum.site.collect._copy_plain, []

    def copy_while_the_run_finishes(src, dest, name):
        calls.append(src.name)
        if src.name == "v1" and name == "results.nc":  # the new run swaps the pointer and removes v1
            (study / "smoke").unlink()
            (study / "smoke").symlink_to(Path(".versions") / "smoke" / "v2")
            shutil.rmtree(src)
        return real_copy(src, dest, name)

    monkeypatch.setattr(attnum.site.collect, "_copy_plain", copy_while_the_run_finishes)
    dest = tmp_path / "snapshot" / "length_scaling" / "smoke"
    source = attnum.site.collect._snapshot("length_scaling", study / "smoke", dest)
    assert source.name == "v2" and "v1" in calls
    assert {p.name: p.read_text() for p in dest.iterdir()} == {
        "RUN.json": "new RUN.json", "results.nc": "new results.nc", "fig.png": "new fig.png"}
