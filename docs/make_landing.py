#!/usr/bin/env python3
"""The landing page's answer: its figure, its three sentences and its explorer.

Reads the committed rank-collapse sweep (results/rank_collapse.json, written by
experiments/rank_collapse.py) and writes, into docs/landing/,

* ``rank_collapse.svg`` and ``rank_collapse.pdf``: the figure (the HTML book
  shows the SVG, the PDF book the PDF; chapters/00_preface.md names them as
  ``rank_collapse.*``);
* ``answer.md``: the three sentences under the figure, with every number
  computed here from the same file (included by the landing page);
* ``explorer.html``: the "look for yourself" block, every metric side and
  strength of the sweep behind two sliders (chapters/_book.py), which works
  without a kernel.

When the results change, or the answer does, edit the sentences in
:func:`answer_text` and run, from the repository root::

    .venv/bin/python docs/make_landing.py

tests/test_landing.py fails when the committed answer.md no longer matches
what this script computes from the committed result file.
"""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
from scipy import stats

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "rank_collapse.json"
OUT = ROOT / "docs" / "landing"
LEVEL = -6.0  # "collapsed": relative residual below 1e-6 (as in chapter 9)

LABELS = {
    "euclidean": "dot product (Euclidean)",
    "l2": r"plain distance, $G = \lambda I$",
    "hetero-key-r4-s1": "per-token metric, key side",
    "hetero-query-r4-s4": "per-token metric, query side, strength 4",
}


def load(path: Path = RESULTS) -> dict:
    return json.loads(path.read_text())


def curve(res: dict, name: str, arch: str = "pure") -> np.ndarray:
    """Per seed and depth, log10 relative residual (composite norm) at init."""
    gain = f"g{res['meta']['gains'][0]:g}"
    return np.array(res["init"][f"{arch}/{gain}/{name}"]["log10_res_comp"])


