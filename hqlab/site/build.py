"""Publish the executed notebooks and the docs pages as a static HTML site that works with no network.

`hqlab site` (or `make site`) renders every notebook papermill executed (`notebooks/out/*.ipynb`, written by
`hqlab figures`) with nbconvert, renders `docs/*.md`, copies `figures/`, and writes an index page:

    site/index.html            links to every docs page and notebook (notebooks not executed yet are listed as such)
    site/notebooks/<stem>.html charts are inline SVG/PNG outputs; widget views come from the state saved at execution
    site/docs/<page>.html      figures linked as ../figures/<name>
    site/static/               require.js and the Jupyter widgets HTML manager, vendored from npm at build time

nbconvert loads require.js, MathJax and the widget manager from CDNs by default, which leaves a blank page
offline; here each of them points into `static/` (MathJax is not used by these notebooks and is left out). The
two npm packages are pinned by version and sha256 and cached under `$HQLAB_CACHE/site-static/`, so a build
needs npm only once per machine. The site is built next to its final place and swapped in whole: a reader sees
the old site or the new one, never half of one.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hqlab.io import REPO, sha256_file


# npm packages vendored into static/: (package, version, sha256 of the tarball npm packs, files to take).
# The widget manager's major version must match ipywidgets' (8.x ↔ html-manager 1.x).
VENDORED = [
    ("@jupyter-widgets/html-manager", "1.0.15",
     "2b9d65cb7913e1c7d671757a10008b32c9c2448d4429513371e55c07d6107638", "dist/"),
    ("requirejs", "2.3.8", "777158e89275e16bd51aec3ef714fbcb5dc45789e7078659933bc814916d7dec", "require.js"),
]
WIDGET_MANAGER = "embed-amd.js"
SKIPPED = {"embed.js", "libembed-amd.js"}  # the non-AMD and library builds: nbconvert pages load embed-amd.js
REQUIRE_JS = "require.js"


class SiteError(RuntimeError):
    """The site cannot be built; the message says what is missing and how to get it."""


# ------------------------------------------------------------------------------------------------------------
# static files from npm


def static_cache(cache_dir: str | Path | None = None) -> Path:
    from hqlab.models import cache_root

    return cache_root(cache_dir) / "site-static"


def _npm_pack(package: str, version: str, dest: Path) -> Path:
    npm = shutil.which("npm")
    if npm is None:
        raise SiteError("building the offline site needs npm once, to fetch the widget manager and require.js "
                        f"({package}@{version}); install Node.js and npm (Debian: apt-get install -y npm) and "
                        "run again")
    dest.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([npm, "pack", f"{package}@{version}", "--pack-destination", str(dest), "--silent"],
                          capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise SiteError(f"npm pack {package}@{version} failed (exit {proc.returncode}): {proc.stderr.strip()}")
    name = proc.stdout.strip().splitlines()[-1]
    return dest / name


def vendor_static(static_dir: Path, cache_dir: str | Path | None = None) -> list[Path]:
    """Copy the pinned npm files into `static_dir`, fetching each tarball once (checked against its sha256)."""
    cache = static_cache(cache_dir)
    written = []
    for package, version, sha, member in VENDORED:
        tarball = cache / f"{package.lstrip('@').replace('/', '-')}-{version}.tgz"
        if not tarball.exists():
            cache.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=cache) as tmp:  # same file system: the rename is atomic
                os.replace(_npm_pack(package, version, Path(tmp)), tarball)
        got = sha256_file(tarball)
        if got != sha:
            tarball.unlink()
            raise SiteError(f"{package}@{version}: tarball sha256 {got} differs from the pinned {sha}; "
                            "removed it, run again to fetch it anew")
        with tarfile.open(tarball) as tar:
            for info in tar.getmembers():
                rel = info.name.removeprefix("package/")
                if not info.isfile() or not (rel == member or (member.endswith("/") and rel.startswith(member))):
                    continue
                if rel.endswith(".map") or Path(rel).name in SKIPPED:
                    continue
                target = static_dir / Path(rel).name
                target.write_bytes(tar.extractfile(info).read())  # type: ignore[union-attr]
                written.append(target)
    for needed in (WIDGET_MANAGER, REQUIRE_JS):
        if not (static_dir / needed).exists():
            raise SiteError(f"vendored packages did not provide {needed}")
    return written


# ------------------------------------------------------------------------------------------------------------
# pages


@dataclass(frozen=True)
class NotebookPage:
    stem: str
    title: str
    html: str | None  # path relative to the site root; None = not executed yet
    status: str  # "ok", "failed" (an output cell holds an error), "not executed"
    executed_at: str = ""


def notebook_title(nb: Any, fallback: str) -> str:
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("# "):
                    return re.sub(r"[*_`]", "", line[2:]).strip()  # plain text: no markdown emphasis marks
    return fallback


def _has_error(nb: Any) -> bool:
    return any(o.get("output_type") == "error" for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []))


def render_notebook(ipynb: Path, out_html: Path, static_rel: str) -> NotebookPage:
    """One executed notebook → one self-contained HTML page whose scripts all come from `static_rel`."""
    import nbformat
    from nbconvert import HTMLExporter

    try:
        nb = nbformat.read(ipynb, as_version=4)
    except Exception as e:  # nbformat raises several unrelated types for unreadable files
        raise SiteError(f"cannot read executed notebook {ipynb}: {e}") from None
    exporter = HTMLExporter(template_name="lab", require_js_url=f"{static_rel}/{REQUIRE_JS}",
                            widget_renderer_url=f"{static_rel}/{WIDGET_MANAGER}", mathjax_url="",
                            mermaid_js_url="", mermaid_layout_elk_js_url="")
    body, _ = exporter.from_notebook_node(nb)
    out_html.parent.mkdir(parents=True, exist_ok=True)
    out_html.write_text(body, encoding="utf-8")
    pm = nb.metadata.get("papermill", {})
    return NotebookPage(ipynb.stem, notebook_title(nb, ipynb.stem), "", "failed" if _has_error(nb) else "ok",
                        str(pm.get("end_time") or "")[:19].replace("T", " "))


def render_markdown(text: str) -> str:
    """Docs markdown → HTML body; links to other docs pages (`x.md`) become links to their HTML pages."""
    import mistune

    md = mistune.create_markdown(escape=False, plugins=["table", "strikethrough", "url"])
    body = md(text)
    return re.sub(r'href="((?!https?:)[^"#]+)\.md(#[^"]*)?"', lambda m: f'href="{m[1]}.html{m[2] or ""}"', body)


def page(title: str, body: str, *, root: str) -> str:
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f'<link rel="stylesheet" href="{root}static/site.css"></head>\n<body><main>\n'
            f'<nav><a href="{root}index.html">hqlab</a></nav>\n{body}\n</main></body></html>\n')


SITE_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 1em 2em 3em; }
nav { margin-bottom: 1em; font-size: 90%; }
img { max-width: 100%; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: .25em .6em; text-align: left; vertical-align: top; }
code, pre { font-family: ui-monospace, "DejaVu Sans Mono", monospace; font-size: 90%; }
pre { background: #f6f6f6; padding: .6em; overflow-x: auto; }
.status-failed { color: #b00; font-weight: bold; }
.status-missing { color: #888; }
"""


