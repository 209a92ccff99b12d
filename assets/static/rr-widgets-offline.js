/* Let the Jupyter widget manager (html-manager 1.x) work from _static/, offline.
 *
 * Loaded on pages with saved widget state, after require.js and before
 * html-manager/embed-amd.js (see nb_ipywidgets_js in _config.yml).
 *
 * 1. Asset paths. The bundled widget modules locate their font files from
 *    their require.js module URL, which by default is relative to the page
 *    (chapters/@jupyter-widgets/...). Map those module ids to the folder
 *    that holds the bundle and its fonts.
 * 2. Math in widget labels. @jupyter-widgets/base typesets labels through
 *    the MathJax 2 call MathJax.Hub.Queue(["Typeset", Hub, element]); the
 *    book loads MathJax 3, which has no Hub. Provide that one call on top of
 *    MathJax 3's typesetPromise, once MathJax has started. Labels are written
 *    as in the notebook, description=r"$\lambda$", but the book's MathJax only
 *    knows \( \) for inline math, so $...$ inside the label becomes \(...\).
 */
(function () {
  "use strict";
  var here = document.currentScript.src.replace(/[?#].*$/, "").replace(/[^\/]*$/, "");
  var bundle = here + "html-manager";
  if (window.require && window.require.config) {
    window.require.config({
      paths: {
        "@jupyter-widgets/html-manager/dist": bundle,
        "@jupyter-widgets": bundle
      }
    });
  }

  function dollarsToParens(element) {
    var walker = document.createTreeWalker(element, NodeFilter.SHOW_TEXT);
    for (var node = walker.nextNode(); node; node = walker.nextNode()) {
      if (node.nodeValue.indexOf("$") >= 0) {
        node.nodeValue = node.nodeValue.replace(/\$([^$]+)\$/g, "\\($1\\)");
      }
    }
  }

  function makeHub() {
    return {
      Queue: function () {
        Array.prototype.forEach.call(arguments, function (job) {
          if (!Array.isArray(job) || job[0] !== "Typeset") return;
          var element = job[2];
          if (element) dollarsToParens(element);
          window.MathJax.startup.promise
            .then(function () {
              window.MathJax.typesetClear(element ? [element] : undefined);
              return window.MathJax.typesetPromise(element ? [element] : undefined);
            })
            .catch(function (err) { console.warn("MathJax could not typeset a widget label:", err); });
        });
      }
    };
  }

  var mj = window.MathJax;
  if (mj === undefined) return;  // no math on this page: labels are left as text
  if (mj.version) {              // MathJax already running
    mj.Hub = mj.Hub || makeHub();
    return;
  }
  // Still the configuration object: install the shim when MathJax is ready.
  mj.startup = mj.startup || {};
  var ready = mj.startup.ready;
  mj.startup.ready = function () {
    if (ready) ready(); else window.MathJax.startup.defaultReady();
    window.MathJax.Hub = window.MathJax.Hub || makeHub();
  };
})();
