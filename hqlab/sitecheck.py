"""Check that a published page shows its charts and widgets, by looking at a headless Chromium screenshot.

For each page: Chromium loads it once to report where every chart output (inline SVG/PNG, or a Vega/altair
embed) and every widget view sits, then takes a screenshot of the whole page; a chart counts as visible when
enough of its region differs from the page background. A chart whose script could not load (a CDN renderer
offline) or whose output was never saved leaves that region blank, or leaves no chart at all, and fails.

Chromium comes from the system (Debian: `apt-get install -y chromium`); `ensure_chromium(install=True)` installs
it that way when run as root, and otherwise fails with that instruction. Nothing here downloads a browser build.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
INSTALL_HINT = ("install Chromium from the system's packages (Debian/Ubuntu, as root: apt-get update && "
                "apt-get install -y chromium), or set HQLAB_CHROMIUM to a Chromium/Chrome binary")
WIDTH = 1100
MAX_HEIGHT = 16000  # screenshots taller than this are cut (Chromium's texture limit is ~16k px)
MIN_INK = 0.01  # share of a chart region's pixels that must differ from the background
MIN_CHART = 60  # px: the smallest width and height that counts as a chart


class BrowserMissing(RuntimeError):
    pass


def find_chromium() -> str | None:
    env = os.environ.get("HQLAB_CHROMIUM")
    if env:
        return env if Path(env).exists() else None
    return next((p for p in map(shutil.which, CHROMIUM_NAMES) if p), None)


def install_chromium() -> str:
    """`apt-get install -y chromium` (root only). Returns the binary; raises BrowserMissing with the reason."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BrowserMissing(f"no Chromium found and cannot install it here (needs root and apt-get): {INSTALL_HINT}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "chromium"]):
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
        if proc.returncode != 0:
            raise BrowserMissing(f"{' '.join(cmd)} failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}; "
                                 f"{INSTALL_HINT}")
    found = find_chromium()
    if found is None:
        raise BrowserMissing(f"apt-get installed chromium but no binary is on PATH; {INSTALL_HINT}")
    return found


def ensure_chromium(install: bool = False) -> str:
    found = find_chromium()
    if found:
        return found
    if install:
        return install_chromium()
    raise BrowserMissing(f"no Chromium found: {INSTALL_HINT}")


