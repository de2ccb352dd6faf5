"""A headless Chromium (Debian's `chromium`) driven over the DevTools protocol, for tests that
need a real browser's rules (CORS). Started on 127.0.0.1 in its own session with a fresh
profile, stopped with its whole process group."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import httpx

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0")
START_SECONDS = 60.0
CALL_SECONDS = 120.0


def chromium_binary() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, profile_dir: Path, log_path: Path):
        from websockets.sync.client import connect

        binary = chromium_binary()
        if binary is None:
            raise RuntimeError("chromium is not installed (scripts/install_ci_tools.sh installs it)")
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", "about:blank"],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = profile_dir / "DevToolsActivePort"
        deadline = time.monotonic() + START_SECONDS
        while not (port_file.exists() and len(port_file.read_text().splitlines()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"chromium did not start: {log_path.read_text(errors='replace')[-2000:]}")
            time.sleep(0.1)
        port = int(port_file.read_text().splitlines()[0])
        pages = [t for t in httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=10).json() if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=10)
        self.ids = itertools.count(1)
        self.events: list[dict] = []
        self.call("Page.enable")
        self.call("Network.enable")

    def call(self, method: str, **params) -> dict:
        """One DevTools command; the events that arrive meanwhile are kept in `events`."""
        message_id = next(self.ids)
        self.ws.send(json.dumps({"id": message_id, "method": method, "params": params}))
        deadline = time.monotonic() + CALL_SECONDS
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.monotonic())))
            if message.get("id") == message_id:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message["result"]
            self.events.append(message)

    def open(self, url: str) -> None:
        """Navigate and wait for the load event."""
        self.events.clear()
        self.call("Page.navigate", url=url)
        deadline = time.monotonic() + START_SECONDS
        while not any(e.get("method") == "Page.loadEventFired" for e in self.events):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{url} did not load")
            self.events.append(json.loads(self.ws.recv(timeout=START_SECONDS)))

    def run(self, script: str):
        """Evaluate an async function body in the page and return its JSON-able result."""
        result = self.call("Runtime.evaluate", expression=f"(async () => {{ {script} }})()", awaitPromise=True,
                           returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
            except ProcessLookupError:
                pass
        self._log.close()
