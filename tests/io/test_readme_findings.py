"""README.md's findings block (``python -m attnum readme-findings``): the headline figure and each study's
one-sentence finding, its numbers glued from the committed run it ends with (``attnum.site.readme_findings``).

The committed README's block is what the committed runs make (a number cannot go stale unnoticed); a finding
whose run lacks a value it states is refused, the key named; data values come out escaped; ``--check`` exits 1
on a stale block, showing what differs.
"""
from __future__ import annotations

import re

import nbformat
import pytest

from attnum import cli, glue, site

ESCAPED_TEMPLATE = "rejects {glue:text}`a:.0%` of points, on {glue:text}`b`; `code` stays."


def _block(text: str) -> str:
    start = text.index(site.README_BEGIN)
    return text[start:text.index(site.README_END, start) + len(site.README_END)] + "\n"


def _glued_notebook(values: dict, finding: str = "", title: str = "# 05 · GProj: a test title") -> nbformat.NotebookNode:
    """A notebook as a run leaves it: each value glued (scrapbook output metadata, what ``glue.read_glued`` reads)."""
    nb = nbformat.v4.new_notebook()
    cell = nbformat.v4.new_code_cell("glue_values(...)")
    cell.outputs = [nbformat.v4.new_output("display_data", data={"text/plain": repr(v)},
                                           metadata={"scrapbook": {"name": k, "mime_prefix": ""}})
                    for k, v in values.items()]
    nb.cells = [nbformat.v4.new_markdown_cell(title), cell]
    if finding:
        nb.metadata["attnum"] = {"finding": finding}
    return nb


def _entry(values: dict, study: str = "gproj_fix", run: str = "gpu") -> dict:
    return {"study": study, "run": run, "kind": "gpu", "nb": _glued_notebook(values), "record": {},
            "provenance": {"git_commit": "0123456789abcdef", "git_dirty": "false", "created": "2026-01-01"},
            "headline": "error_vs_offset.png", "figures": ["error_vs_offset.png"]}


def test_the_committed_readme_block_is_what_the_committed_runs_make():
    text = site.README.read_text(encoding="utf-8")
    assert text.count(site.README_BEGIN) == 1 and text.count(site.README_END) == 1
    assert text.index(site.README_BEGIN) < text.index("\n## ")  # the README opens with it
    block = site.readme_findings()
    assert _block(text) == block  # else: python -m attnum readme-findings, and commit README.md
    runs, tracked = site.committed_runs()
    assert runs and all(f"outputs/{s}/{r.name}/RUN.json" in tracked for s, r in runs)
    figure = re.search(r"!\[[^\]]*\]\(([^)]+)\)", block).group(1)
    assert figure in tracked  # the headline figure is a committed file of a committed run
    stated = [line for line in block.splitlines() if line.startswith("* ") and ": the run glued" not in line]
    assert stated, "no finding stated"
    for line in stated:  # each stated finding ends with its run and commit, and states no blank
        assert re.search(r"\(study `[a-z_]+`, run \[`[^`]+`\]\(outputs/[^)]+/notebook\.ipynb\), commit `[0-9a-f]{7,12}`",
                         line), line
        assert glue.MISSING not in line.replace("\\", "")


def test_a_finding_whose_run_lacks_a_glued_key_is_refused_with_the_key_named():
    template = "error at most {glue:text}`err:.2%` where |μ| ≤ {glue:text}`mu_max:g`."
    assert site.stated_finding(template, {"err": 0.0029, "mu_max": 1000.0}) == (
        "error at most 0\\.29\\% where |μ| ≤ 1000.")
    with pytest.raises(site.FindingError, match="glued no `mu_max`"):
        site.stated_finding(template, {"err": 0.0029})
    with pytest.raises(site.FindingError, match=r"glued `err` as not measured"):
        site.stated_finding(template, {"err": glue.MISSING, "mu_max": 1.0})
    with pytest.raises(site.FindingError, match="states no finding"):
        site.stated_finding("", {"err": 1.0})
    # in the block: the finding is not stated (no "n/a" in its place); the study is named with the key it lacks
    committed = {"gproj_fix": _glued_notebook({}, finding=template)}
    block = site.findings_block([_entry({"err": 0.0029})], committed)
    refused = [line for line in block.splitlines() if line.startswith("* **05 · GProj**")]
    assert len(refused) == 1 and "the run glued no `mu_max`" in refused[0] and "0\\.29" not in block
    assert "**Findings**" not in block and "n/a" not in block


def test_a_planted_markdown_or_html_value_comes_out_escaped():
    md = pytest.importorskip("markdown_it")
    planted = "x`<img src=x onerror=alert(1)>`"
    committed = {"gproj_fix": _glued_notebook({}, finding=ESCAPED_TEMPLATE)}
    block = site.findings_block([_entry({"a": 0.777, "b": planted})], committed)
    line = next(line for line in block.splitlines() if line.startswith("* **05 · GProj**:"))
    assert line.startswith("* **05 · GProj**: rejects 78\\% of points, on x\\`\\<img src\\=x onerror\\=alert\\(1\\)\\>\\`; "
                           "`code` stays. (study `gproj_fix`, run [`gpu`](outputs/gproj_fix/gpu/notebook.ipynb), "
                           "commit `0123456789ab`)"), line
    html = md.MarkdownIt("commonmark").render(block)  # what GitHub's CommonMark makes of it: text, never a tag
    assert "<img src=x" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html
    assert '<img src="outputs/gproj_fix/gpu/error_vs_offset.png"' in html  # the headline figure, a real image


def test_check_exits_nonzero_on_a_stale_block_and_says_what_differs(tmp_path, monkeypatch, capsys):
    readme = tmp_path / "README.md"
    current = site.readme_with_findings(site.README.read_text(encoding="utf-8"), site.readme_findings())
    stale = re.sub(r"(?<=commit `)[0-9a-f]{12}", "0000000fffff", current, count=1)  # a run re-made since
    assert stale != current
    readme.write_text(stale, encoding="utf-8")
    monkeypatch.setattr(site, "README", readme)
    assert cli.main(["readme-findings", "--check"]) == 1
    err = capsys.readouterr().err
    assert "stale" in err and "-" in err and "0000000fffff" in err
    assert readme.read_text(encoding="utf-8") == stale  # --check writes nothing
    assert cli.main(["readme-findings"]) == 0
    assert readme.read_text(encoding="utf-8") == current
    assert cli.main(["readme-findings", "--check"]) == 0


def test_a_readme_without_the_block_gets_it_below_its_title_and_broken_markers_are_refused():
    block = f"{site.README_BEGIN}\n\nbody\n\n{site.README_END}\n"
    assert site.readme_with_findings("# title\n\nintro\n", block) == f"# title\n\n{block}\nintro\n"
    assert site.readme_with_findings(f"# title\n\n{block}\nintro\n", block.replace("body", "new")) == (
        f"# title\n\n{block.replace('body', 'new')}\nintro\n")
    with pytest.raises(site.ReadmeError, match="markers"):
        site.readme_with_findings(f"# title\n\n{site.README_BEGIN}\nintro\n", block)
