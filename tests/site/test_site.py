"""The published site renders offline in headless Chromium with its charts and widget views visible.

Chromium is the system's (`make chromium` installs Debian's `chromium`; CI runs it first), driven by playwright.
Where no Chromium is found these tests skip, saying how to install it.
"""

from __future__ import annotations

import base64
import io
import re
from pathlib import Path

import pytest

from hqlab.site.notebooks import NOTEBOOKS, REPO, run_notebook
from hqlab.site import SiteError, build_site, external_scripts, site_pages
from hqlab.site.check import BrowserMissing, SiteChecker, ensure_chromium, png_pixels

WIDGETS_NOTEBOOK = '''
import altair as alt
import polars as pl
from hqlab.site.explorer import Explorer
from hqlab.replay.traces import Trace

alt.renderers.enable("{renderer}")
prompt = [1, 2, 3] + list(range(100, 140))
trace = Trace("copy", "copy", prompt, list(range(100, 130)) + [900, 901], 64)
explorer = Explorer([trace], lambda t: f"w{{t}} ", start="lookup:nmin=2,nmax=8,k=8")
display(explorer.widget)
alt.Chart(pl.DataFrame({{"x": ["a", "b", "c"], "y": [3, 1, 2]}})).mark_bar().encode(x="x:N", y="y:Q")
'''


def _execute_widgets_notebook(out_dir: Path, name: str, renderer: str) -> Path:
    import nbformat
    import papermill

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(f"# Widgets and a chart ({renderer} renderer)"),
                nbformat.v4.new_code_cell(WIDGETS_NOTEBOOK.format(renderer=renderer))]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / f"{name}.ipynb"
    papermill.execute_notebook(nb, str(out), kernel_name="python3", cwd=str(REPO), progress_bar=False)
    return out


@pytest.fixture(scope="module")
def chromium() -> str:
    try:
        return ensure_chromium()
    except BrowserMissing as e:
        pytest.skip(f"the site check needs Chromium: {e}")


@pytest.fixture(scope="module")
def executed(tmp_path_factory) -> Path:
    """Executed notebooks: the real kernels notebook (re-plots committed results, no model), a widget notebook
    with the explorer and an SVG chart, and the same with altair's CDN-loading html renderer."""
    out = tmp_path_factory.mktemp("executed")
    run_notebook(NOTEBOOKS / "kernels.py", {"figures_dir": str(out / "figures")}, out)
    _execute_widgets_notebook(out, "widgets", "svg")
    _execute_widgets_notebook(out, "widgets_cdn", "html")
    return out


