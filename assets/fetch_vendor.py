#!/usr/bin/env python3
"""Fetch the book's third-party browser assets with npm.

The built book must render with no network: MathJax typesets the math,
require.js and the Jupyter widget manager render the saved ipywidgets state.
Instead of the CDNs Sphinx and myst-nb use by default, the book serves these
files itself from ``_static/`` (``_config.yml`` points ``mathjax_path`` and
``nb_ipywidgets_js`` there). They are too large to commit, so this script
fetches the exact package versions pinned in ``assets/vendor.lock.json`` with
``npm pack NAME@VERSION`` (npm's ordinary client, which knows the registry it
is configured for; nothing here names a host), checks each tarball against its
pinned sha512 ``integrity``, and unpacks only the files listed there into
``assets/vendor/`` (git-ignored), which Sphinx copies into
``_build/html/_static/``. The files are used as published, unmodified; the
glue the book needs (module paths, MathJax 3 for widget labels) is the book's
own ``assets/static/rr-widgets-offline.js``.

Usage (``python3 dev.py book`` and ``python3 dev.py test`` run it)::

    python3 assets/fetch_vendor.py          # no-op when already up to date
    python3 assets/fetch_vendor.py --force  # fetch again

Needs ``npm`` on PATH (Node.js; ``dev.py`` installs Debian's ``npm`` where it
can); npm's own settings (``npm config``, ``npm_config_registry``) choose the
registry or a mirror. Exit status 1 with a message when npm is missing or
cannot fetch a package and the assets are not present.
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
import subprocess
import tempfile
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


def _npm() -> str:
    npm = shutil.which("npm") or shutil.which("npm.cmd")
    if npm is None:
        raise RuntimeError("npm is not on PATH (install Node.js with npm, e.g. Debian's `npm`)")
    return npm


def _npm_pack(name: str, version: str, integrity: str, dest: Path) -> bytes:
    """The package tarball as npm fetches it, checked against the pinned hash."""
    done = subprocess.run([_npm(), "pack", f"{name}@{version}", "--json", "--silent",
                           "--pack-destination", str(dest)],
                          cwd=dest, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        tail = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
        raise RuntimeError(f"npm pack {name}@{version} failed: {tail}")
    filename = json.loads(done.stdout)[0]["filename"]
    data = (dest / filename).read_bytes()
    algo, _, want = integrity.partition("-")
    got = base64.b64encode(hashlib.new(algo, data).digest()).decode()
    if got != want:
        raise RuntimeError(f"{name}@{version}: {algo} integrity mismatch "
                           f"(pinned {want}, npm gave {got})")
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
    tmp = Path(tempfile.mkdtemp(prefix="vendor-", dir=HERE))
    packs = Path(tempfile.mkdtemp(prefix="npm-pack-"))
    try:
        for pkg in lock["packages"]:
            print(f"fetching {pkg['name']}@{pkg['version']} ({pkg['license']}) with npm pack",
                  flush=True)
            data = _npm_pack(pkg["name"], pkg["version"], pkg["integrity"], packs)
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
        shutil.rmtree(packs, ignore_errors=True)
    return DEST


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--force", action="store_true", help="download even if up to date")
    args = parser.parse_args(argv)
    try:
        dest = fetch(force=args.force)
    except (OSError, RuntimeError, ValueError, KeyError, subprocess.TimeoutExpired,
            tarfile.TarError) as exc:
        print(f"could not fetch the book's offline assets: {exc}\n"
              "The book needs them to render math and widgets without a network. "
              "Run this again where npm can reach its registry (npm's own settings "
              "choose the registry or a mirror).", file=sys.stderr)
        return 1
    n = sum(1 for p in dest.rglob("*") if p.is_file())
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"offline assets: {n} files, {size / 1e6:.1f} MB in {dest.relative_to(HERE.parent)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
