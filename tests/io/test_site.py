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
        real_kind = attnum.site._kind

        def kind(entry):  # the smoke run of study 02 once more as a result, to render a study page
            return "result" if entry["run"] == "as_result" else real_kind(entry)

        shutil.copytree(base / STUDY / "smoke", base / STUDY / "as_result", symlinks=False)
        mp.setattr(attnum.site, "_kind", kind)
        index = attnum.site.publish(base)
    return index


def test_the_site_builds_offline_with_every_kind_of_run(site):
    html = site.read_text()
    assert "01 · Length scaling" in html and "02 · Extreme inputs" in html
    for path in (site.parent).rglob("*.html"):
        text = path.read_text()
        assert not re.search(r"<(script|link)\b[^>]*(src|href)=\"https?://", text), f"{path} loads from the network"
    assert (site.parent / "length_scaling" / "gpu" / "results.nc").exists()
    assert (site.parent / STUDY / "as_result" / "notebook.html").exists()


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
            return text, len(images)

        # the landing page: the five studies in order, question, headline figures (full size on click)
        text, n_images = check_page(index_url)
        titles = page.eval_on_selector_all("article h2", "els => els.map(e => e.textContent.trim())")
        numbers = [t[:2] for t in titles]
        assert numbers == ["01", "02", "03", "04", "05"], titles
        assert text.count("Question.") == 5
        assert n_images == 2  # 01's GPU run and 02's run; the other studies have no result run here
        full_size = page.eval_on_selector_all("article figure a:has(img)", "els => els.map(e => e.href)")
        assert full_size and all(h.endswith(".png") for h in full_size)
        assert "GPU (cuda:0 NVIDIA H200" in text and "Key result" in text
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
        assert len(study_pages) == 4, pages  # 01 gpu, 02 as_result, 02 smoke, 05 failed
        for url in pages:
            check_page(url)

        # a study page: hidden code (openable), parameter table, provenance, table of contents, navigation
        url = (root / STUDY / "as_result" / "notebook.html").as_uri()
        text, n_images = check_page(url)
        assert n_images >= 3
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
    from attnum.site import _device_label

    gathered = {"run": "gpu_training", "provenance": {"device": "cpu AMD EPYC"},
                "record": {"parameters": {"gpu_records": "outputs/lm/records", "device": "cpu"}}}
    assert _device_label(gathered) == "GPU training records, gathered on cpu AMD EPYC"
    cpu = {"run": "default", "provenance": {"device": "cpu AMD EPYC"}, "record": {"parameters": {"device": "cpu"}}}
    assert _device_label(cpu) == "CPU (cpu AMD EPYC)"
    gpu = {"run": "gpu", "provenance": {"device": "cuda:0 NVIDIA H200"}, "record": {"parameters": {}}}
    assert _device_label(gpu).startswith("GPU (cuda:0")


def test_versions_name_the_accelerator_of_a_gpu_run_only():
    import json

    from attnum.site import _versions

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
