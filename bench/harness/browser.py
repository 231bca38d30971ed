"""A small Chrome DevTools Protocol driver for headless Chromium: the dashboard's tests load
the page as a browser would (its scripts run, its fetches carry the credentials) and read
what it shows, its console errors and failed requests, and the README's screenshot is taken
the same way (``python -m bench.harness.browser --screenshot docs/dashboard.png --url URL
--key KEY``, once the page has polled a few times).

Debian's ``/usr/bin/chromium`` (``scripts/ensure-system.sh test`` installs it) runs with a
profile in a temporary folder and a debugging port it picks itself, read back from that
folder's ``DevToolsActivePort``, so parallel runs never collide; ``Browser`` stops it and
removes the folder on exit, always. The protocol is spoken over one websocket with
``websockets``' synchronous client: a command waits for its answer, and the events that
arrive meanwhile go to their page.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

CHROMIUM = "/usr/bin/chromium"
VIEWPORT = (1280, 900)
# the resource types a page fetches itself: a favicon or a prefetch is not the page's error
OWN_RESOURCES = frozenset({"Document", "Script", "Stylesheet", "Fetch", "XHR"})


class BrowserError(RuntimeError):
    """A protocol command failed, or the page's script threw."""


class CDP:
    """One websocket to the browser: commands by id, every event handed to the listener of
    its session (a page), in order, while a command waits or when ``pump`` is called."""

    def __init__(self, url: str) -> None:
        # no proxy (the browser is local); screenshots are over the 1 MiB default frame size
        self.ws: ClientConnection = connect(
            url, proxy=None, max_size=None, open_timeout=20, legacy=True
        )
        self.ids = itertools.count(1)
        self.listeners: dict[str, Callable[[dict[str, Any]], None]] = {}

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        message_id = next(self.ids)
        message: dict[str, Any] = {"id": message_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        self.ws.send(json.dumps(message))
        deadline = time.monotonic() + 60
        while True:
            answer = self._receive(max(0.0, deadline - time.monotonic()))
            if answer is None:
                raise BrowserError(f"{method}: no answer in 60 s")
            if answer.get("id") == message_id:
                if "error" in answer:
                    raise BrowserError(f"{method}: {answer['error']}")
                return answer.get("result", {})

    def pump(self) -> None:
        """Hand out the events that have arrived, without waiting for more."""
        while self._receive(0) is not None:
            pass

    def _receive(self, timeout_s: float) -> dict[str, Any] | None:
        """The next message (an event is dispatched, then returned too); None on timeout."""
        try:
            message = json.loads(self.ws.recv(timeout=timeout_s))
        except TimeoutError:
            return None
        listener = self.listeners.get(message.get("sessionId", ""))
        if "method" in message and listener is not None:
            listener(message)
        return message

    def close(self) -> None:
        self.ws.close()


class Page:
    """One tab: evaluate JavaScript in it, wait for a condition, take a screenshot, and the
    errors it met (console errors, uncaught exceptions, its own failed requests)."""

    def __init__(self, cdp: CDP, session: str) -> None:
        self.cdp = cdp
        self.session = session
        self._errors: list[str] = []
        self._types: dict[str, str] = {}  # request id -> resource type
        cdp.listeners[session] = self._on_event

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.cdp.call(method, params, self.session)

    @property
    def console_errors(self) -> list[str]:
        self.cdp.pump()
        return list(self._errors)

    def evaluate(self, expression: str) -> Any:
        """The expression's value (a promise awaited), as JSON; its exception raised."""
        result = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression!r} threw: {text}")
        return result.get("result", {}).get("value")

    def wait_for(self, expression: str, timeout_s: float = 30, interval_s: float = 0.2) -> Any:
        """The expression's first truthy value, evaluated every ``interval_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.evaluate(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expression!r} still {value!r} after {timeout_s} s")
            time.sleep(interval_s)

    def screenshot(self, path: str | Path) -> Path:
        """The viewport as a PNG at ``path``."""
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(base64.b64decode(data))
        return target

    def _on_event(self, message: dict[str, Any]) -> None:
        method, params = message["method"], message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") in ("error", "assert"):
            args = params.get("args", [])
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in args)
            self._errors.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            text = details.get("exception", {}).get("description") or details.get("text")
            self._errors.append(f"exception: {text}")
        elif method == "Log.entryAdded" and params.get("entry", {}).get("level") == "error":
            entry = params["entry"]
            self._errors.append(
                f"log ({entry.get('source')}): {entry.get('text')} {entry.get('url', '')}"
            )
        elif method.startswith("Network."):
            self._on_network(method, params)

    def _on_network(self, method: str, params: dict[str, Any]) -> None:
        """The page's own requests that failed or answered with an error status."""
        if method == "Network.requestWillBeSent":
            self._types[params["requestId"]] = params.get("type", "Other")
        elif method == "Network.responseReceived" and params.get("type") in OWN_RESOURCES:
            response = params["response"]
            if response.get("status", 0) >= 400:
                self._errors.append(f"HTTP {response['status']}: {response.get('url')}")
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            kind = self._types.get(params["requestId"], params.get("type"))
            if kind in OWN_RESOURCES:
                self._errors.append(f"request failed ({kind}): {params.get('errorText')}")


