"""The published site renders offline in headless Chromium with its charts and widget views visible.

Chromium is the system's (Debian's `chromium`); run as root (CI) the fixture installs it with apt-get when it is
missing. Without it these tests FAIL with the install instruction; they never skip.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest

from hqlab.notebooks import NOTEBOOKS, REPO, run_notebook
from hqlab.site import SiteError, build_site, external_scripts, site_pages
from hqlab.sitecheck import BrowserMissing, check_page, ensure_chromium, read_png, unfilter

WIDGETS_NOTEBOOK = '''
import altair as alt
import polars as pl
from hqlab.explorer import Explorer
from hqlab.sweep import Trace

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
        return ensure_chromium(install=os.geteuid() == 0)
    except BrowserMissing as e:
        pytest.fail(f"headless Chromium is required for the site tests and could not be obtained: {e}")


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
    kernels = check_page(site / "notebooks" / "kernels.html", chromium)
    assert not kernels.problems(min_charts=1), kernels.problems(min_charts=1)
    widgets = check_page(site / "notebooks" / "widgets.html", chromium)
    assert not widgets.problems(min_charts=1, min_widgets=1), widgets.problems(min_charts=1, min_widgets=1)
    assert all(w.rendered and w.h > 100 for w in widgets.widgets)  # the whole explorer, not a placeholder
    docs = check_page(site / "docs" / "core-benchmark.html", chromium)
    assert not docs.problems(min_charts=3), docs.problems(min_charts=3)
    index = (site / "index.html").read_text()
    assert 'href="notebooks/kernels.html"' in index and "not executed" in index


@pytest.mark.slow
def test_check_fails_when_charts_or_widgets_are_missing(site, chromium, tmp_path):
    # altair's html renderer loads Vega from a CDN: offline its chart region stays blank
    cdn = check_page(site / "notebooks" / "widgets_cdn.html", chromium)
    assert cdn.charts and not all(c.visible for c in cdn.charts)
    assert any("chart" in p for p in cdn.problems(min_charts=1))
    # a page whose chart images were not saved (nbconvert inlines them as data: URIs) has blank chart outputs
    page = site / "notebooks" / "kernels.html"
    stripped = page.with_name("kernels_stripped.html")
    text, n = re.subn(r'<img[^>]*src="data:image/[^"]*"[^>]*>', "", page.read_text())
    assert n >= 1
    stripped.write_text(text)
    assert check_page(stripped, chromium).problems(min_charts=1)
    # without the vendored widget manager the saved widget state is not rendered
    (site / "static" / "embed-amd.js").rename(site / "static" / "embed-amd.js.off")
    try:
        bare = check_page(site / "notebooks" / "widgets.html", chromium)
    finally:
        (site / "static" / "embed-amd.js.off").rename(site / "static" / "embed-amd.js")
    assert bare.widgets and not any(w.rendered for w in bare.widgets)
    assert bare.problems(min_widgets=1)


@pytest.mark.slow
def test_screenshot_pixels_land_where_the_page_draws(chromium, tmp_path):
    page = tmp_path / "box.html"
    page.write_text('<html><body style="margin:0;background:#fff">'
                    '<div style="position:absolute;left:100px;top:300px;width:200px;height:50px;background:#ff0000">'
                    '</div></body></html>')
    shot = tmp_path / "box.png"
    check_page(page, chromium, screenshot=shot)
    px = read_png(shot)
    assert tuple(px[325, 200, :3]) == (255, 0, 0)
    assert tuple(px[325, 90, :3]) == (255, 255, 255) and tuple(px[290, 200, :3]) == (255, 255, 255)


def _encode_png(img: np.ndarray, filters: np.ndarray) -> bytes:
    """Reference PNG encoder with the given per-row filters (predictions from the original bytes)."""
    h, w, c = img.shape
    x = img.astype(np.int16)
    left = np.zeros_like(x)
    left[:, 1:] = x[:, :-1]
    up = np.zeros_like(x)
    up[1:] = x[:-1]
    ul = np.zeros_like(x)
    ul[1:, 1:] = x[:-1, :-1]
    pa, pb, pc = np.abs(up - ul), np.abs(left - ul), np.abs(left + up - 2 * ul)
    paeth = np.where((pa <= pb) & (pa <= pc), left, np.where(pb <= pc, up, ul))
    preds = [np.zeros_like(x), left, up, (left + up) >> 1, paeth]
    rows = []
    for y in range(h):
        rows.append(bytes([int(filters[y])]) + ((x[y] - preds[filters[y]][y]) & 255).astype(np.uint8).tobytes())

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", w, h, 8, {3: 2, 4: 6}[c], 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"".join(rows)))
            + chunk(b"IEND", b""))


@pytest.mark.parametrize("channels", [3, 4])
def test_png_reader_undoes_every_row_filter(tmp_path, channels):
    rng = np.random.default_rng(channels)
    img = rng.integers(0, 256, size=(37, 23, channels), dtype=np.uint8)
    img[5:20, 3:15] = 200  # flat areas make the predictors agree, random ones make them differ
    filters = rng.integers(0, 5, size=37)
    path = tmp_path / "x.png"
    path.write_bytes(_encode_png(img, filters))
    np.testing.assert_array_equal(read_png(path), img)
    with pytest.raises(ValueError, match="row filter"):
        unfilter(np.array([7]), np.zeros((1, 2, 3), dtype=np.uint8))
    path.write_bytes(b"not a png")
    with pytest.raises(ValueError, match="not a PNG"):
        read_png(path)


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
