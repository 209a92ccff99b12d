#!/usr/bin/env python3
"""One entry point for readers and CI: set up, build the book, run the tests.

Usage (from the repository root, with only Python >= 3.10 and pip):

    python3 dev.py book      # create .venv, install, build _build/html
    python3 dev.py test      # same set-up, then unit tests + every notebook
                             # under strict nbval (again under torch's other
                             # CPU kernel sets: AVX2 and plain under AVX-512,
                             # plain under AVX2; RR_TEST_KERNELS=none skips)
                             # + the wheel, installed in a
                             # fresh environment + the book build with -W
                             # (on a machine with a CUDA GPU the notebooks
                             # run there under nbval-lax: asserts only, as
                             # the stored outputs are the CPU's; set
                             # RR_TEST_DEVICE=cpu to compare them strictly)
    python3 dev.py pdf       # same set-up, then the whole book as one PDF
                             # (_build/latex/book.pdf) and the HTML again, with
                             # the PDF beside it and the landing page's link to
                             # it (a build without the PDF shows no link)
    python3 dev.py execute [chapters/NN_x.ipynb ...]
                             # re-run notebooks in place, storing outputs and
                             # widget state (what the book renders)

The virtual environment is rebuilt when requirements.txt or pyproject.toml
change (a hash stamp in .venv). Nothing here needs a GPU; one is used when present.

The book serves MathJax, require.js and the Jupyter widget manager itself, so
that it reads offline: `book` and `test` fetch them once with `npm pack`
(versions and hashes pinned in assets/vendor.lock.json) into assets/vendor/.
`setup` and `test` also install Debian's `chromium` for the browser test
(tests/browser), and `pdf` Debian's TeX (xelatex, latexmk), when they are
missing and this runs as root with apt-get.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = Path(os.environ.get("RR_VENV", ROOT / ".venv"))
BIN = VENV / ("Scripts" if os.name == "nt" else "bin")
PY = BIN / "python"
STAMP = VENV / ".rr-installed"

# Same thread count when notebooks are executed and when nbval re-runs them,
# so stored outputs and recomputed ones agree to the printed digits; two
# single-threaded kernels also share this 2-core machine without contention.
RUN_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "PYTHONHASHSEED": "0",
    "TQDM_DISABLE": "1",
    "PYDEVD_DISABLE_FILE_VALIDATION": "1",
}


def _run(cmd: list[str], env: dict | None = None) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    full_env = dict(os.environ)
    full_env.update(RUN_ENV)
    if env:
        full_env.update(env)
    full_env["PATH"] = f"{BIN}{os.pathsep}{full_env.get('PATH', '')}"
    subprocess.run([str(c) for c in cmd], cwd=ROOT, env=full_env, check=True)


def _want_hash() -> str:
    h = hashlib.sha256()
    for name in ("requirements.txt", "pyproject.toml"):
        h.update((ROOT / name).read_bytes())
    return h.hexdigest()


def setup() -> None:
    """Create the venv and install the pinned requirements and the package."""
    want = _want_hash()
    if STAMP.exists() and STAMP.read_text().strip() == want and PY.exists():
        return
    if not PY.exists():
        print(f"creating virtual environment in {VENV}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True)
    _run([PY, "-m", "pip", "install", "--quiet", "--upgrade", "pip"])
    _run([PY, "-m", "pip", "install", "--quiet", "-r", "requirements.txt"])
    _run([PY, "-m", "pip", "install", "--quiet", "--no-deps", "-e", "."])
    _run([PY, "-m", "ipykernel", "install", "--sys-prefix", "--name", "python3"])
    STAMP.write_text(want)


def _apt_install(packages: list[str], what: str) -> bool:
    """apt-get install, quietly, as root (or through passwordless sudo, as on a
    hosted CI runner); False (with a message) when impossible."""
    if os.name != "posix" or not shutil.which("apt-get"):
        return False
    sudo: list[str] = []
    if os.geteuid() != 0:
        if not shutil.which("sudo") or subprocess.run(
                ["sudo", "-n", "true"], capture_output=True).returncode != 0:
            return False
        sudo = ["sudo", "-n", "-E"]
    print(f"installing {what} (apt-get, quiet)", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*sudo, "apt-get", "install", "-y", "-qq", "--no-install-recommends", *packages]
    for cmd in (install, [*sudo, "apt-get", "update", "-qq"], install):
        try:
            done = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True, timeout=1800)
        except (OSError, subprocess.TimeoutExpired) as exc:
            print(f"could not install {what} ({exc})", flush=True)
            return False
        if cmd is install and done.returncode == 0:
            return True
    print(f"could not install {what} (apt-get: "
          f"{done.stderr.strip().splitlines()[-1:] or done.returncode})", flush=True)
    return False


def ensure_chromium() -> None:
    """Install Chromium for the browser test where we can; never fail.

    Only as root on a system with apt-get (a CI container, a fresh VM); any
    other system gets the test skipped with a message saying what is missing.
    """
    names = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    if os.environ.get("RR_CHROMIUM") or any(shutil.which(n) for n in names):
        return
    if not _apt_install(["chromium"], "chromium for the browser test"):
        print("no Chromium: the browser test will be skipped "
              "(install `chromium`, or set RR_CHROMIUM to a Chrome/Chromium binary)", flush=True)


# Debian's TeX for Sphinx's LaTeX builder with xelatex (Sphinx's own list for
# xelatex: the FreeFont OpenType fonts, the extra LaTeX packages, latexmk).
TEX_PACKAGES = ["texlive-xetex", "texlive-latex-recommended", "texlive-latex-extra",
                "texlive-fonts-recommended", "fonts-freefont-otf", "latexmk"]


def ensure_tex() -> bool:
    """xelatex and latexmk, installed where we can; never raises."""
    if shutil.which("xelatex") and shutil.which("latexmk"):
        return True
    return _apt_install(TEX_PACKAGES, "TeX for the PDF (xelatex, about 600 MB)") \
        and bool(shutil.which("xelatex") and shutil.which("latexmk"))


PDF_NAME = "riemannian-attention.pdf"  # beside the HTML; the landing page links it


def build_pdf() -> None:
    """The whole book through Sphinx's LaTeX builder and xelatex, then the HTML.

    The HTML build copies ``_build/latex/book.pdf`` beside the pages as
    riemannian-attention.pdf and only then shows the landing page's link to it
    (assets/sphinx/rr_book.py): a build without the PDF has no dead link.
    """
    if not ensure_tex():
        raise SystemExit("the PDF needs xelatex and latexmk (Debian: "
                         + " ".join(TEX_PACKAGES) + "); install them, or run this as root "
                         "with apt-get so that dev.py can")
    shutil.rmtree(ROOT / "_build" / "latex", ignore_errors=True)
    _run([BIN / "jupyter-book", "build", ".", "--path-output", ".", "--builder", "pdflatex"])
    pdf = ROOT / "_build" / "latex" / "book.pdf"
    if not pdf.exists():
        raise SystemExit(f"no PDF at {pdf}: see the LaTeX log in {pdf.parent}")
    build_book(strict=False)
    print(f"pdf: {pdf} ({pdf.stat().st_size / 1e6:.1f} MB), linked from the book as "
          f"{ROOT / '_build' / 'html' / PDF_NAME}", flush=True)


def fetch_assets() -> None:
    """MathJax, require.js and the widget manager into assets/vendor/ (once).

    assets/fetch_vendor.py fetches them with `npm pack`; where npm is missing,
    Debian's `npm` is installed like Chromium (as root or through sudo).
    """
    if not (shutil.which("npm") or (ROOT / "assets" / "vendor" / ".lock-sha256").exists()):
        _apt_install(["npm"], "npm to fetch the book's offline assets")
    _run([sys.executable, ROOT / "assets" / "fetch_vendor.py"])


def _static_stamp() -> str:
    """Hash of what the build copies into _static/ from assets/."""
    h = hashlib.sha256()
    for path in sorted((ROOT / "assets").rglob("*")):
        rel = path.relative_to(ROOT / "assets").parts
        if path.is_file() and rel[0] != "vendor" and "__pycache__" not in rel:
            h.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    vendor_stamp = ROOT / "assets" / "vendor" / ".lock-sha256"
    if vendor_stamp.exists():
        h.update(vendor_stamp.read_bytes())
    return h.hexdigest()


def build_book(strict: bool) -> None:
    fetch_assets()
    # Sphinx copies static files only when some page is rewritten, and never
    # over an existing file: when the offline assets or the book's own JS or
    # Sphinx extension change, start from a clean output.
    stamp_file = ROOT / "_build" / ".assets-stamp"
    stamp = _static_stamp()
    if not stamp_file.exists() or stamp_file.read_text() != stamp:
        shutil.rmtree(ROOT / "_build" / "html", ignore_errors=True)
        shutil.rmtree(ROOT / "_build" / ".doctrees", ignore_errors=True)
    args = [BIN / "jupyter-book", "build", ".", "--path-output", "."]
    if strict:
        args += ["-W", "-n", "--keep-going"]
    _run(args)
    stamp_file.write_text(stamp)
    print(f"book: {ROOT / '_build' / 'html' / 'index.html'}", flush=True)


def _test_device() -> str:
    """``"cuda"`` where the environment's torch sees a GPU (``RR_TEST_DEVICE=cpu`` forces the CPU), else ``"cpu"``."""
    if os.environ.get("RR_TEST_DEVICE", "").lower() == "cpu":
        return "cpu"
    res = subprocess.run([str(PY), "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                         text=True, cwd=ROOT)
    return "cuda" if res.stdout.strip().endswith("True") else "cpu"


def test(extra: list[str]) -> None:
    workers = os.environ.get("RR_TEST_WORKERS", "2")
    # The stored outputs were computed on the CPU: compared strictly there. On a GPU the chapters run
    # on it (they pick cuda when present) and every assert must hold, but printed digits may differ.
    device = _test_device()
    print(f"test device: {device} ({'stored outputs compared' if device == 'cpu' else 'asserts only'})",
          flush=True)
    cmd = [PY, "-m", "pytest", "--nbval" if device == "cpu" else "--nbval-lax", "--nbval-current-env",
           "--nbval-sanitize-with", "sanitize.cfg",
           "-p", "no:cacheprovider", "--ignore=tests/browser"]
    if workers != "0":
        cmd += ["-n", workers, "--dist", "loadfile"]
    cmd += extra
    _run(cmd, env={"CUDA_VISIBLE_DEVICES": ""} if os.environ.get("RR_TEST_DEVICE", "").lower() == "cpu" else None)
    if device == "cpu":
        for kernels in _other_kernel_sets():
            # The stored outputs must not depend on the CPU that recorded them: the notebooks
            # (or the selection given) again, with torch's other kernels (another reader's CPU).
            print(f"again with ATEN_CPU_CAPABILITY={kernels}", flush=True)
            _run(cmd[:len(cmd) - len(extra)] + (extra or ["chapters"]), env={"ATEN_CPU_CAPABILITY": kernels})
    check_wheel()
    # A clean build, so that stale pages cannot hide a warning.
    shutil.rmtree(ROOT / "_build" / "html", ignore_errors=True)
    shutil.rmtree(ROOT / "_build" / ".doctrees", ignore_errors=True)
    build_book(strict=True)
    browser = ROOT / "tests" / "browser"
    if browser.exists():
        # Reads the pages just built: headless Chromium, network off.
        _run([PY, "-m", "pytest", "-p", "no:cacheprovider", "tests/browser"])


def _cpu_capability(env: dict | None = None) -> str:
    """The kernel set torch picks (``torch.backends.cpu.get_cpu_capability()``), lower case."""
    res = subprocess.run([str(PY), "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
                         capture_output=True, text=True, cwd=ROOT, check=True,
                         env={**os.environ, **RUN_ENV, **(env or {})})
    return res.stdout.strip().splitlines()[-1].lower()


def _other_kernel_sets() -> list[str]:
    """The CPU kernel sets the notebooks run under a second (and third) time.

    Under AVX-512 torch can also run its AVX2 and its plain (``default``)
    kernels, under AVX2 the plain ones (``ATEN_CPU_CAPABILITY``); other CPUs
    get no extra pass. ``RR_TEST_KERNELS`` overrides the list (comma-separated,
    e.g. ``avx2``; ``none`` for no extra pass).
    """
    forced = os.environ.get("RR_TEST_KERNELS")
    if forced is not None:
        sets = [k.strip().lower() for k in forced.split(",") if k.strip()]
        return [] if sets in ([], ["none"]) else sets
    native = _cpu_capability()
    others = {"avx512": ["avx2", "default"], "avx2": ["default"]}.get(native, [])
    for kernels in others:  # torch ignores a set it cannot run (with a warning): check it took
        got = _cpu_capability({"ATEN_CPU_CAPABILITY": kernels})
        if got != kernels:
            raise SystemExit(f"ATEN_CPU_CAPABILITY={kernels} gave kernel set {got!r}, expected {kernels!r}")
    print(f"CPU kernel set {native}; notebooks also run with: {', '.join(others) or 'no other'}", flush=True)
    return others


def check_wheel() -> None:
    """Build the wheel and sdist and try the wheel where the checkout cannot help it.

    `python -m build` makes the sdist and, from it, the wheel; the wheel is
    installed with the transformers extra into a new virtual environment in a
    temporary directory (torch and the rest at the versions pinned in
    requirements.txt), and tests/wheel_smoke.py runs there with `python -I`
    from that directory: a module, data file, `py.typed` or dependency missing
    from the package fails the test command.
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rr-wheel-") as tmp:
        dist, venv = Path(tmp) / "dist", Path(tmp) / "venv"
        _run([PY, "-m", "build", "--quiet", "--outdir", dist, "."])
        wheels, sdists = sorted(dist.glob("*.whl")), sorted(dist.glob("*.tar.gz"))
        if len(wheels) != 1 or len(sdists) != 1:
            raise SystemExit(f"python -m build made {[p.name for p in dist.iterdir()]}: "
                             "expected one wheel and one sdist")
        print(f"built {wheels[0].name} ({wheels[0].stat().st_size / 1e3:.0f} kB) and {sdists[0].name}",
              flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        vpy = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
        env = dict(os.environ, **RUN_ENV)
        for cmd in ([vpy, "-m", "pip", "install", "--quiet", "-c", ROOT / "requirements.txt",
                     f"{wheels[0]}[transformers]"],
                    [vpy, "-I", ROOT / "tests" / "wheel_smoke.py"]):
            print("+", " ".join(str(c) for c in cmd), flush=True)
            subprocess.run([str(c) for c in cmd], cwd=tmp, env=env, check=True)


def execute(paths: list[str]) -> None:
    nbs = paths or sorted(str(p.relative_to(ROOT)) for p in (ROOT / "chapters").glob("*.ipynb"))
    for nb in nbs:
        _run([BIN / "jupyter", "nbconvert", "--to", "notebook", "--execute", "--inplace",
              "--ExecutePreprocessor.timeout=600",
              "--ExecutePreprocessor.kernel_name=python3",
              "--ExecutePreprocessor.store_widget_state=True", nb])


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"setup", "book", "test", "execute", "pdf"}:
        print(__doc__)
        return 2
    cmd, rest = argv[0], argv[1:]
    setup()
    if cmd in {"setup", "test"}:
        ensure_chromium()
    if cmd == "book":
        build_book(strict=False)
    elif cmd == "test":
        test(rest)
    elif cmd == "execute":
        execute(rest)
    elif cmd == "pdf":
        build_pdf()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except subprocess.CalledProcessError as exc:
        print(f"failed: {exc}", file=sys.stderr)
        sys.exit(exc.returncode or 1)