class Browser:
    """Headless Chromium for one ``with`` block: started on entry, stopped (its process
    group: the renderers too) and its profile removed on exit, whatever happened."""

    def __init__(self, chromium: str = CHROMIUM, start_timeout_s: float = 30) -> None:
        self.chromium = chromium
        self.start_timeout_s = start_timeout_s
        self.profile: str | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.cdp: CDP | None = None

    def __enter__(self) -> Browser:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        self.profile = tempfile.mkdtemp(prefix="prefix-serve-chromium-")
        args = [
            self.chromium, "--headless", "--no-sandbox", "--disable-gpu",
            "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
            "--no-first-run", "--no-default-browser-check", "--disable-extensions",
            "about:blank",
        ]  # fmt: skip
        self.process = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )
        port, path = self._debugging_address()
        self.cdp = CDP(f"ws://127.0.0.1:{port}{path}")

    def _debugging_address(self) -> tuple[int, str]:
        """The port and path Chromium writes to its profile once it listens."""
        assert self.profile is not None and self.process is not None
        active = Path(self.profile) / "DevToolsActivePort"
        deadline = time.monotonic() + self.start_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrowserError(f"{self.chromium} exited with {self.process.returncode}")
            lines = active.read_text().split() if active.exists() else []
            if len(lines) >= 2:
                return int(lines[0]), lines[1]
            time.sleep(0.05)
        raise BrowserError(
            f"{self.chromium} wrote no DevToolsActivePort in {self.start_timeout_s} s"
        )

    def open(self, url: str, basic_auth: tuple[str, str] | None = None) -> Page:
        """A new tab at ``url`` (loaded), with a 1280x900 viewport; ``basic_auth`` (user,
        password) is sent with every request it makes, its fetches included."""
        assert self.cdp is not None, "use Browser in a with block"
        target = self.cdp.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        attached = self.cdp.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self.cdp, attached["sessionId"])
        for domain in ("Runtime", "Log", "Network", "Page"):
            page.call(f"{domain}.enable")
        width, height = VIEWPORT
        page.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        if basic_auth is not None:
            token = base64.b64encode(":".join(basic_auth).encode()).decode()
            page.call(
                "Network.setExtraHTTPHeaders", {"headers": {"Authorization": f"Basic {token}"}}
            )
        navigated = page.call("Page.navigate", {"url": url})
        if navigated.get("errorText"):
            raise BrowserError(f"{url}: {navigated['errorText']}")
        page.wait_for("document.readyState === 'complete'")
        return page

    def close(self) -> None:
        cdp, self.cdp = self.cdp, None
        if cdp is not None:
            with contextlib.suppress(Exception):  # gone: its process group is stopped below
                cdp.call("Browser.close")
            cdp.close()
        process, self.process = self.process, None
        if process is not None:
            self._stop(process)
        profile, self.profile = self.profile, None
        if profile is not None:
            shutil.rmtree(profile, ignore_errors=True)

    @staticmethod
    def _stop(process: subprocess.Popen[bytes]) -> None:
        """Chromium and the processes it started (its own session's group, by its id)."""
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            try:
                process.wait(wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", required=True, help="e.g. http://HOST:8000/dashboard")
    parser.add_argument("--key", help="an API key (sent as the Basic password)")
    parser.add_argument("--screenshot", required=True, help="the PNG to write")
    parser.add_argument("--polls", type=int, default=10, help="polls to wait for (1 s each)")
    args = parser.parse_args(argv)
    with Browser() as browser:
        page = browser.open(args.url, ("dashboard", args.key) if args.key else None)
        polled = f"window.dashboard && window.dashboard.polls >= {args.polls}"
        page.wait_for(polled, 30 + args.polls)
        page.screenshot(args.screenshot)
        for error in page.console_errors:
            print(f"console error: {error}", file=sys.stderr)
    print(args.screenshot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