LINKED_FILE_LIMIT = 20 * 2**20  # repo files linked from docs are published up to this size


def _docs_pages(docs_dir: Path, site: Path) -> list[tuple[str, str]]:
    """Render docs/*.md into site/docs/. The site mirrors the repository's layout (docs/, figures/), so a link
    from a page to another repository file (a results table, a notebook source) works once that file is copied
    to the same place in the site."""
    out = []
    repo = docs_dir.resolve().parent
    for md in sorted(docs_dir.glob("*.md"), key=lambda p: (p.stem != "index", p.stem)):
        text = md.read_text(encoding="utf-8")
        title = next((line[2:].strip() for line in text.splitlines() if line.startswith("# ")), md.stem)
        body = render_markdown(text)
        (site / "docs" / f"{md.stem}.html").write_text(page(title, body, root="../"), encoding="utf-8")
        for ref in re.findall(r'(?:src|href)="((?![a-z]+:|#|/)[^"#?]+)', body):
            source = (docs_dir / html.unescape(ref)).resolve()
            target = (site / "docs" / html.unescape(ref)).resolve()
            if (source.is_file() and source.is_relative_to(repo) and target.is_relative_to(site.resolve())
                    and not target.exists() and source.stat().st_size <= LINKED_FILE_LIMIT):
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
        out.append((title, f"docs/{md.stem}.html"))
    return out


