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
  to widget DOM elements, and is honest without a kernel: its controls are
  switched off and a note sits at the widget (assets/static/rr-widgets-offline.js);
* every kernel-free explorer (chapters/_book.py) shows another frame when a
  slider moves;
* no script larger than 500 kB blocks the first paint (a classic script
  without ``async``/``defer`` before the article);
* one search box;
* no table is broken: no paragraph of the text starts with ``|`` (a Markdown
  table that did not parse), and every row of a table has as many cells as
  its header (colspans counted);
* at 1280 px every visible code block and output fits its column (code is
  at most 80 characters a line, outputs wrap), and no word in a table is
  broken over two lines;
* every local link leads to a file that exists, and every ``#anchor`` to an
  element of that page (the PDF link included: it is there only where the
  PDF is);
* at a phone's width (390 px) the page does not scroll sideways, no word in
  a table is broken over two lines, and no equation number is drawn over its
  equation;
* on the pages listed in ``strict_pages.txt``: every image of the text is in
  a figure with a caption, has alt text that says something (not a file name
  or a hash) and is not shrunk below 3/4 of the width it was drawn for.

A screenshot of each page goes to ``_build/screenshots/`` for review, with a
close-up of each rendered widget, and one at 390 px under ``phone/``.

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
BLOCKING_LIMIT = 500_000  # bytes: the largest script allowed to hold back the first paint
PHONE_WIDTH = 390
STRICT = {line.strip() for line in (Path(__file__).parent / "strict_pages.txt").read_text().splitlines()
          if line.strip() and not line.startswith("#")}

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
%(checks)s
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
    links: [...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))
      .filter(h => !/^(https?:|mailto:|javascript:|data:)/i.test(h)),
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
    // Without a kernel a widget's controls must be off, with a note at it.
    widgetsLive: views.map(s => {
      const box = s.parentElement;
      const controls = [...box.querySelectorAll(
        'input, select, textarea, button, .noUi-target, [contenteditable="true"]')];
      const live = controls.filter(c => !(c.disabled || c.hasAttribute('disabled')));
      return {note: !!box.querySelector('.rr-widget-note'),
              live: live.map(c => c.tagName + '.' + (c.className || '').toString().slice(0, 40))};
    }).filter(w => !w.note || w.live.length),
    // Classic scripts without async/defer before the article hold back the first paint.
    blockingScripts: (() => {
      const article = document.querySelector('article') || document.body.lastElementChild;
      return [...document.scripts].filter(sc => sc.src && !sc.async && !sc.defer
        && (!sc.type || /javascript/.test(sc.type))
        && (sc.compareDocumentPosition(article) & Node.DOCUMENT_POSITION_FOLLOWING))
        .map(sc => sc.src);
    })(),
    rawTables: rawTables(),
    unevenTables: unevenTables(),
    wideCode: wideCode(),
    brokenWords: brokenWords(),
    searchBoxes: [...document.querySelectorAll('.search-button-field, input[name="q"]')]
      .filter(e => e.offsetParent !== null && e.getBoundingClientRect().width > 0).length,
    // Every image of the text: caption, alt text, shown at the size drawn for.
    figures: (() => {
      const article = document.querySelector('article.bd-article');
      if (!article) return [];
      const column = article.getBoundingClientRect().width;
      return [...article.querySelectorAll('img')].map(img => {
        const fig = img.closest('figure');
        const cap = fig && fig.querySelector('figcaption, .caption');
        // The width it was drawn for: a retina PNG says so in its style or width.
        const px = v => v && /^\d+(\.\d+)?(px)?$/.test(v) ? parseFloat(v) : 0;
        const drawn = px(img.style.width) || px(img.getAttribute('width')) || img.naturalWidth;
        return {src: (img.getAttribute('src') || '').slice(0, 80), alt: img.getAttribute('alt') || '',
                caption: !!(cap && cap.textContent.trim()), hidden: !!img.closest('[hidden]'),
                width: img.getBoundingClientRect().width, drawn, column};
      });
    })(),
  };
})()
"""

# Shared by INSPECT and PHONE: checks of what a reader sees in tables and code.
CHECKS = r"""
  // A paragraph of the text that begins with '|': a table that did not parse.
  // (Its own text: a paragraph may open with a formula such as |x|, which is not a table.)
  const ownText = el => {
    const w = document.createTreeWalker(el, NodeFilter.SHOW_TEXT);
    let s = '';
    for (let n = w.nextNode(); n; n = w.nextNode())
      if (!n.parentElement.closest('mjx-container, .MathJax, .math, code')) s += n.textContent;
    return s.trim();
  };
  const rawTables = () => [...document.querySelectorAll('article p')]
    .filter(p => !p.closest('pre, code, .highlight'))
    .map(ownText).filter(t => /^\|.*\|/.test(t) && (t.match(/\|/g) || []).length >= 3)
    .map(t => t.slice(0, 80));
  // Rows with a different number of cells from the header's (colspans counted).
  const unevenTables = () => [...document.querySelectorAll('article table')].filter(t => {
    const counts = [...t.rows].map(r => [...r.cells].reduce((n, c) => n + (c.colSpan || 1), 0));
    return counts.length && new Set(counts).size > 1 && !t.querySelector('[rowspan]');
  }).map(t => (t.rows[0] ? t.rows[0].textContent : '').trim().replace(/\s+/g, ' ').slice(0, 60));
  // Visible code and output blocks wider than their box (a reader scrolls, or misses the end).
  const wideCode = () => [...document.querySelectorAll('article div.highlight pre, article div.cell_output pre')]
    .filter(pre => pre.offsetParent !== null && pre.getBoundingClientRect().height > 0
            && pre.scrollWidth > pre.clientWidth + 1)
    .map(pre => `${pre.scrollWidth}>${pre.clientWidth}px: ` + pre.textContent.split('\n')
      .reduce((a, b) => b.length > a.length ? b : a, '').trim().slice(0, 70));
  // A word of a table cell drawn on two lines ("Introductio / n").
  const brokenWords = () => {
    const out = [];
    for (const cell of document.querySelectorAll('article table td, article table th')) {
      if (cell.offsetParent === null) continue;
      const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
      for (let n = walker.nextNode(); n && out.length < 10; n = walker.nextNode()) {
        if (n.parentElement.closest('mjx-container, .MathJax')) continue;
        const re = /\S{4,}/g;
        for (let m; (m = re.exec(n.textContent)) !== null;) {
          const r = document.createRange();
          r.setStart(n, m.index); r.setEnd(n, m.index + m[0].length);
          const tops = new Set([...r.getClientRects()].filter(x => x.width > 0).map(x => Math.round(x.top)));
          if (tops.size > 1 && !/[-\/_.,]/.test(m[0])) out.push(m[0]);
        }
      }
    }
    return out;
  };
  // An equation number drawn over its equation (at a phone's width).
  const eqnoOverlaps = () => [...document.querySelectorAll('div.math')].filter(d => {
    const no = d.querySelector('span.eqno'), eq = d.querySelector('mjx-container');
    if (!no || !eq) return false;
    const a = no.getBoundingClientRect(), b = eq.getBoundingClientRect();
    return a.width > 0 && a.left < b.right && b.left < a.right && a.top < b.bottom && b.top < a.bottom;
  }).map(d => d.querySelector('span.eqno').textContent.trim());
