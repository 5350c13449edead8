"""A small Chrome DevTools Protocol client over `--remote-debugging-pipe` (stdlib only).

Chromium reads commands from file descriptor 3 and writes replies and events
to descriptor 4, each message one JSON object ending in a NUL byte; no
websocket, no port, no extra package. One browser, one page (a target
attached with `flatten`), with the network emulated off, used by tests/book/test_browser.py:

    with Browser() as b:
        report = b.open("file:///.../index.html")   # console errors, failed loads
        b.evaluate("document.images.length")
        png = b.screenshot()
"""

from __future__ import annotations

import base64
import json
import os
import select
import subprocess
import time

from trainplan.runbook.pdf import chromium, chromium_flags

LOAD_TIMEOUT_S = 60


class CDPError(RuntimeError):
    pass


class Browser:
    def __init__(self, width: int = 1280, height: int = 900):
        self.width, self.height = width, height
        self._id = 0
        self._buf = b""
        self.events: list[dict] = []

    # ------------------------------------------------------------ process

    def __enter__(self) -> Browser:
        to_chrome_r, self._to_chrome = os.pipe()
        self._from_chrome, from_chrome_w = os.pipe()

        def wire():  # in the child: its fd 3 reads our commands, its fd 4 writes replies
            high_r, high_w = os.dup(to_chrome_r), os.dup(from_chrome_w)  # neither is 3 or 4
            os.dup2(high_r, 3)
            os.dup2(high_w, 4)

        self.proc = subprocess.Popen(
            [chromium(), *chromium_flags(), "--remote-debugging-pipe",
             f"--window-size={self.width},{self.height}", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=wire, pass_fds=(3, 4))  # kept open after wire() runs
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        self.session = self.call("Target.attachToTarget", targetId=target,
                                 flatten=True)["sessionId"]
        for domain in ("Page", "Runtime", "Log", "Network"):
            self.call(f"{domain}.enable", session=True)
        # the network off, as on a cluster's login node: a page that needs it shows the gap
        self.call("Network.emulateNetworkConditions", session=True, offline=True, latency=0,
                  downloadThroughput=-1, uploadThroughput=-1)
        self.call("Emulation.setDeviceMetricsOverride", session=True, width=self.width,
                  height=self.height, deviceScaleFactor=1, mobile=False)
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.call("Browser.close", timeout=10)
        except (CDPError, OSError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_chrome, self._from_chrome):
            try:
                os.close(fd)
            except OSError:
                pass

    # ------------------------------------------------------------ messages

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise CDPError("no reply from chromium in time")
            ready, _, _ = select.select([self._from_chrome], [], [], left)
            if ready:
                chunk = os.read(self._from_chrome, 1 << 20)
                if not chunk:
                    raise CDPError("chromium closed the pipe")
                self._buf += chunk
        msg, self._buf = self._buf.split(b"\0", 1)
        return json.loads(msg)

    def call(self, method: str, session: bool = False, timeout: float = LOAD_TIMEOUT_S,
             **params) -> dict:
        """Send one command and wait for its reply; events that arrive meanwhile are kept."""
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params}
        if session:
            msg["sessionId"] = self.session
        os.write(self._to_chrome, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise CDPError(f"{method}: {reply['error'].get('message')}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, timeout: float = LOAD_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            event = self._read(deadline)
            self.events.append(event)
            if event.get("method") == method:
                return event

    # ------------------------------------------------------------ pages

    def open(self, url: str) -> dict:
        """Load `url`, wait for its load event; return what went wrong while loading.

        {"console": [console errors and uncaught exceptions],
         "failed": [(url, reason) of every request that failed or answered >= 400],
         "requested": [every URL the page asked for]}
        """
        self.events.clear()
        self.call("Page.navigate", session=True, url=url)
        self.wait_for("Page.loadEventFired")
        self.evaluate("new Promise(r => setTimeout(r, 150))", await_promise=True)  # late errors
        console, failed, urls = [], [], {}
        for e in self.events:
            method, p = e.get("method"), e.get("params", {})
            if method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                console.append(" ".join(str(a.get("value", a.get("description", "")))
                                        for a in p.get("args", [])))
            elif method == "Runtime.exceptionThrown":
                d = p.get("exceptionDetails", {})
                console.append(d.get("exception", {}).get("description") or d.get("text", ""))
            elif method == "Log.entryAdded" and p["entry"].get("level") == "error":
                console.append(f"{p['entry'].get('text', '')} {p['entry'].get('url', '')}")
            elif method == "Network.requestWillBeSent":
                urls[p["requestId"]] = p["request"]["url"]
            elif method == "Network.loadingFailed":
                failed.append((urls.get(p["requestId"], "?"), p.get("errorText", "")))
            elif method == "Network.responseReceived" and p["response"].get("status", 0) >= 400:
                failed.append((p["response"]["url"], str(p["response"]["status"])))
        return {"console": console, "failed": failed, "requested": list(urls.values())}

    def evaluate(self, expression: str, await_promise: bool = False):
        out = self.call("Runtime.evaluate", session=True, expression=expression,
                        returnByValue=True, awaitPromise=await_promise)
        if "exceptionDetails" in out:
            raise CDPError(f"{expression[:60]}: {out['exceptionDetails'].get('text')}")
        return out["result"].get("value")

    def screenshot(self, full_page: bool = False) -> bytes:
        params = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        return base64.b64decode(self.call("Page.captureScreenshot", session=True,
                                          **params)["data"])
