"""A small Chrome DevTools Protocol client over a pipe, for the browser tests.

Chromium started with ``--remote-debugging-pipe`` reads protocol commands
from file descriptor 3 and writes replies and events to descriptor 4, each a
JSON message ended by a NUL byte. That needs no websocket library, no open
port and no download: only the standard library and a Chromium binary.
"""
from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# Everything that would reach out of the machine is off; requests that are
# not file:// go to a proxy on a closed local port and fail at once, and the
# test also fails on any such request it sees (see Page.external_requests).
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-default-apps", "--disable-extensions", "--mute-audio",
    "--disable-features=Translate,MediaRouter,OptimizationHints",
    "--proxy-server=127.0.0.1:9", "--proxy-bypass-list=<-loopback>",
    "--allow-file-access-from-files", "--hide-scrollbars", "--force-color-profile=srgb",
    "--remote-debugging-pipe",
]


def find_chromium() -> str | None:
    """Path of a Chromium/Chrome binary, or None. ``RR_CHROMIUM`` overrides."""
    env = os.environ.get("RR_CHROMIUM")
    if env:
        return env if Path(env).exists() else shutil.which(env)
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
                 "chrome", "headless_shell"):
        path = shutil.which(name)
        if path:
            return path
    return None


class CDPError(RuntimeError):
    pass


class Browser:
    """One headless Chromium with a fresh profile, driven over the pipe."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="rr-chromium-")
        # Our ends: we write commands to w_cmd, read replies from r_out.
        r_cmd, self._w_cmd = os.pipe()
        self._r_out, w_out = os.pipe()

        def _child_fds() -> None:  # runs in the child before exec
            # Via fresh copies, so that neither end overwrites the other.
            a, b = os.dup(r_cmd), os.dup(w_out)
            os.dup2(a, 3)
            os.dup2(b, 4)

        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            pass_fds=(3, 4), preexec_fn=_child_fds)  # kept open after the dup2
        os.close(r_cmd)
        os.close(w_out)
        self._buf = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.width, self.height = width, height
        self.version = self.send("Browser.getVersion")["product"]

    # -- protocol ---------------------------------------------------------
    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            if time.monotonic() > deadline:
                raise TimeoutError("no reply from Chromium")
            chunk = os.read(self._r_out, 1 << 20)
            if not chunk:
                raise CDPError(f"Chromium closed the pipe (exit code {self.proc.poll()})")
            self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 60.0) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self._w_cmd, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_event(self, method: str, session: str, timeout: float = 60.0) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            for i, ev in enumerate(self.events):
                if ev.get("method") == method and ev.get("sessionId") == session:
                    return self.events.pop(i)
            self.events.append(self._read_message(deadline))

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (CDPError, TimeoutError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._w_cmd, self._r_out):
            try:
                os.close(fd)
            except OSError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    # -- pages ------------------------------------------------------------
    def open(self, url: str, timeout: float = 60.0) -> "Page":
        """A fresh tab with logging on and the network emulated offline."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget",
                            {"targetId": target, "flatten": True})["sessionId"]
        page = Page(self, target, session)
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.send(f"{domain}.enable", session=session)
        self.send("Network.emulateNetworkConditions",
                  {"offline": True, "latency": 0, "downloadThroughput": -1,
                   "uploadThroughput": -1}, session=session)
        self.send("Emulation.setDeviceMetricsOverride",
                  {"width": self.width, "height": self.height, "deviceScaleFactor": 1,
                   "mobile": False}, session=session)
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired", session, timeout)
        return page


@dataclass
class Page:
    browser: Browser
    target: str
    session: str
    _seen: list[dict] = field(default_factory=list)

    def _drain(self) -> None:
        keep = []
        for ev in self.browser.events:
            (self._seen if ev.get("sessionId") == self.session else keep).append(ev)
        self.browser.events[:] = keep

    def evaluate(self, expression: str, timeout: float = 60.0):
        """Evaluate JS (awaiting a returned promise) and return its JSON value."""
        res = self.browser.send("Runtime.evaluate",
                                {"expression": expression, "awaitPromise": True,
                                 "returnByValue": True, "timeout": timeout * 1000},
                                session=self.session, timeout=timeout + 5)
        if "exceptionDetails" in res:
            raise CDPError(f"page script failed: {res['exceptionDetails']}")
        return res["result"].get("value")

    def console_errors(self) -> list[str]:
        """Console errors, uncaught exceptions and failed loads seen so far."""
        self._drain()
        out = []
        for ev in self._seen:
            m, p = ev.get("method"), ev.get("params", {})
            if m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                out.append("console.error: " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif m == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                out.append("uncaught: " + str(d.get("exception", {}).get("description")
                                              or d.get("text")))
            elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
                e = p["entry"]
                out.append(f"{e.get('source')}: {e.get('text')} {e.get('url', '')}".strip())
        return out

    def failed_loads(self) -> list[str]:
        """Resources (scripts, styles, fonts, images, ...) that did not load."""
        self._drain()
        urls = {ev["params"]["requestId"]: ev["params"]["request"]["url"] for ev in self._seen
                if ev.get("method") == "Network.requestWillBeSent"}
        return [f"{urls.get(ev['params']['requestId'], '?')}: {ev['params'].get('errorText')}"
                for ev in self._seen if ev.get("method") == "Network.loadingFailed"
                and not ev["params"].get("canceled")]

    def external_requests(self) -> list[str]:
        """URLs the page tried to fetch that are not on disk or inline."""
        self._drain()
        urls = [ev["params"]["request"]["url"] for ev in self._seen
                if ev.get("method") == "Network.requestWillBeSent"]
        return [u for u in urls if not u.startswith(("file:", "data:", "blob:", "about:"))]

    def screenshot(self, path: Path, max_height: int = 6000) -> None:
        """PNG of the whole page (cut at max_height CSS pixels)."""
        height = min(int(self.evaluate("document.documentElement.scrollHeight")), max_height)
        res = self.browser.send("Page.captureScreenshot",
                                {"format": "png", "captureBeyondViewport": True,
                                 "clip": {"x": 0, "y": 0, "width": self.browser.width,
                                          "height": height, "scale": 1}},
                                session=self.session)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(res["data"]))

    def screenshot_region(self, path: Path, box: dict, margin: int = 16) -> None:
        """PNG of one region of the page (document coordinates, CSS pixels)."""
        clip = {"x": max(0.0, box["x"] - margin), "y": max(0.0, box["y"] - margin),
                "width": min(box["width"] + 2 * margin, self.browser.width),
                "height": min(box["height"] + 2 * margin, 4000), "scale": 1}
        res = self.browser.send("Page.captureScreenshot",
                                {"format": "png", "captureBeyondViewport": True, "clip": clip},
                                session=self.session)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(base64.b64decode(res["data"]))

    def close(self) -> None:
        self.browser.send("Target.closeTarget", {"targetId": self.target})