def mean_ci(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean over seeds (axis 0) and half-width of the 95% t-interval."""
    k = a.shape[0]
    return a.mean(0), stats.t.ppf(0.975, k - 1) * a.std(0, ddof=1) / math.sqrt(k)


def depth_to(c: np.ndarray, level: float = LEVEL) -> np.ndarray:
    """Per seed, the first depth whose log10 residual is below ``level``."""
    hit = c < level
    return np.where(hit.any(1), hit.argmax(1), c.shape[1]).astype(float)


def summary(res: dict) -> dict:
    """The numbers the sentences quote."""
    meta = res["meta"]
    metric = [k for k in meta["variants"]
              if k.startswith(("shared", "hetero")) or k == "fiber-trivial-key-r4-s1"]
    hetero = [k for k in metric if k.startswith("hetero")]
    depth = {k: depth_to(curve(res, k)).mean() for k in meta["variants"]}
    collapsed = [k for k in metric if (curve(res, k)[:, -1] < LEVEL).all()]
    best = max(hetero, key=depth.get)
    return {
        "seeds": meta["seeds"], "depth": meta["depth"], "n_metric": len(metric),
        "n_collapsed": len(collapsed), "n_hetero": len(hetero),
        "n_earlier": sum(depth[k] < depth["euclidean"] for k in hetero),
        "euclid": depth["euclidean"], "l2": depth["l2"], "best": best, "best_depth": depth[best],
        # every collapsed seed ends below 10^floor
        "floor": math.ceil(max(curve(res, k)[:, -1].max() for k in collapsed)),
    }


def answer_text(res: dict) -> str:
    s = summary(res)
    assert s["n_collapsed"] == s["n_metric"], "a metric variant did not collapse: rewrite the answer"
    side, strength = s["best"].split("-")[1], s["best"].rsplit("-s", 1)[1]
    return (
        "<!-- Written by docs/make_landing.py from results/rank_collapse.json; edit the script, "
        "not this file. -->\n"
        f"**No: a metric per token does not stop rank collapse.** In stacks of pure attention "
        f"layers at random initialisation, all {s['n_metric']} metric variants we swept (shared, "
        f"per-token on the key, query or mean side, ranks 1 to 8, strengths 0.25 to 4, and the "
        f"fibre bundle with the trivial connection) collapse in every one of {s['seeds']} seeds: "
        f"by depth {s['depth']} the token states agree to within $10^{{{s['floor']}}}$, close to "
        f"float64 rounding.\n"
        f"Most collapse *earlier* than dot-product attention: the token states fall below "
        f"$10^{{-6}}$ relative residual at depth {s['euclid']:.1f} with the dot product (mean over "
        f"seeds), at {s['l2']:.1f} with a plain distance score ($G = \\lambda I$), and before the "
        f"dot product for {s['n_earlier']} of the {s['n_hetero']} per-token variants.\n"
        f"The largest effect is a delay, not a cure: the strongest {side}-side metric "
        f"(strength {strength}) postpones that point to depth {s['best_depth']:.1f}, and then "
        f"collapses all the same.\n"
    )


def _style():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({
        "font.size": 12.5, "axes.titlesize": 12.5, "legend.fontsize": 12,
        "svg.fonttype": "none", "svg.hashsalt": "rr-landing",  # small, reproducible SVG
        "axes.spines.top": False, "axes.spines.right": False,
    })
    return plt


def _axes(ax, res: dict) -> None:
    ax.axhline(LEVEL, color="0.5", lw=0.8, ls=":")
    ax.text(res["meta"]["depth"], LEVEL + 0.4, "$10^{-6}$", color="0.4", ha="right", va="bottom",
            fontsize=9)
    ax.set_xlim(0, res["meta"]["depth"])
    ax.set_ylim(-16.5, 0.5)
    ax.set_yticks(range(-16, 1, 4))
    ax.set_xlabel("depth (attention layers)")
    ax.set_ylabel(r"$\log_{10}$ relative residual")


def _band(ax, res, name, **kw):
    m, h = mean_ci(curve(res, name))
    line, = ax.plot(m, lw=2, **kw)
    ax.fill_between(np.arange(len(m)), m - h, m + h, color=line.get_color(), alpha=0.18, lw=0)


def hero_figure(res: dict):
    plt = _style()
    fig, ax = plt.subplots(figsize=(5.2, 4.6), layout="constrained")
    colors = {"euclidean": "0.15", "l2": "#1f77b4", "hetero-key-r4-s1": "#ff7f0e",
              "hetero-query-r4-s4": "#2ca02c"}
    for name, label in LABELS.items():
        _band(ax, res, name, color=colors[name], label=label,
              ls="--" if name == "euclidean" else "-")
    _axes(ax, res)
    ax.set_title(f"Pure attention stacks at init, {res['meta']['seeds']} seeds")
    # Below the axes: inside, it would cover the curves.
    ax.legend(loc="upper left", bbox_to_anchor=(0, -0.2), frameon=False, fontsize=12)
    return fig


def explorer_block(res: dict):
    sys.path.insert(0, str(ROOT / "chapters"))
    from _book import explorer

    plt = _style()

    def draw(side, strength):
        fig, ax = plt.subplots(figsize=(5.2, 4.6), layout="constrained")
        _band(ax, res, "euclidean", color="0.15", ls="--", label="dot product (Euclidean)")
        _band(ax, res, f"shared-r4-s{strength:g}", color="#9467bd",
              label=f"one shared metric, strength {strength:g}")
        _band(ax, res, f"hetero-{side}-r4-s{strength:g}", color="#2ca02c",
              label=f"per-token metric, {side} side, strength {strength:g}")
        _axes(ax, res)
        d = depth_to(curve(res, f"hetero-{side}-r4-s{strength:g}")).mean()
        ax.set_title(f"per-token metric below $10^{{-6}}$ at depth {d:.1f}\n"
                     f"(dot product: {depth_to(curve(res, 'euclidean')).mean():.1f})")
        ax.legend(loc="upper left", bbox_to_anchor=(0, -0.2), frameon=False, fontsize=12)
        return fig

    # Slider names are draw()'s keyword arguments.
    return explorer(draw, {"side": ["key", "query", "mean"], "strength": [0.25, 1.0, 4.0]},
                    alt="Log10 relative residual against depth for dot-product attention, one "
                        "shared metric and a per-token metric on the {side} side, all at "
                        "strength {strength}: every curve falls to the float64 floor.",
                    default={"side": "query", "strength": 4.0})


def main() -> int:
    res = load()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "answer.md").write_text(answer_text(res))
    fig = hero_figure(res)
    fig.savefig(OUT / "rank_collapse.svg", metadata={"Date": None})
    fig.savefig(OUT / "rank_collapse.pdf", metadata={"CreationDate": None, "ModDate": None})
    (OUT / "explorer.html").write_text(
        '<figure class="rr-explorer-figure">\n' + explorer_block(res).to_html()
        + "\n<figcaption><p>The sweep behind the figure above, one setting at a time: a per-token metric "
        "(green) on the key, query or mean side at strength 0.25, 1 or 4, against the dot "
        "product (dashed) and one shared metric of the same strength (purple). Move the "
        "sliders; the frames are precomputed from the same result file, so this works "
        "without a Python kernel or a network.</p></figcaption>\n</figure>\n")
    for p in sorted(OUT.iterdir()):
        print(f"{p.relative_to(ROOT)}: {p.stat().st_size / 1e3:.0f} kB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