def _chromium(binary: str, args: list[str], url: str, height: int, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="hqlab-chromium-") as profile:
        cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
               "--hide-scrollbars", "--allow-file-access-from-files", "--force-device-scale-factor=1",
               f"--user-data-dir={profile}", f"--window-size={WIDTH},{height}", "--virtual-time-budget=10000",
               *args, url]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium failed on {url} (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    return proc


# The layout probe: added to a copy of the page, it writes where the chart and widget outputs are into an
# attribute of <html> once the page (and the widget manager, which renders asynchronously) has settled.
_PROBE = """<script>
window.addEventListener('load', function () { setTimeout(function () {
  var items = [];
  function box(el, kind, rendered) {
    var r = el.getBoundingClientRect();
    items.push({kind: kind, x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height,
                rendered: rendered});
  }
  document.querySelectorAll('.jp-OutputArea-output').forEach(function (el) {
    var mime = el.getAttribute('data-mime-type') || '';
    if (mime.indexOf('image/') === 0 || mime.indexOf('vega') >= 0 ||
        el.querySelector('.vega-embed, [id^="altair-viz"]')) {
      box(el, 'chart', true);
    } else if (el.querySelector('script[type="application/vnd.jupyter.widget-view+json"]')) {
      box(el, 'widget', !!el.querySelector('.lm-Widget'));  // the manager adds Lumino widgets next to the script
    }
  });
  document.querySelectorAll('main img').forEach(function (el) {  // docs figures (outputs were counted above)
    if (!el.closest('.jp-OutputArea-output')) box(el, 'chart', el.complete && el.naturalWidth > 0);
  });
  document.documentElement.setAttribute('data-hqlab-layout', JSON.stringify(
    {height: document.documentElement.scrollHeight, items: items}));
}, 4000); });
</script>"""


@dataclass
class Region:
    kind: str  # "chart" or "widget"
    x: int
    y: int
    w: int
    h: int
    rendered: bool  # widgets: the manager replaced the saved-state placeholder; images: the file loaded
    ink: float = 0.0  # share of the region's screenshot pixels that differ from the background

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
    screenshot: Path | None = None

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
        return out


def layout(page: Path, chromium: str) -> tuple[int, list[Region]]:
    """Page height and the chart/widget regions, measured by Chromium in a copy of the page beside it."""
    text = page.read_text(encoding="utf-8")
    probe = text.replace("</body>", _PROBE + "</body>", 1) if "</body>" in text else text + _PROBE
    tmp = page.with_name(f".{page.stem}.hqlab-probe.html")
    try:
        tmp.write_text(probe, encoding="utf-8")
        dom = _chromium(chromium, ["--dump-dom"], tmp.resolve().as_uri(), 1200).stdout
    finally:
        tmp.unlink(missing_ok=True)
    m = re.search(r'data-hqlab-layout="([^"]*)"', dom)
    if not m:
        raise RuntimeError(f"{page}: the layout probe did not run (page scripts failed before load?)")
    import html as _html

    data = json.loads(_html.unescape(m.group(1)))
    regions = [Region(i["kind"], round(i["x"]), round(i["y"]), round(i["w"]), round(i["h"]), bool(i["rendered"]))
               for i in data["items"]]
    return int(data["height"]), regions


def check_page(page: str | Path, chromium: str, *, screenshot: Path | None = None) -> PageCheck:
    page = Path(page).resolve()
    height, regions = layout(page, chromium)
    height = max(200, min(height, MAX_HEIGHT))
    shot = screenshot or Path(tempfile.mkstemp(suffix=".png", prefix="hqlab-shot-")[1])
    _chromium(chromium, [f"--screenshot={shot}"], page.as_uri(), height)
    pixels = read_png(shot)
    background = background_color(pixels)
    for r in regions:
        r.ink = ink_fraction(pixels, background, r.x, r.y, r.w, r.h)
    if screenshot is None:
        shot.unlink(missing_ok=True)
    return PageCheck(page, height, regions, screenshot)


# ------------------------------------------------------------------------------------------------------------
# pixels


def background_color(pixels: np.ndarray) -> np.ndarray:
    """The most common colour of the screenshot (the page background)."""
    flat = pixels[..., :3].reshape(-1, 3).astype(np.int64)
    keys = (flat[:, 0] << 16) | (flat[:, 1] << 8) | flat[:, 2]
    values, counts = np.unique(keys, return_counts=True)
    k = int(values[counts.argmax()])
    return np.array([k >> 16, (k >> 8) & 255, k & 255])


def ink_fraction(pixels: np.ndarray, background: np.ndarray, x: int, y: int, w: int, h: int,
                 tolerance: int = 24) -> float:
    """Share of pixels in the box that differ from `background` by more than `tolerance` in some channel.
    Parts of the box outside the screenshot count as blank."""
    if w <= 0 or h <= 0:
        return 0.0
    box = pixels[max(y, 0): y + h, max(x, 0): x + w, :3].astype(np.int16)
    if box.size == 0:
        return 0.0
    differs = (np.abs(box - background.astype(np.int16)) > tolerance).any(axis=-1)
    return float(differs.sum()) / float(w * h)


def read_png(path: str | Path) -> np.ndarray:
    """Decode an 8-bit RGB/RGBA non-interlaced PNG (what Chromium writes) to an [h, w, channels] uint8 array.

    The five PNG row filters predict each byte from its left, upper and upper-left neighbours, which makes rows
    sequential; decoding along anti-diagonals (every pixel of one diagonal depends only on the two before it)
    vectorizes it with numpy: about h + w steps instead of h * w.
    """
    data = Path(path).read_bytes()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path}: not a PNG file")
    pos, idat, header = 8, [], None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos: pos + 4])
        kind, chunk = data[pos + 4: pos + 8], data[pos + 8: pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", chunk)
        elif kind == b"IDAT":
            idat.append(chunk)
        elif kind == b"IEND":
            break
    if header is None:
        raise ValueError(f"{path}: PNG without a header chunk")
    w, h, depth, color, _, _, interlace = header
    channels = {2: 3, 6: 4}.get(color)
    if depth != 8 or channels is None or interlace:
        raise ValueError(f"{path}: only 8-bit RGB/RGBA non-interlaced PNGs are supported "
                         f"(depth {depth}, colour type {color}, interlace {interlace})")
    raw = np.frombuffer(zlib.decompress(b"".join(idat)), dtype=np.uint8)
    if raw.size != h * (1 + w * channels):
        raise ValueError(f"{path}: image data has {raw.size} bytes, expected {h * (1 + w * channels)}")
    raw = raw.reshape(h, 1 + w * channels)
    return unfilter(raw[:, 0], raw[:, 1:].reshape(h, w, channels))


def unfilter(filters: np.ndarray, data: np.ndarray) -> np.ndarray:
    """Undo PNG row filters: `filters` [h] (0 none, 1 sub, 2 up, 3 average, 4 paeth), `data` [h, w, c] bytes."""
    h, w, c = data.shape
    if filters.size and int(filters.max()) > 4:
        raise ValueError(f"invalid PNG row filter {int(filters.max())}")
    out = np.zeros((h + 1, w + 1, c), dtype=np.int16)  # row 0 / column 0: the zero neighbours outside the image
    data = data.astype(np.int16)
    filt = filters.astype(np.int8)
    for d in range(h + w - 1):
        ys = np.arange(max(0, d - w + 1), min(h, d + 1))
        xs = d - ys
        a, b, cc = out[ys + 1, xs], out[ys, xs + 1], out[ys, xs]
        pa, pb, pc = np.abs(b - cc), np.abs(a - cc), np.abs(a + b - 2 * cc)
        paeth = np.where((pa <= pb) & (pa <= pc), a, np.where(pb <= pc, b, cc))
        f = filt[ys][:, None]
        pred = np.where(f == 1, a, np.where(f == 2, b, np.where(f == 3, (a + b) >> 1,
                                                                  np.where(f == 4, paeth, 0))))
        out[ys + 1, xs + 1] = (data[ys, xs] + pred) & 255
    return out[1:, 1:].astype(np.uint8)
