#!/usr/bin/env python3
"""Screenshots of the built book for the README: the landing page and one chapter, at 1280 px and 390 px.

Reads ``_build/html`` (build it first: ``python3 dev.py book``) in headless
Chromium, network off, through the browser tests' small DevTools client, and
writes ``docs/<name>-<width>.png``: the top of each page, as a reader first
sees it (one screen at 1280 px, two phone screens at 390 px).

    .venv/bin/python docs/make_screenshots.py
"""
from __future__ import annotations

import argparse
import base64
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "browser"))
from cdp import Browser, find_chromium  # noqa: E402

PAGES = {"landing": "index.html", "chapter": "chapters/09_rank_collapse_metrics.html"}
SIZES = {1280: 900, 390: 1688}  # width: height of the picture, CSS pixels


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--html", type=Path, default=ROOT / "_build" / "html")
    ap.add_argument("--out", type=Path, default=ROOT / "docs")
    ap.add_argument("--pages", nargs="+", default=list(PAGES), choices=list(PAGES))
    a = ap.parse_args(argv)
    binary = find_chromium()
    if binary is None:
        raise SystemExit("no Chromium found (set RR_CHROMIUM, or run `python3 dev.py test` once, which installs it)")
    for width, height in SIZES.items():
        browser = Browser(binary, width=width, height=height)  # the picture is the viewport
        try:
            for name in a.pages:
                page = a.html / PAGES[name]
                if not page.exists():
                    raise SystemExit(f"{page} does not exist: build the book first (python3 dev.py book)")
                tab = browser.open(page.as_uri())
                time.sleep(2.0)  # MathJax and the figures settle
                tab.evaluate("window.scrollTo(0, 0)")
                res = browser.send("Page.captureScreenshot",
                                   {"format": "png", "captureBeyondViewport": False,
                                    "clip": {"x": 0, "y": 0, "width": width, "height": height, "scale": 1}},
                                   session=tab.session)
                out = a.out / f"{name}-{width}.png"
                out.write_bytes(base64.b64decode(res["data"]))
                print(f"{out}: {out.stat().st_size // 1024} kB")
                tab.close()
        finally:
            browser.close()


if __name__ == "__main__":
    main()
