"""Check that published pages show their charts and widgets, in the system's headless Chromium driven by playwright.

One browser serves a whole run (`SiteChecker`; `check_page` shares one per process). Each page is loaded once from
the file system with every request off the machine refused (the site must work offline): then every chart output
(inline SVG/PNG, a Vega/altair embed, a docs figure) and every widget view is found in the page and photographed on
its own, wherever it sits on the page (no height cut), and a chart counts as visible when enough of its pixels
differ from the background behind it. A chart whose script could not load (a CDN renderer offline), or whose
output was never saved, stays blank or is missing and fails; so does a page that logs a script error or asks the
network for anything.

Chromium comes from the system (`make chromium`: Debian's `chromium` package) or `HQLAB_CHROMIUM`; playwright only
drives it and never downloads a browser here. Screenshots are read with Pillow.
"""

from __future__ import annotations

import atexit
import io
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("run `make chromium` (installs Debian's chromium with apt-get as root), or install Chromium from "
                "your system's packages (Debian/Ubuntu: apt-get install -y chromium), or set HQLAB_CHROMIUM to a "
                "Chromium/Chrome binary")
WIDTH = 1100
HEIGHT = 1200  # the viewport; pages and charts taller than it are photographed in full all the same
MIN_INK = 0.01  # share of a chart region's pixels that must differ from the background
MIN_CHART = 60  # px: the smallest width and height that counts as a chart
LOAD_TIMEOUT_MS = 60_000
RENDER_TIMEOUT_MS = 8_000  # how long widget views and Vega embeds may take to draw after the page loaded
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--disable-quic", "--no-first-run", "--hide-scrollbars",
                 "--allow-file-access-from-files", "--force-device-scale-factor=1"]


class BrowserMissing(RuntimeError):
    pass


