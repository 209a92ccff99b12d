#!/usr/bin/env python3
"""Fetch the book's third-party browser assets from the npm registry.

The built book must render with no network: MathJax typesets the math,
require.js and the Jupyter widget manager render the saved ipywidgets state.
Instead of the CDNs Sphinx and myst-nb use by default, the book serves these
files itself from ``_static/`` (``_config.yml`` points ``mathjax_path`` and
``nb_ipywidgets_js`` there). They are too large to commit, so this script
downloads the exact tarballs pinned in ``assets/vendor.lock.json``, checks
each against its npm ``integrity`` hash (sha512), and unpacks only the files
listed there into ``assets/vendor/`` (git-ignored), which Sphinx copies into
``_build/html/_static/``. The files are used as published, unmodified; the
glue the book needs (module paths, MathJax 3 for widget labels) is the
book's own ``assets/static/rr-widgets-offline.js``.

Usage (``python3 dev.py setup`` and ``python3 dev.py book`` run it)::

    python3 assets/fetch_vendor.py          # no-op when already up to date
    python3 assets/fetch_vendor.py --force  # re-download

Only the standard library is used. ``RR_NPM_REGISTRY`` (or
``npm_config_registry``) selects a registry mirror. Exit status 1 with a
message when the registry cannot be reached and the assets are not present.
"""
from __future__ import annotations

import argparse
import base64
import fnmatch
import hashlib
import io
import json
import os
import shutil
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
LOCK = HERE / "vendor.lock.json"
NOTICES = HERE / "THIRD_PARTY_NOTICES.md"  # served beside the files it covers
DEST = HERE / "vendor"
STAMP = DEST / ".lock-sha256"


def _want() -> str:
    h = hashlib.sha256(LOCK.read_bytes())
    h.update(NOTICES.read_bytes())
    return h.hexdigest()


def _registry(lock: dict) -> str:
    url = (os.environ.get("RR_NPM_REGISTRY") or os.environ.get("npm_config_registry")
           or lock["registry"])
    return url.rstrip("/")


def _download(url: str, integrity: str) -> bytes:
    algo, _, want = integrity.partition("-")
    with urllib.request.urlopen(url, timeout=60) as resp:  # noqa: S310 (https URL from the lock file)
        data = resp.read()
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise RuntimeError(f"{url}: {algo} integrity mismatch (expected {want}, got {got})")
    return data


def _select(members: list[tarfile.TarInfo], rules: list[list[str]]) -> list[tuple[tarfile.TarInfo, str]]:
    """Map tarball members (``package/<src>``) to destination paths."""
    out = []
    for src, dst in rules:
        hits = []
        for m in members:
            if not m.isfile():
                continue
            rel = m.name.removeprefix("package/")
            if src.endswith("/") and rel.startswith(src):  # a directory, recursively
                hits.append((m, dst + rel[len(src):]))
            elif any(c in src for c in "*?[") and "/" not in rel[len(src.rsplit("/", 1)[0]) + 1:] \
                    and fnmatch.fnmatch(rel, src):  # a glob, one directory level
                hits.append((m, dst + rel.rsplit("/", 1)[-1]))
            elif rel == src:
                hits.append((m, dst))
        if not hits:
            raise RuntimeError(f"no file in the tarball matches {src!r}")
        out += hits
    return out


def fetch(force: bool = False) -> Path:
    """Make ``assets/vendor/`` match the lock file; return its path."""
    want = _want()
    if not force and STAMP.exists() and STAMP.read_text().strip() == want:
        return DEST
    lock = json.loads(LOCK.read_text())
    registry = _registry(lock)
    tmp = Path(tempfile.mkdtemp(prefix="vendor-", dir=HERE))
    try:
        for pkg in lock["packages"]:
            url = f"{registry}/{pkg['tarball']}"
            print(f"fetching {pkg['name']}@{pkg['version']} ({pkg['license']}) from {registry}",
                  flush=True)
            data = _download(url, pkg["integrity"])
            with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
                for member, dst in _select(tar.getmembers(), pkg["files"]):
                    target = (tmp / dst).resolve()
                    if tmp.resolve() not in target.parents:
                        raise RuntimeError(f"unsafe path {dst!r} in the lock file")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    target.write_bytes(tar.extractfile(member).read())
        shutil.copy(NOTICES, tmp / NOTICES.name)
        (tmp / STAMP.name).write_text(want + "\n")
        shutil.rmtree(DEST, ignore_errors=True)
        tmp.rename(DEST)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return DEST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="download even if up to date")
    args = parser.parse_args(argv)
    try:
        dest = fetch(force=args.force)
    except (OSError, RuntimeError, tarfile.TarError) as exc:
        print(f"could not fetch the book's offline assets: {exc}\n"
              "The book needs them to render math and widgets without a network. "
              "Run this again with network access to the npm registry "
              "(or set RR_NPM_REGISTRY to a mirror).", file=sys.stderr)
        return 1
    n = sum(1 for p in dest.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"offline assets: {n} files, {size / 1e6:.1f} MB in {dest.relative_to(HERE.parent)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