@pytest.fixture(scope="module")
def site(executed, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("pub") / "site"
    pages = build_site(site, executed, sources=[NOTEBOOKS / "kernels.py", NOTEBOOKS / "explorer.py"],
                       progress=False)
    status = {p.stem: p.status for p in pages}
    assert status == {"kernels": "ok", "explorer": "not executed", "widgets": "ok", "widgets_cdn": "ok"}
    return site


@pytest.mark.slow
def test_pages_load_nothing_from_the_network(site):
    for page in site_pages(site):
        text = page.read_text()
        assert not external_scripts(text), f"{page.name} loads scripts from the network"
        for ref in re.findall(r'(?:src|href)="((?!https?:|#|data:|mailto:)[^"]+)"', text):
            assert (page.parent / ref.split("#")[0]).exists(), f"{page.name}: broken local link {ref}"


@pytest.mark.slow
def test_charts_and_widgets_are_visible(site, chromium):
    with SiteChecker(chromium) as checker:  # one browser for all the pages
        kernels = checker.check(site / "notebooks" / "kernels.html")
        widgets = checker.check(site / "notebooks" / "widgets.html")
        docs = checker.check(site / "docs" / "core-benchmark.html")
    assert not kernels.problems(min_charts=1), kernels.problems(min_charts=1)
    assert not widgets.problems(min_charts=1, min_widgets=1), widgets.problems(min_charts=1, min_widgets=1)
    assert all(w.rendered and w.h > 100 for w in widgets.widgets)  # the whole explorer, not a placeholder
    assert not docs.problems(min_charts=3), docs.problems(min_charts=3)
    index = (site / "index.html").read_text()
    assert 'href="notebooks/kernels.html"' in index and "not executed" in index


@pytest.mark.slow
def test_check_fails_when_charts_or_widgets_are_missing(site, chromium, tmp_path):
    page = site / "notebooks" / "kernels.html"
    stripped = page.with_name("kernels_stripped.html")
    text, n = re.subn(r'<img[^>]*src="data:image/[^"]*"[^>]*>', "", page.read_text())
    assert n >= 1
    stripped.write_text(text)
    with SiteChecker(chromium) as checker:
        # altair's html renderer loads Vega from a CDN: offline its chart region stays blank, and the request for
        # it is reported
        cdn = checker.check(site / "notebooks" / "widgets_cdn.html")
        # a page whose chart images were not saved (nbconvert inlines them as data: URIs) has blank chart outputs
        bare_charts = checker.check(stripped)
        # without the vendored widget manager the saved widget state is not rendered
        (site / "static" / "embed-amd.js").rename(site / "static" / "embed-amd.js.off")
        try:
            bare = checker.check(site / "notebooks" / "widgets.html")
        finally:
            (site / "static" / "embed-amd.js.off").rename(site / "static" / "embed-amd.js")
    assert cdn.charts and not all(c.visible for c in cdn.charts)
    assert any("chart" in p and "not visible" in p for p in cdn.problems(min_charts=1))
    assert any("asks the network" in e for e in cdn.errors), cdn.errors
    assert bare_charts.charts and not any(c.visible for c in bare_charts.charts)
    assert any("not visible" in p for p in bare_charts.problems(min_charts=1))
    assert bare.widgets and not any(w.rendered for w in bare.widgets)
    assert any("widget" in p and "not visible" in p for p in bare.problems(min_widgets=1))
    assert any("embed-amd.js" in e for e in bare.errors), bare.errors


def _png(width: int, height: int, color: tuple[int, int, int]) -> str:
    """A one-colour PNG as a data: URI (written by Pillow)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _output(mime: str, body: str) -> str:
    return f'<div class="jp-OutputArea-output" data-mime-type="{mime}">{body}</div>'


BARS = ('<svg xmlns="http://www.w3.org/2000/svg" width="400" height="200">'
        '<rect x="20" y="100" width="80" height="100" fill="#4682b4"/>'
        '<rect x="160" y="20" width="80" height="180" fill="#4682b4"/></svg>')


def test_a_chart_far_down_the_page_is_seen_and_a_blank_one_is_reported(chromium, tmp_path):
    """Charts are photographed one by one wherever they are: one 20,000 px down the page (past the 16,000 px a
    full-page screenshot can hold) is seen; a blank image output below it is reported."""
    page = tmp_path / "tall.html"
    page.write_text("<html><body style=\"margin:0;background:#fff\"><main>"
                    '<div style="height:20000px">spacer</div>'
                    + _output("image/svg+xml", BARS)
                    + '<div style="height:3000px"></div>'
                    + _output("image/png", f'<img src="{_png(400, 200, (255, 255, 255))}">')
                    + "</main></body></html>")
    shots = tmp_path / "shots"
    with SiteChecker(chromium, shots_dir=shots) as checker:
        check = checker.check(page)
    assert check.height > 23000 and not check.errors
    deep, blank = sorted(check.charts, key=lambda r: r.y)
    assert deep.y >= 20000 and deep.visible and deep.ink > 0.05
    # the picture is the chart's: its bars where the SVG draws them, the page background beside them
    px = png_pixels(deep.screenshot.read_bytes())
    assert px.shape[1] >= 400 and px.shape[0] >= 200
    assert tuple(px[150, 60]) == (70, 130, 180) and tuple(px[50, 60]) == (255, 255, 255)
    assert blank.y > deep.y + 3000 and blank.h >= 200 and not blank.visible and blank.ink == 0
    assert check.problems() == [f"tall.html: chart at y={blank.y} ({blank.w}x{blank.h} px) not visible "
                                f"(rendered=True, ink=0.000)"]


def test_script_errors_and_network_requests_are_reported(chromium, tmp_path):
    chart = _output("image/svg+xml", BARS)
    clean = tmp_path / "clean.html"
    clean.write_text(f"<html><body><main>{chart}<script>console.log('fine');</script></main></body></html>")
    broken = tmp_path / "broken.html"
    broken.write_text(f"<html><body><main>{chart}"
                      "<script>console.error('boom');</script><script>undefinedFunction();</script>"
                      '<script src="https://cdn.example.invalid/vega.js"></script>'
                      '<script src="missing.js"></script></main></body></html>')
    with SiteChecker(chromium) as checker:
        ok, bad = checker.check(clean), checker.check(broken)
    assert ok.problems(min_charts=1) == []
    assert all(c.visible for c in bad.charts)
    problems = "\n".join(bad.problems(min_charts=1))
    assert "console error: boom" in problems
    assert "script error" in problems and "undefinedFunction" in problems
    assert "asks the network for https://cdn.example.invalid/vega.js" in problems
    assert "could not load file://" in problems and "missing.js" in problems


def test_no_chromium_is_a_clear_error(monkeypatch, tmp_path):
    monkeypatch.setenv("HQLAB_CHROMIUM", str(tmp_path / "no-such-chromium"))
    with pytest.raises(BrowserMissing, match="HQLAB_CHROMIUM=.*does not exist.*make chromium"):
        ensure_chromium()
    with pytest.raises(FileNotFoundError, match="no page to check"):
        SiteChecker("unused").check(tmp_path / "absent.html")


def test_failed_build_keeps_the_previous_site(tmp_path):
    import nbformat

    executed = tmp_path / "executed"
    executed.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# A *small* page"), nbformat.v4.new_code_cell("1 + 1")]
    nbformat.write(nb, executed / "small.ipynb")
    site = tmp_path / "site"
    pages = build_site(site, executed, docs_dir=tmp_path / "no-docs", figures_dir=tmp_path / "no-figures",
                       sources=[], progress=False)
    assert [(p.stem, p.title, p.status) for p in pages] == [("small", "A small page", "ok")]
    before = sorted(p.relative_to(site) for p in site.rglob("*"))
    (executed / "zz_broken.ipynb").write_text("{ not json")
    with pytest.raises(SiteError, match="zz_broken.ipynb"):
        build_site(site, executed, docs_dir=tmp_path / "no-docs", figures_dir=tmp_path / "no-figures",
                   sources=[], progress=False)
    assert sorted(p.relative_to(site) for p in site.rglob("*")) == before
    assert not (tmp_path / "site.tmp").exists()


def test_docs_links_work_in_the_site(tmp_path):
    """Links between docs pages point at their HTML pages; linked repository files are published beside them."""
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "data" / "results").mkdir(parents=True)
    (repo / "data" / "results" / "t.csv").write_text("a,b\n1,2\n")
    (repo / "docs" / "a.md").write_text("# Page A\n\n[table](../data/results/t.csv), [B](b.md#part), "
                                        "[web](https://example.org)\n\n| x | y |\n|---|---|\n| 1 | 2 |\n")
    (repo / "docs" / "b.md").write_text("# Page B\n")
    site = tmp_path / "site"
    build_site(site, repo / "none", docs_dir=repo / "docs", figures_dir=repo / "figures", sources=[],
               progress=False)
    a = (site / "docs" / "a.html").read_text()
    assert 'href="b.html#part"' in a and "<table>" in a and 'href="https://example.org"' in a
    assert (site / "data" / "results" / "t.csv").read_text() == "a,b\n1,2\n"
    index = (site / "index.html").read_text()
    assert 'href="docs/a.html">Page A<' in index and 'href="docs/b.html">Page B<' in index
