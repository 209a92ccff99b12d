"""Read the built book as a reader would: headless Chromium, network off.

Every HTML page under ``_build/html`` is opened from disk (file:// URLs) in
a fresh tab with the network emulated offline and every non-local request
sent to a closed port. A page passes when

* it made no request that leaves the disk (MathJax, require.js and the widget
  manager must come from the book's own ``_static/``, see assets/);
* nothing failed to load and the console shows no error or uncaught exception;
* its math is typeset: each Sphinx math node holds MathJax output, MathJax
  reports no error or undefined macro, and no raw ``$$``, ``\\(``, ``\\[``,
  ``\\begin{`` or reST ``:math:`` is left in the text outside code;
* every ``<img>`` has loaded (``naturalWidth > 0``);
* where the page carries saved widget state, every widget view has rendered
  to widget DOM elements.

A screenshot of each page goes to ``_build/screenshots/`` for review, with a
close-up of each rendered widget.

``python3 dev.py test`` runs this after it has built the book. The tests are
skipped only when no Chromium binary is found (``RR_CHROMIUM`` may name one);
``python3 dev.py setup`` installs Debian's ``chromium`` where it can.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cdp import Browser, find_chromium

ROOT = Path(__file__).resolve().parents[2]
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
TIMEOUT_S = 120  # per page; the shared CI machine can be slow

# Sphinx's search page only shows results for a query typed into it; it has
# no content of its own to check. Every other page is read.
SKIP = {"search.html"}


def _pages() -> list[str]:
    if not HTML.exists():
        return []
    return sorted(str(p.relative_to(HTML)) for p in HTML.rglob("*.html")
                  if p.relative_to(HTML).parts[0] not in {"_static", "_sources", "_images"}
                  and str(p.relative_to(HTML)) not in SKIP)


# Runs in the page once it has loaded: waits for MathJax's first typeset, for
# the widget manager and for the images, then reports what a reader would see.
INSPECT = r"""
(async () => {
  const sleep = ms => new Promise(r => setTimeout(r, ms));
  const deadline = Date.now() + %(timeout_ms)d;
  const mathNodes = [...document.querySelectorAll('.math')];

  // MathJax: present on pages with math; its deferred script has run by the
  // load event, so a short wait is enough; then wait for the first typeset.
  const mjDeadline = Math.min(deadline, Date.now() + 5000);
  while (mathNodes.length && !(window.MathJax && MathJax.startup && MathJax.startup.promise)
         && Date.now() < mjDeadline) await sleep(100);
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;

  // Widgets: one view script per displayed widget; the manager renders each
  // into a sibling element after the page's load event.
  const views = [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')];
  const hasState = document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]') !== null;
  const rendered = s => {
    const box = s.parentElement;
    const w = box && box.querySelector('.jupyter-widgets, .widget-subarea > *, .lm-Widget');
    return !!w && w.getBoundingClientRect().height > 0;
  };
  // (No wait when the manager never loaded: nothing would render.)
  while (hasState && window.require && views.some(s => !rendered(s)) && Date.now() < deadline)
    await sleep(200);
  if (window.MathJax && MathJax.typesetPromise && hasState) await MathJax.typesetPromise();

  // Images: load lazy ones too, then wait for every decode to settle.
  for (const img of document.images) img.loading = 'eager';
  await Promise.all([...document.images].map(img => img.decode().catch(() => null)));
  await sleep(300);  // let late errors reach the console

  // Text a reader sees, outside code and outside MathJax's own output.
  const skip = 'pre, code, kbd, samp, script, style, textarea, mjx-container, .highlight, .MathJax';
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  const rawTex = [];
  const pattern = /\$\$|\\\(|\\\)|\\\[|\\\]|\\begin\{|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$|:math:|\.\. math::/;
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (n.parentElement && n.parentElement.closest(skip)) continue;
    const m = n.textContent.match(pattern);
    if (m) rawTex.push(n.textContent.trim().slice(0, 120));
  }
  return {
    title: document.title,
    textLength: document.body.innerText.trim().length,
    mathNodes: mathNodes.length,
    mathUntypeset: mathNodes.filter(e => !e.querySelector('mjx-container'))
                             .map(e => e.textContent.trim().slice(0, 80)),
    // A TeX error becomes <mjx-merror data-mjx-error=...>; an undefined macro
    // is drawn in red (CHTML glyphs have no text; the hidden MathML does).
    mathErrors: [...document.querySelectorAll('mjx-merror')]
      .map(e => 'TeX error: ' + (e.getAttribute('data-mjx-error') || e.textContent).slice(0, 80))
      .concat([...document.querySelectorAll('mjx-container')]
        .filter(c => c.querySelector('mjx-mtext[style*="color: red"]'))
        .map(c => 'undefined macro: ' + ([...c.querySelectorAll('mtext[mathcolor="red"]')]
          .map(e => e.textContent).join(' ') || '(red text in formula)'))),
    mjxContainers: document.querySelectorAll('mjx-container').length,
    // Display equations wider than their column (the window is 1280 px wide):
    // a reader would have to scroll them sideways.
    mathTooWide: [...document.querySelectorAll('mjx-container[display="true"]')].filter(c => {
      const inner = c.firstElementChild, box = c.parentElement;
      return inner && box && inner.getBoundingClientRect().width > box.getBoundingClientRect().width + 1;
    }).map(c => (c.textContent || '').slice(0, 60)),
    rawTex,
    images: [...document.images].map(i => ({src: i.getAttribute('src'), ok: i.complete && i.naturalWidth > 0})),
    widgetState: hasState,
    widgetViews: views.length,
    widgetsNotRendered: views.filter(s => !rendered(s)).length,
    widgetElements: document.querySelectorAll('.jupyter-widgets').length,
    // Where each rendered widget sits on the page, for a close-up screenshot.
    widgetBoxes: views.filter(rendered).map(s => {
      const r = s.parentElement.getBoundingClientRect();
      return {x: r.left + window.scrollX, y: r.top + window.scrollY, width: r.width, height: r.height};
    }),
  };
})()
"""


@pytest.fixture(scope="module")
def browser():
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium binary on PATH (install Debian's `chromium`, or set "
                    "RR_CHROMIUM); `python3 dev.py setup` installs it when run as root with apt-get")
    b = Browser(binary)
    yield b
    b.close()


def test_book_is_built():
    assert (HTML / "index.html").exists(), (
        f"no built book at {HTML}: run `python3 dev.py book` (or `python3 dev.py test`, "
        "which builds it before this test)")
    assert _pages(), f"no HTML pages under {HTML}"


def _redirect(page: str) -> str | None:
    """Target of a ``<meta http-equiv="refresh">`` page (the root index.html)."""
    m = re.search(r'http-equiv="refresh"[^>]*url=([^"]+)"', (HTML / page).read_text(), re.I)
    return m.group(1).strip() if m else None


@pytest.mark.parametrize("page", _pages())
def test_page_reads_offline(browser, page):
    target = _redirect(page)
    if target is not None:  # nothing to render; the page it sends readers to is tested
        assert (HTML / page).parent.joinpath(target).is_file(), f"{page} redirects to missing {target}"
        return
    tab = browser.open((HTML / page).as_uri(), timeout=TIMEOUT_S)
    try:
        info = tab.evaluate(INSPECT % {"timeout_ms": TIMEOUT_S * 1000}, timeout=TIMEOUT_S + 30)
        stem = page.removesuffix(".html").replace("/", "__")
        tab.screenshot(SHOTS / f"{stem}.png")
        for i, box in enumerate(info["widgetBoxes"]):  # widgets further down than the cut
            tab.screenshot_region(SHOTS / f"{stem}__widget{i}.png", box)
        errors = tab.console_errors()
        failed = tab.failed_loads()
        external = tab.external_requests()
    finally:
        tab.close()

    problems = []
    if info["textLength"] == 0:
        problems.append("the page shows no text")
    if external:
        problems.append(f"requests leaving the disk (served from a CDN?): {external}")
    if failed:
        problems.append(f"resources that did not load: {failed}")
    if errors:
        problems.append(f"console errors: {errors}")
    if info["mathNodes"] and not info["mjxContainers"]:
        problems.append(f"{info['mathNodes']} math nodes and no MathJax output (is MathJax loaded?)")
    if info["mathUntypeset"]:
        problems.append(f"math left as TeX: {info['mathUntypeset'][:5]}")
    if info["mathErrors"]:
        problems.append(f"MathJax errors: {info['mathErrors'][:5]}")
    if info["mathTooWide"]:
        problems.append(f"display equations wider than the text column: {info['mathTooWide'][:5]}")
    if info["rawTex"]:
        problems.append(f"raw TeX delimiters in the text: {info['rawTex'][:5]}")
    broken = [i["src"] for i in info["images"] if not i["ok"]]
    if broken:
        problems.append(f"images that did not load: {broken}")
    if info["widgetState"] and info["widgetsNotRendered"]:
        problems.append(f"{info['widgetsNotRendered']} of {info['widgetViews']} widgets did not "
                        "render from the saved state")
    summary = {k: info[k] for k in ("title", "mathNodes", "mjxContainers", "widgetViews",
                                     "widgetElements")} | {"images": len(info["images"])}
    assert not problems, f"{page} ({json.dumps(summary)}):\n  " + "\n  ".join(problems)
