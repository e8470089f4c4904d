"""Headless Chromium for the tests that look at a page. Without a browser on PATH those tests skip,
unless PFLKIT_REQUIRE_BROWSER=1 (.ci/run sets it and installs Chromium): then they fail."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome")
_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]


def required() -> bool:
    """Whether a missing browser (or what it needs) fails the test instead of skipping it."""
    return os.environ.get("PFLKIT_REQUIRE_BROWSER") == "1"


def skip_or_fail(reason: str) -> None:
    """Fail with ``reason`` under PFLKIT_REQUIRE_BROWSER=1, skip otherwise."""
    if required():
        pytest.fail(f"PFLKIT_REQUIRE_BROWSER=1 but {reason}")
    pytest.skip(f"{reason} (.ci/run installs it)")


def find_browser() -> str:
    """The path of a Chromium on PATH (a skip or a failure when there is none)."""
    browser = next((path for name in BROWSERS if (path := shutil.which(name))), None)
    if browser is None:
        skip_or_fail(f"no {', '.join(BROWSERS)} on PATH")
    assert browser is not None
    return browser


def screenshot(browser: str, url: str, shot: Path, width: int = 1200, height: int = 2000) -> None:
    """A PNG of ``url`` at ``width`` x ``height`` pixels, written to ``shot``."""
    args = [browser, *_FLAGS, f"--screenshot={shot}", f"--window-size={width},{height}", url]
    subprocess.run(args, check=True, timeout=120, capture_output=True)


def dump_dom(browser: str, url: str) -> str:
    """The page's DOM after load (its scripts run) as HTML."""
    args = [browser, *_FLAGS, "--dump-dom", url]
    return subprocess.run(args, check=True, timeout=120, capture_output=True, text=True).stdout