"""

# Moves every slider of every kernel-free explorer and reports the ones whose
# visible frame did not change.
EXPLORE = r"""
(() => {
  const shown = root => [...root.querySelectorAll('img[data-rr-key]')].filter(i => !i.hidden)
    .map(i => i.getAttribute('data-rr-key'));
  const stuck = [];
  document.querySelectorAll('.rr-explorer').forEach((root, k) => {
    root.querySelectorAll('input[data-rr-dim]').forEach(s => {
      const before = shown(root).join();
      const old = +s.value;
      s.value = old > +s.min ? old - 1 : old + 1;
      s.dispatchEvent(new Event('input', {bubbles: true}));
      const after = shown(root);
      if (after.length !== 1 || after[0] === before) stuck.push(`explorer ${k}, slider ${s.dataset.rrDim}`);
      s.value = old;
      s.dispatchEvent(new Event('input', {bubbles: true}));
    });
  });
  return {explorers: document.querySelectorAll('.rr-explorer').length, stuck};
})()
"""

# At a phone's width: what sticks out of the page (text that does not wrap).
PHONE = r"""
(async () => {
%(checks)s
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) await MathJax.startup.promise;
  const W = document.documentElement.clientWidth;
  const scrolls = e => { for (let p = e.parentElement; p; p = p.parentElement) {
    const o = getComputedStyle(p).overflowX; if (o === 'auto' || o === 'scroll' || o === 'hidden') return true; }
    return false; };
  const wide = [...document.body.querySelectorAll('*')].filter(e => !e.children.length
    && e.getBoundingClientRect().right > W + 1 && !scrolls(e))
    .slice(0, 5).map(e => `${e.tagName.toLowerCase()}.${e.className}: ${(e.textContent || '').trim().slice(0, 50)}`);
  return {scrollWidth: document.scrollingElement.scrollWidth, width: W, wide,
          brokenWords: brokenWords(), eqnoOverlaps: eqnoOverlaps()};
})()
"""


def _bad_alt(alt: str) -> bool:
    """Empty, a file name or a hash: alt text that tells a reader nothing."""
    a = alt.strip()
    return (not a or bool(re.search(r"\.(png|jpe?g|svg|gif)$", a, re.I)) or "_images/" in a
            or bool(re.fullmatch(r"[0-9a-f]{16,}", a)))


def _chromium() -> str:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no Chromium binary on PATH (install Debian's `chromium`, or set "
                    "RR_CHROMIUM); `python3 dev.py setup` installs it when run as root with apt-get")
    return binary


@pytest.fixture(scope="module")
def browser():
    b = Browser(_chromium())
    yield b
    b.close()


@pytest.fixture(scope="module")
def phone():
    b = Browser(_chromium(), width=PHONE_WIDTH, height=844)
    yield b
    b.close()


def _script_file(url: str) -> Path | None:
    if not url.startswith("file:"):
        return None
    from urllib.parse import unquote, urlparse

    return Path(unquote(urlparse(url).path))


def test_book_is_built():
    assert (HTML / "index.html").exists(), (
        f"no built book at {HTML}: run `python3 dev.py book` (or `python3 dev.py test`, "
        "which builds it before this test)")
    assert _pages(), f"no HTML pages under {HTML}"


_IDS: dict[Path, set[str]] = {}


def _ids(path: Path) -> set[str]:
    if path not in _IDS:
        _IDS[path] = set(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))
    return _IDS[path]


def _dead_links(page: str, hrefs: list[str]) -> list[str]:
    """Local links of ``page`` whose file, or whose #anchor in it, does not exist."""
    from urllib.parse import unquote, urlparse

    dead = []
    for href in sorted(set(hrefs)):
        url = urlparse(href)
        if url.scheme and url.scheme != "file":
            continue
        target = (HTML / page).parent / unquote(url.path) if url.path else HTML / page
        target = target.resolve()
        if target.is_dir():
            target = target / "index.html"
        if not target.is_file():
            dead.append(href)
        elif url.fragment and target.suffix == ".html" and unquote(url.fragment) not in _ids(target):
            dead.append(href)
    return dead


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
        info = tab.evaluate(INSPECT % {"timeout_ms": TIMEOUT_S * 1000, "checks": CHECKS},
                            timeout=TIMEOUT_S + 30)
        stem = page.removesuffix(".html").replace("/", "__")
        tab.screenshot(SHOTS / f"{stem}.png")
        for i, box in enumerate(info["widgetBoxes"]):  # widgets further down than the cut
            tab.screenshot_region(SHOTS / f"{stem}__widget{i}.png", box)
        explore = tab.evaluate(EXPLORE)
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
    if info["widgetState"] and info["widgetsLive"]:
        problems.append("widgets that look live without a kernel (controls on, or no note at "
                        f"the widget): {info['widgetsLive'][:3]}")
    if explore["stuck"]:
        problems.append(f"explorer sliders that do not change the figure: {explore['stuck']}")
    sizes = {u: f.stat().st_size for u in info["blockingScripts"]
             if (f := _script_file(u)) is not None and f.is_file()}
    if sizes and max(sizes.values()) > BLOCKING_LIMIT:
        big = max(sizes, key=sizes.get)
        problems.append(f"a {sizes[big] / 1e3:.0f} kB script blocks the first paint: {big}")
    if info["rawTables"]:
        problems.append(f"tables shown as text (a bare | in a cell?): {info['rawTables'][:3]}")
    if info["unevenTables"]:
        problems.append(f"tables whose rows have different cell counts: {info['unevenTables'][:3]}")
    if info["wideCode"]:
        problems.append(f"{len(info['wideCode'])} visible code or output blocks wider than the "
                        f"column: {info['wideCode'][:3]}")
    if info["brokenWords"]:
        problems.append(f"words broken over two lines in tables: {info['brokenWords'][:5]}")
    dead = _dead_links(page, info["links"])
    if dead:
        problems.append(f"links to nothing: {dead[:5]}")
    if info["searchBoxes"] > 1:
        problems.append(f"{info['searchBoxes']} search boxes on the page")
    if page in STRICT:
        for f in info["figures"]:
            where = f"image {f['src']!r}"
            if _bad_alt(f["alt"]):
                problems.append(f"{where}: alt text {f['alt']!r} says nothing")
            if f["hidden"]:
                continue  # an explorer's other frames: alt text only
            if not f["caption"]:
                problems.append(f"{where}: not in a figure with a caption")
            if f["width"] > f["column"] + 1:
                problems.append(f"{where}: {f['width']:.0f} px wide, column {f['column']:.0f} px")
            if f["drawn"] and f["width"] < 0.75 * f["drawn"]:
                problems.append(f"{where}: drawn {f['drawn']:.0f} px wide, shown at "
                                f"{f['width'] / f['drawn']:.2f}x (text too small)")
    summary = {k: info[k] for k in ("title", "mathNodes", "mjxContainers", "widgetViews",
                                     "widgetElements")} | {"images": len(info["images"]),
                                                           "explorers": explore["explorers"]}
    assert not problems, f"{page} ({json.dumps(summary)}):\n  " + "\n  ".join(problems)


