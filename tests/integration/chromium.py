"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol on a pipe.

`--remote-debugging-pipe` makes Chromium read commands on fd 3 and answer on fd 4 as
NUL-terminated JSON: no websocket library and no open port needed.
"""

from __future__ import annotations

import base64
import json
import os
import select
import shutil
import subprocess
from pathlib import Path
from typing import Any

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--remote-debugging-pipe",
]
TIMEOUT_SECONDS = 30


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Chromium:
    def __init__(self, profile: Path, width: int = 1280, height: int = 900) -> None:
        self.width, self.height = width, height
        commands_r, self._commands = os.pipe()
        self._answers, answers_w = os.pipe()
        flags = [*FLAGS, f"--user-data-dir={profile}", f"--window-size={width},{height}"]
        self.process = subprocess.Popen(
            # The shell puts our pipe ends on fds 3 and 4, where Chromium expects them.
            [
                "bash",
                "-c",
                f'exec "$0" "$@" 3<&{commands_r} 4>&{answers_w}',
                chromium_path(),
                *flags,
                "about:blank",
            ],
            pass_fds=(commands_r, answers_w),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        os.close(commands_r)
        os.close(answers_w)
        self._buffer = b""
        self._next_id = 0
        self._events: list[dict] = []
        target = self.call("Target.createTarget", url="about:blank")["targetId"]
        attached = self.call("Target.attachToTarget", targetId=target, flatten=True)
        self.session = attached["sessionId"]
        self.call("Page.enable", session=self.session)

    def call(self, method: str, session: str | None = None, **params: Any) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params}
        if session:
            message["sessionId"] = session
        os.write(self._commands, json.dumps(message).encode() + b"\0")
        while True:
            answer = self._read()
            if answer.get("id") == self._next_id:
                if "error" in answer:
                    raise RuntimeError(f"{method}: {answer['error']}")
                return answer["result"]
            if "method" in answer:
                self._events.append(answer)  # an event that came before our answer

    def wait_event(self, name: str) -> dict:
        """The first event `name` since the last `forget_events()`."""
        while True:
            message = self._events.pop(0) if self._events else self._read()
            if message.get("method") == name:
                return message.get("params", {})

    def forget_events(self) -> None:
        self._events.clear()

    def _read(self) -> dict:
        while b"\0" not in self._buffer:
            ready, _, _ = select.select([self._answers], [], [], TIMEOUT_SECONDS)
            if not ready:
                raise TimeoutError(f"chromium said nothing for {TIMEOUT_SECONDS} s")
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                raise RuntimeError(f"chromium exited ({self.process.poll()})")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    # --- what the tests use -----------------------------------------------------------------

    def open(self, url: str) -> None:
        self.forget_events()
        self.call("Page.navigate", session=self.session, url=url)
        self.wait_event("Page.loadEventFired")

    def evaluate(self, expression: str, wait_load: bool = False) -> Any:
        """The value of `expression`; `wait_load`: it navigates, wait for the new page."""
        self.forget_events()
        result = self.call(
            "Runtime.evaluate",
            session=self.session,
            expression=expression,
            returnByValue=True,
            awaitPromise=True,
        )
        if wait_load:
            self.wait_event("Page.loadEventFired")
        return result["result"].get("value")

    def text(self) -> str:
        return self.evaluate("document.body.innerText")

    def screenshot(self, path: Path) -> bytes:
        png = base64.b64decode(
            self.call("Page.captureScreenshot", session=self.session, format="png")["data"]
        )
        path.write_bytes(png)
        return png

    def count_pixels(self, png: bytes, rgb: tuple[int, int, int]) -> int:
        """Pixels of colour `rgb` in `png`, decoded by Chromium itself on a blank page."""
        self.open("about:blank")
        data = base64.b64encode(png).decode()
        return self.evaluate(
            f"""(async () => {{
                const image = new Image();
                image.src = "data:image/png;base64,{data}";
                await image.decode();
                const canvas = new OffscreenCanvas(image.width, image.height);
                const context = canvas.getContext("2d");
                context.drawImage(image, 0, 0);
                const pixels = context.getImageData(0, 0, image.width, image.height).data;
                let count = 0;
                for (let i = 0; i < pixels.length; i += 4) {{
                    if (pixels[i] === {rgb[0]} && pixels[i + 1] === {rgb[1]}
                        && pixels[i + 2] === {rgb[2]}) count++;
                }}
                return count;
            }})()"""
        )

    def close(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        os.close(self._commands)
        os.close(self._answers)
