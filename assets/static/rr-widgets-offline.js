/* Let the Jupyter widget manager (html-manager 1.x) work from _static/, offline,
 * and make saved ipywidgets explorers honest in the static book.
 *
 * Loaded with `defer` on pages with saved widget state, after require.js and
 * before html-manager/embed-amd.js (see nb_ipywidgets_js in _config.yml), so
 * the text paints before the 3.6 MB widget manager has downloaded. Nothing
 * here depends on being run at a particular moment: it finds its own URL
 * without document.currentScript, and works whether require.js has loaded yet
 * or not.
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
 * 3. Frozen explorers. Without a kernel, moving a saved slider changes its
 *    number but not the plot computed from it. Before the manager renders,
 *    every control in the saved state is marked disabled, and a note is put
 *    at each widget saying so, with links to run the chapter live (the page's
 *    own Binder/Colab launch links). Figures that move without a kernel are
 *    made with chapters/_book.py (see CONTRIBUTING.md), not with ipywidgets.
 */
(function () {
  "use strict";

  // -- 1. where the bundle lives -------------------------------------------
  function staticDir() {
    var me = document.currentScript ||
      document.querySelector('script[src*="rr-widgets-offline.js"]');
    return me ? me.src.replace(/[?#].*$/, "").replace(/[^\/]*$/, "") : "../_static/";
  }
  var bundle = staticDir() + "html-manager";
  var paths = {"@jupyter-widgets/html-manager/dist": bundle, "@jupyter-widgets": bundle};
  if (window.require && window.require.config) {
    window.require.config({paths: paths});
  } else if (!window.require) {
    // require.js not loaded yet: it reads a global `require` object as its config.
    window.require = {paths: paths};
  }

  // -- 2. MathJax 2's Hub.Queue on MathJax 3 -------------------------------
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
  if (mj !== undefined) {          // no math on this page: labels are left as text
    if (mj.version) {              // MathJax already running
      mj.Hub = mj.Hub || makeHub();
    } else {                       // still the configuration object
      mj.startup = mj.startup || {};
      var ready = mj.startup.ready;
      mj.startup.ready = function () {
        if (ready) ready(); else window.MathJax.startup.defaultReady();
        window.MathJax.Hub = window.MathJax.Hub || makeHub();
      };
    }
  }

  // -- 3. frozen controls and a note at each widget -------------------------
  function launchLinks() {
    var links = [];
    document.querySelectorAll('a[href*="/v2/gh/"], a[href*="/github/"][href$=".ipynb"]')
      .forEach(function (a) {
        var name = /\/v2\/gh\//.test(a.href) ? "Binder" : "Colab";
        if (!links.some(function (l) { return l.name === name; })) links.push({name: name, href: a.href});
      });
    return links;
  }

  function freezeState() {
    document.querySelectorAll('script[type="application/vnd.jupyter.widget-state+json"]')
      .forEach(function (s) {
        var data;
        try { data = JSON.parse(s.textContent); } catch (e) { return; }
        var models = (data && data.state) || {};
        Object.keys(models).forEach(function (id) {
          var st = models[id].state;
          if (st && Object.prototype.hasOwnProperty.call(st, "disabled")) st.disabled = true;
        });
        s.textContent = JSON.stringify(data);
      });
  }

  function addNotes() {
    var links = launchLinks();
    document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')
      .forEach(function (view) {
        var box = view.parentElement;
        if (!box || box.querySelector(".rr-widget-note")) return;
        var note = document.createElement("p");
        note.className = "rr-widget-note";
        note.setAttribute("role", "note");
        note.appendChild(document.createTextNode(
          "Static snapshot: these controls need a running Python kernel, so they are " +
          "switched off here and the plot shows the saved setting."));
        if (links.length) {
          note.appendChild(document.createTextNode(" Run this chapter live on "));
          links.forEach(function (l, i) {
            if (i) note.appendChild(document.createTextNode(" or "));
            var a = document.createElement("a");
            a.href = l.href;
            a.target = "_blank";
            a.rel = "noopener";
            a.textContent = l.name;
            note.appendChild(a);
          });
          note.appendChild(document.createTextNode(" to move them."));
        }
        box.classList.add("rr-widget-frozen");
        box.insertBefore(note, view);
      });
  }

  function run() {
    freezeState();
    addNotes();
  }
  // Before html-manager renders (it waits for DOMContentLoaded too, and this
  // listener is registered first).
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", run);
  else run();
})();