def find_chromium() -> str | None:
    env = os.environ.get("HQLAB_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def ensure_chromium(install: bool = False) -> str:
    """The Chromium binary to drive, or BrowserMissing saying how to get one.

    Nothing here installs a browser: `make chromium` does, with the system's package manager. `install` remains
    for callers of the earlier interface and must be False."""
    if install:
        raise ValueError(f"ensure_chromium does not install Chromium: {INSTALL_HINT}")
    env = os.environ.get("HQLAB_CHROMIUM")
    if env and not Path(env).exists():
        raise BrowserMissing(f"HQLAB_CHROMIUM={env} does not exist; {INSTALL_HINT}")
    found = find_chromium()
    if found is None:
        raise BrowserMissing(f"no Chromium found ({', '.join(CHROMIUM_NAMES)} on PATH): {INSTALL_HINT}")
    return found


# Finds the chart and widget outputs, tags each with data-hqlab-region=<index> and returns where they are.
# Chart outputs: image outputs, Vega/altair embeds, and docs figures (<img> in <main> outside notebook outputs).
# A widget view is rendered when the widget manager has put a Lumino widget next to its saved-state script.
_FIND_REGIONS = """() => {
  const items = [];
  function add(el, kind, rendered) {
    const r = el.getBoundingClientRect();
    el.setAttribute('data-hqlab-region', String(items.length));
    items.push({kind: kind, x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height,
                rendered: rendered});
  }
  document.querySelectorAll('.jp-OutputArea-output').forEach(function (el) {
    const mime = el.getAttribute('data-mime-type') || '';
    if (mime.indexOf('image/') === 0 || mime.indexOf('vega') >= 0 ||
        el.querySelector('.vega-embed, [id^="altair-viz"]')) {
      add(el, 'chart', true);
    } else if (el.querySelector('script[type="application/vnd.jupyter.widget-view+json"]')) {
      add(el, 'widget', !!el.querySelector('.lm-Widget'));
    }
  });
  document.querySelectorAll('main img').forEach(function (el) {
    if (!el.closest('.jp-OutputArea-output')) add(el, 'chart', el.complete && el.naturalWidth > 0);
  });
  return {height: document.documentElement.scrollHeight, items: items};
}"""

# True once every widget view is rendered and every Vega embed has drawn (or the wait times out: then the regions
# are measured as they are, and the blank ones fail).
_RENDERED = """() => {
  const views = Array.from(document.querySelectorAll('.jp-OutputArea-output')).filter(
    el => el.querySelector('script[type="application/vnd.jupyter.widget-view+json"]'));
  const embeds = Array.from(document.querySelectorAll('.vega-embed, [id^="altair-viz"]'));
  return views.every(el => el.querySelector('.lm-Widget')) && embeds.every(el => el.querySelector('svg, canvas'));
}"""

# The colour behind an element: the first ancestor with an opaque background (the canvas is white).
_BACKGROUND = """(el) => {
  for (let n = el.parentElement; n; n = n.parentElement) {
    const c = getComputedStyle(n).backgroundColor;
    const m = c.match(/rgba?\\(([^)]*)\\)/);
    if (!m) continue;
    const v = m[1].split(',').map(s => parseFloat(s));
    if (v.length < 4 || v[3] >= 1) return v.slice(0, 3);
  }
  return [255, 255, 255];
}"""


@dataclass
class Region:
    kind: str  # "chart" or "widget"
    x: int
    y: int  # from the top of the page, px
    w: int
    h: int
    rendered: bool  # widgets: the manager replaced the saved-state placeholder; images: the file loaded
    ink: float = 0.0  # share of the region's pixels that differ from the background behind it
    screenshot: Path | None = None  # where its picture was saved (SiteChecker(shots_dir=...))

    @property
    def visible(self) -> bool:
        # A chart is at least MIN_CHART px each way: a failed embed leaves one line of error text, not a chart.
        side = MIN_CHART if self.kind == "chart" else 20
        return self.rendered and self.w >= side and self.h >= side and self.ink >= MIN_INK


@dataclass
class PageCheck:
    page: Path
    height: int
    regions: list[Region] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # script errors, console errors, refused network requests

    @property
    def charts(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "chart"]

    @property
    def widgets(self) -> list[Region]:
        return [r for r in self.regions if r.kind == "widget"]

    def problems(self, *, min_charts: int = 0, min_widgets: int = 0) -> list[str]:
        out = []
        if len(self.charts) < min_charts:
            out.append(f"{self.page.name}: {len(self.charts)} chart(s) found, expected at least {min_charts}")
        if len(self.widgets) < min_widgets:
            out.append(f"{self.page.name}: {len(self.widgets)} widget view(s) found, expected at least {min_widgets}")
        for r in self.regions:
            if not r.visible:
                out.append(f"{self.page.name}: {r.kind} at y={r.y} ({r.w}x{r.h} px) not visible "
                           f"(rendered={r.rendered}, ink={r.ink:.3f})")
        out += [f"{self.page.name}: {e}" for e in self.errors]
        return out


def ink_fraction(pixels: np.ndarray, background: np.ndarray, tolerance: int = 24) -> float:
    """Share of pixels [h, w, 3+] that differ from `background` by more than `tolerance` in some channel."""
    if pixels.size == 0:
        return 0.0
    differs = (np.abs(pixels[..., :3].astype(np.int16) - np.asarray(background, dtype=np.int16)) > tolerance)
    return float(differs.any(axis=-1).mean())


def png_pixels(data: bytes) -> np.ndarray:
    """A PNG (bytes) as an [h, w, 3] uint8 RGB array, decoded by Pillow."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as img:
        return np.asarray(img.convert("RGB"))


class SiteChecker:
    """One headless Chromium for many pages: `with SiteChecker(chromium) as c: c.check(page)`.

    `shots_dir` keeps each region's picture there (`<page>-<index>-<kind>.png`), to look at."""

    def __init__(self, chromium: str | None = None, *, shots_dir: str | Path | None = None) -> None:
        self.chromium = chromium or ensure_chromium()
        self.shots_dir = Path(shots_dir) if shots_dir is not None else None
        self._playwright: Any = None
        self._browser: Any = None

    def __enter__(self) -> SiteChecker:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        if self._browser is not None:
            return
        from playwright.sync_api import sync_playwright

        self._playwright = sync_playwright().start()
        try:
            self._browser = self._playwright.chromium.launch(executable_path=self.chromium, headless=True,
                                                             args=CHROMIUM_ARGS)
        except Exception as e:
            self._playwright.stop()
            self._playwright = None
            raise BrowserMissing(f"could not start {self.chromium}: {e}") from None

    def close(self) -> None:
        if self._browser is not None:
            self._browser.close()
            self._browser = None
        if self._playwright is not None:
            self._playwright.stop()
            self._playwright = None

    def check(self, page: str | Path) -> PageCheck:
        page = Path(page).resolve()
        if not page.is_file():
            raise FileNotFoundError(f"no page to check at {page}")
        self.start()
        context = self._browser.new_context(viewport={"width": WIDTH, "height": HEIGHT}, device_scale_factor=1)
        errors: list[str] = []

        def refuse_network(route: Any) -> None:
            url = route.request.url
            if url.startswith(("file:", "data:", "blob:", "about:")):
                route.continue_()
            else:
                errors.append(f"asks the network for {url} (refused: the site must work offline)")
                route.abort()

        context.route("**/*", refuse_network)
        tab = context.new_page()
        tab.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        tab.on("pageerror", lambda e: errors.append(f"script error: {e}"))
        tab.on("requestfailed", lambda r: errors.append(f"could not load {r.url}: {r.failure}")
               if r.url.startswith("file:") else None)
        try:
            tab.goto(page.as_uri(), wait_until="load", timeout=LOAD_TIMEOUT_MS)
            try:
                tab.wait_for_function(_RENDERED, timeout=RENDER_TIMEOUT_MS)
            except Exception:  # noqa: BLE001 - playwright's TimeoutError: measure what is there
                pass
            layout = tab.evaluate(_FIND_REGIONS)
            regions = []
            for i, item in enumerate(layout["items"]):
                region = Region(item["kind"], round(item["x"]), round(item["y"]), round(item["w"]),
                                round(item["h"]), bool(item["rendered"]))
                if region.w >= 1 and region.h >= 1:
                    self._photograph(tab, page, i, region, errors)
                regions.append(region)
        finally:
            context.close()
        return PageCheck(page, int(layout["height"]), regions, errors)

    def _photograph(self, tab: Any, page: Path, index: int, region: Region, errors: list[str]) -> None:
        element = tab.query_selector(f'[data-hqlab-region="{index}"]')
        try:
            data = element.screenshot(timeout=RENDER_TIMEOUT_MS, animations="disabled", caret="hide")
        except Exception as e:  # noqa: BLE001 - an element that cannot be photographed is not visible
            errors.append(f"{region.kind} at y={region.y}: no screenshot ({str(e).splitlines()[0]})")
            return
        background = np.asarray(element.evaluate(_BACKGROUND), dtype=np.int16)
        region.ink = ink_fraction(png_pixels(data), background)
        if self.shots_dir is not None:
            self.shots_dir.mkdir(parents=True, exist_ok=True)
            region.screenshot = self.shots_dir / f"{page.stem}-{index}-{region.kind}.png"
            region.screenshot.write_bytes(data)


_shared: dict[str, SiteChecker] = {}


def _close_shared() -> None:
    while _shared:
        _shared.popitem()[1].close()


def check_page(page: str | Path, chromium: str) -> PageCheck:
    """Check one page with the process's shared browser for `chromium` (started on first use, closed at exit)."""
    checker = _shared.get(chromium)
    if checker is None:
        if not _shared:
            atexit.register(_close_shared)
        checker = _shared[chromium] = SiteChecker(chromium)
    return checker.check(page)


def check_pages(pages: list[str | Path], chromium: str | None = None, *,
                shots_dir: str | Path | None = None) -> list[PageCheck]:
    """Check several pages with one browser started for them."""
    with SiteChecker(chromium, shots_dir=shots_dir) as checker:
        return [checker.check(p) for p in pages]