@pytest.mark.parametrize("page", _pages())
def test_page_fits_a_phone(phone, page):
    """At 390 px nothing pushes the page sideways (code blocks scroll in their box)."""
    if _redirect(page) is not None:
        return
    tab = phone.open((HTML / page).as_uri(), timeout=TIMEOUT_S)
    try:
        tab.evaluate("new Promise(r => setTimeout(r, 500))")
        info = tab.evaluate(PHONE % {"checks": CHECKS}, timeout=TIMEOUT_S)
        if page in STRICT:
            tab.screenshot(SHOTS / "phone" / f"{page.removesuffix('.html').replace('/', '__')}.png")
    finally:
        tab.close()
    problems = []
    if info["scrollWidth"] > info["width"] + 1:
        problems.append(f"{info['scrollWidth']} px wide at {info['width']} px: {info['wide']}")
    if info["brokenWords"]:
        problems.append(f"words broken over two lines in tables: {info['brokenWords'][:5]}")
    if info["eqnoOverlaps"]:
        problems.append(f"equation numbers drawn over their equation: {info['eqnoOverlaps'][:5]}")
    assert not problems, f"{page} at {PHONE_WIDTH} px:\n  " + "\n  ".join(problems)


def test_search_page_has_one_search_box(browser):
    """The search page's own form, and no second box in a header bar."""
    tab = browser.open((HTML / "search.html").as_uri(), timeout=TIMEOUT_S)
    try:
        n = tab.evaluate("[...document.querySelectorAll('.search-button-field, input[name=\"q\"]')]"
                         ".filter(e => e.offsetParent !== null).length")
    finally:
        tab.close()
    assert n <= 2, f"{n} search boxes on search.html (the page's form and the sidebar's at most)"
