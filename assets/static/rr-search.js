/* Search result snippets from the text a reader sees.
 *
 * Sphinx 7.4's searchtools.js builds each result's snippet from the whole
 * [role=main] element of the page and looks for the *stemmed* query there
 * ("woodburi" for "Woodbury"). In this theme [role=main] starts with the
 * header buttons, and a stem is often not a substring of the text, so many
 * snippets read "...Binder" or "...Repository", or show raw TeX.
 *
 * This replaces two of its functions (loaded with `defer`, so it runs after
 * searchtools.js and before the search starts on DOMContentLoaded):
 * - the text is the article only, without header buttons, math source,
 *   code-cell prompts or scripts;
 * - the snippet is centred on the first word that starts with a query stem
 *   (shortened by up to two letters, "woodbur" finds "Woodbury").
 */
(function () {
  "use strict";
  if (typeof Search === "undefined") return;  // no searchtools.js on this page

  var DROP = [".headerlink", "script", "style", ".math", "mjx-container", ".MathJax",
              ".bd-header-article", ".header-article-items", ".prev-next-area",
              ".toggle-details", ".rr-widget-note"];

  Search.htmlToText = function (htmlString, anchor) {
    var doc = new DOMParser().parseFromString(htmlString, "text/html");
    DROP.forEach(function (q) {
      doc.querySelectorAll(q).forEach(function (el) {
        // Inline math becomes an ellipsis rather than vanishing mid-sentence.
        if (el.matches(".math") && !el.matches("div.math")) el.replaceWith("…");
        else el.remove();
      });
    });
    var main = doc.querySelector("article.bd-article") || doc.querySelector('[role="main"]');
    if (!main) return "";
    if (anchor) {
      var part = main.querySelector(anchor);
      if (part) return part.textContent.replace(/\s+/g, " ");
    }
    return main.textContent.replace(/\s+/g, " ");
  };

  function firstHit(textLower, keywords) {
    var best = -1;
    keywords.forEach(function (k) {
      k = String(k).toLowerCase();
      for (var cut = 0; cut <= 2 && k.length - cut >= 3; cut++) {
        var re = new RegExp("\\b" + k.slice(0, k.length - cut).replace(/[.*+?^${}()|[\]\\]/g, "\\$&"));
        var m = re.exec(textLower);
        if (m) {
          if (best < 0 || m.index < best) best = m.index;
          break;
        }
      }
    });
    return best;
  }

  Search.makeSearchSummary = function (htmlText, keywords, anchor) {
    var text = Search.htmlToText(htmlText, anchor).trim();
    if (text === "") return null;
    var hit = firstHit(text.toLowerCase(), [].concat(Array.from(keywords)));
    var start = hit < 0 ? 0 : Math.max(hit - 100, 0);
    if (start > 0) {  // start on a word boundary
      var space = text.indexOf(" ", start);
      if (space > -1 && space < hit) start = space + 1;
    }
    var summary = document.createElement("p");
    summary.classList.add("context");
    summary.textContent = (start > 0 ? "…" : "") + text.substr(start, 240).trim() +
      (start + 240 < text.length ? "…" : "");
    return summary;
  };
})();
