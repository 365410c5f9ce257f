"""The HTML report in a real browser: `simulate --report` at 8 GPUs (bars) and 64 GPUs (the
expert load heatmap), rendered by headless Chromium into a full-page screenshot. Skips when
Chromium is absent (CI has none; `apt-get install chromium` on Debian). The content itself
(every section and chart has data) is checked without a browser in tests/test_cli_sim.c.
Set ROUTEPACK_REPORT_SHOTS=DIR to keep the screenshots."""

import json
import os
import shutil
import struct
import subprocess
import zlib

import pytest

from conftest import REPO, SMALL_CONFIG

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")


@pytest.fixture(scope="module")
def browser():
    exe = next((shutil.which(b) for b in BROWSERS if shutil.which(b)), None)
    if exe is None:
        pytest.skip("no Chromium on this machine")
    return exe


def png_pixels(path):
    """(width, height, rows of RGB(A) bytes) of a non-interlaced 8-bit PNG, as Chromium
    writes them."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat, width = 8, b"", 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            assert depth == 8 and colour in (2, 6), "unexpected PNG format"
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    raw, stride, rows, prev = zlib.decompress(idat), width * channels, [], None
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for x in range(stride):  # undo the PNG row filters
            a = line[x - channels] if x >= channels else 0
            b = prev[x] if prev is not None else 0
            c = prev[x - channels] if prev is not None and x >= channels else 0
            if f == 1:
                line[x] = (line[x] + a) & 255
            elif f == 2:
                line[x] = (line[x] + b) & 255
            elif f == 3:
                line[x] = (line[x] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[x] = (line[x] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def screenshot(browser, html, png, height):
    # the browser runs without the sanitizer runtime the ASan test stage preloads
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "ASAN_OPTIONS", "LSAN_OPTIONS",
                                                            "UBSAN_OPTIONS")}
    r = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        "--window-size=1200,%d" % height, "--screenshot=%s" % png, "file://%s" % html],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 0 and os.path.getsize(png) > 0, r.stderr[-2000:]


@pytest.mark.parametrize("gpus", [8, 64])
def test_report_renders(browser, cli, tmp_path, gpus):
    config = json.loads(SMALL_CONFIG.read_text())
    config["topology"]["num_nodes"] = gpus // 8
    (tmp_path / "config.json").write_text(json.dumps(config))
    html = tmp_path / "report.html"
    r = subprocess.run([cli, "simulate", "--config", str(tmp_path / "config.json"), "--gen",
                        str(REPO / "examples" / "gen-small.json"), "--steps", "2", "--report", str(html)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    png = tmp_path / "report.png"
    screenshot(browser, html, png, 5200)
    width, height, channels, rows = png_pixels(png)
    assert (width, height) == (1200, 5200)
    # the page is drawn: many colours, and the content reaches well down the page
    # (a page that failed to render is blank white)
    colours = set()
    last_ink = 0
    for y in range(0, height, 4):
        row = rows[y]
        ink = False
        for x in range(0, width * channels, channels * 3):
            px = row[x:x + 3]
            colours.add(px)
            ink |= px != b"\xff\xff\xff"
        if ink:
            last_ink = y
    assert len(colours) > 50, "the screenshot has %d colours: the page did not render" % len(colours)
    assert last_ink > 2500, "the content stops at %d px" % last_ink
    keep = os.environ.get("ROUTEPACK_REPORT_SHOTS")
    if keep:
        shutil.copy(png, os.path.join(keep, "report-%d-gpus.png" % gpus))
