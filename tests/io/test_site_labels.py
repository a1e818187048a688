"""The site shows short run labels: a generated GPU run name of ~150 characters (the committed
``gpu__attribution_seeds=0__...-h5172af6ac6``) appears in no table, caption or link text of the landing page
or of "Other runs", only in the links' targets; a name of one's own (--name) is shown whole. And the site
says, where a reader sees it, that its search needs a web server under file://."""
import re
from pathlib import Path

import nbformat
import pytest

import attnum.site as site
from attnum.site import build, pages
from attnum.runs import plan
from attnum.site import short_label

STUDY = "length_scaling"
LONG = ("gpu__attribution_seeds=0__attribution_seq_lens=1024,8192__block_seeds=0__block_seq_len=4096__"
        "causal_seq_len=4096__denominator_seq_lens=4096__fp32_stage_seq_lens=4096-h5172af6ac6")
SWEEP = "smoke__attribution_seq_lens=32__block_configs=16x16__dtypes=bf16@head_dim=16"


def _entry(run: str, kind: str, device: str = "cuda:0 NVIDIA H200 (CUDA 13.0)") -> dict:
    return {"study": STUDY, "run": run, "kind": kind, "record": {"param_set": "gpu", "parameters": {}},
            "provenance": {"device": device, "created": "2026-11-30T10:00:00+00:00", "git_commit": "a" * 40},
            "nb": nbformat.v4.new_notebook(), "headline": "error_vs_length.png", "failed": False}


def _visible(markdown: str) -> str:
    """The text a reader sees: link targets, toctree targets, figure paths and alt texts removed."""
    text = re.sub(r"\]\([^)]*\)", "]", markdown)
    text = re.sub(r"<[^<>\n]*/notebook>", "", text)
    return "\n".join(line for line in text.splitlines() if not line.startswith((":::{figure}", ":alt:")))


def _table_cells(markdown: str) -> list[str]:
    return [cell.strip() for line in markdown.splitlines() if line.startswith("|")
            for cell in re.split(r"(?<!\\)\|", line.strip("|"))]


def test_the_landing_page_shows_a_long_gpu_run_name_by_its_set_and_hash():
    main, long_gpu, named = _entry("default", "result", "cpu"), _entry(LONG, "gpu"), _entry("h200-bf16", "gpu")
    others = [_entry(SWEEP, "sweep", "cpu")]
    md = pages._index_md([STUDY], {STUDY: [main, long_gpu, named]}, {STUDY: main}, {}, [], others)
    seen = _visible(md)
    assert LONG not in seen and SWEEP not in seen
    assert short_label(LONG) in seen and "h200-bf16" in seen  # the hash tells long names apart; a label is whole
    assert f"{STUDY}/{LONG}/notebook.ipynb" in md  # the link still goes to the run's own folder
    cells = _table_cells(seen)
    assert max(len(c) for c in cells) < 60, max(cells, key=len)


def test_other_runs_and_damaged_runs_show_short_labels():
    others = [_entry(SWEEP, "sweep", "cpu"), _entry(LONG, "smoke")]
    damaged = [{"study": STUDY, "run": LONG, "damaged": "results.nc does not match its sha256"}]
    md = pages._runs_md(others, damaged, {STUDY: "01 · Length scaling"})
    seen = _visible(md)
    assert LONG not in seen and SWEEP not in seen
    assert short_label(LONG, 40) in seen and short_label(SWEEP, 40) in seen


@pytest.mark.parametrize("name", ["h200", "default", "x" * plan.MAX_LABEL])
def test_a_name_of_ones_own_is_shown_whole(name):
    assert short_label(name) == name


def test_short_labels_of_the_committed_long_gpu_runs_differ():
    root = Path(__file__).resolve().parents[2] / "outputs" / STUDY
    names = [p.name for p in root.iterdir() if len(p.name) > plan.MAX_LABEL]
    assert len(names) >= 2
    labels = [short_label(n) for n in names]
    assert len(set(labels)) == len(labels) and max(len(x) for x in labels) <= plan.MAX_LABEL + 1


def test_the_landing_page_and_the_search_page_say_search_needs_a_web_server(tmp_path):
    md = pages._index_md([STUDY], {}, {}, {}, [], [])
    assert f"`{site.SERVE_COMMAND}`" in md
    site_src = tmp_path / "src"
    build._build_sources(site_src, [], [])
    assert "templates_path" in (site_src / "conf.py").read_text()
    template = (site_src / "_templates" / "search.html").read_text()
    assert template.startswith('{%- extends "!search.html" %}') and "{{ super() }}" in template
    assert f"<code>{site.SERVE_COMMAND}</code>" in template