def _index(docs: list[tuple[str, str]], notebooks: list[NotebookPage]) -> str:
    rows = []
    for nb in notebooks:
        if nb.html is None:
            cell = f'{html.escape(nb.title)} <span class="status-missing">(not executed: run hqlab figures)</span>'
        else:
            flag = ' <span class="status-failed">(a cell failed)</span>' if nb.status == "failed" else ""
            cell = f'<a href="{nb.html}">{html.escape(nb.title)}</a>{flag}'
        rows.append(f"<tr><td>{cell}</td><td><code>notebooks/{nb.stem}.py</code></td>"
                    f"<td>{html.escape(nb.executed_at)}</td></tr>")
    doc_items = "\n".join(f'<li><a href="{href}">{html.escape(title)}</a></li>' for title, href in docs)
    return page("hqlab", f"""<h1>hqlab: notebooks and results</h1>
<p>Rendered from the executed notebooks (<code>hqlab figures</code>) and the docs pages; this site needs no network.</p>
<h2>Docs</h2>
<ul>
{doc_items}
</ul>
<h2>Notebooks</h2>
<table><tr><th>notebook</th><th>source</th><th>executed</th></tr>
{chr(10).join(rows)}
</table>""", root="")


def build_site(out_dir: Path = REPO / "site", notebooks_dir: Path = REPO / "notebooks" / "out", *,
               docs_dir: Path = REPO / "docs", figures_dir: Path = REPO / "figures",
               sources: list[Path] | None = None, cache_dir: str | Path | None = None,
               progress: bool = True) -> list[NotebookPage]:
    """Build the whole site into `out_dir` (replaced whole at the end). Returns the notebook pages.

    `sources` are the notebook sources the index lists (default: every notebook `hqlab figures` runs); executed
    notebooks in `notebooks_dir` that have no source (e.g. from a parameters file run) are rendered too.
    """
    from tqdm.auto import tqdm

    from hqlab.site.notebooks import notebook_paths

    out_dir, notebooks_dir = Path(out_dir).resolve(), Path(notebooks_dir)
    stems = [p.stem for p in (sources if sources is not None else notebook_paths())]
    executed = {p.stem: p for p in sorted(notebooks_dir.glob("*.ipynb"))} if notebooks_dir.is_dir() else {}
    stems += sorted(set(executed) - set(stems))
    if not executed and not docs_dir.is_dir():
        raise SiteError(f"nothing to publish: no executed notebooks in {notebooks_dir} and no {docs_dir}")

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)  # left by a build that was killed
    for sub in ("static", "notebooks", "docs", "figures"):
        (tmp / sub).mkdir(parents=True)
    try:
        vendor_static(tmp / "static", cache_dir)
        (tmp / "static" / "site.css").write_text(SITE_CSS, encoding="utf-8")
        pages = []
        for stem in tqdm(stems, desc="site", disable=not progress):
            if stem not in executed:
                pages.append(NotebookPage(stem, stem, None, "not executed"))
                continue
            rendered = render_notebook(executed[stem], tmp / "notebooks" / f"{stem}.html", "../static")
            pages.append(NotebookPage(stem, rendered.title, f"notebooks/{stem}.html", rendered.status,
                                      rendered.executed_at))
        if figures_dir.is_dir():
            for fig in figures_dir.iterdir():
                if fig.suffix in (".svg", ".png"):
                    shutil.copy2(fig, tmp / "figures" / fig.name)
        docs = _docs_pages(docs_dir, tmp) if docs_dir.is_dir() else []
        (tmp / "index.html").write_text(_index(docs, pages), encoding="utf-8")
        (tmp / "manifest.json").write_text(json.dumps([p.__dict__ for p in pages], indent=1), encoding="utf-8")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _swap_in(tmp, out_dir)
    return pages


def _swap_in(new: Path, target: Path) -> None:
    old = target.with_name(target.name + ".old")
    if old.exists():
        shutil.rmtree(old)
    if target.exists():
        os.replace(target, old)
    os.replace(new, target)
    shutil.rmtree(old, ignore_errors=True)


def site_pages(site: Path) -> list[Path]:
    """Every HTML page of a built site (index first)."""
    site = Path(site)
    return [site / "index.html", *sorted((site / "notebooks").glob("*.html")), *sorted((site / "docs").glob("*.html"))]


EXTERNAL_SCRIPT = re.compile(r"""<script[^>]*\bsrc\s*=\s*["']?(?:https?:)?//""", re.I)


def external_scripts(html_text: str) -> list[str]:
    """Script tags that would load code from the network (an offline page must have none)."""
    return [m.group(0) for m in EXTERNAL_SCRIPT.finditer(html_text)]
