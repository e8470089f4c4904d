"""The documentation site: built with ``mkdocs build --strict``, served on 127.0.0.1 and looked at
in headless Chromium (the home page, the generated command-line and config references)."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import matplotlib.image
import numpy as np
import pytest

from pflkit.config import describe_keys
from tests.support.browser import dump_dom, find_browser, screenshot, skip_or_fail
from tests.support.paths import REPO

pytestmark = [pytest.mark.integration, pytest.mark.browser]

NAV_SECTIONS = ("Getting started", "Tutorials", "Reference", "Explanations", "Results")


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Iterator[str]:
    """The site built once into a temporary folder and served on loopback: its base URL."""
    if importlib.util.find_spec("mkdocs") is None:
        skip_or_fail("mkdocs is not installed (pip install -e '.[docs]')")
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")])}
    build = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(out)],
        cwd=REPO,
        env={**env, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert build.returncode == 0, build.stderr[-4000:]
    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


def look(site: str, page: str, shot: Path) -> str:
    """The page's text after load, and its screenshot checked to show a rendered page."""
    browser = find_browser()
    screenshot(browser, site + page, shot, 1280, 1600)
    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (1600, 1280)
    ink = pixels.min(axis=2) < 0.5  # dark pixels: text, rules
    assert ink.mean() > 0.003 and np.flatnonzero(ink.any(axis=1)).size > 100, f"{page}: a blank page"
    return dump_dom(browser, site + page)


def text_of(dom: str) -> str:
    """The DOM's text with tags removed (a line-break hint joins its word) and whitespace collapsed."""
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", dom.replace("<wbr>", "")))


def test_the_home_page_shows_the_site_and_its_sections(site, tmp_path) -> None:
    dom = look(site, "", tmp_path / "home.png")
    assert "<title>" in dom and "pflkit" in dom.split("<title>")[1].split("</title>")[0]
    text = text_of(dom)
    for section in NAV_SECTIONS:
        assert section in text, section
    assert "Command line" in text and "Configuration keys" in text  # the generated pages are in the nav


def test_the_cli_page_shows_every_command_and_its_options(site, tmp_path) -> None:
    text = text_of(look(site, "reference/cli/", tmp_path / "cli.png"))
    assert "Command line" in text
    for shown in ("pflkit sweep", "pflkit run", "pflkit plot ala", "--resume", "--executor", "--cpus-per-cell"):
        assert shown in text, shown
    assert "pflkit run --resume results/quick" in text  # the run command's examples


def test_the_config_page_shows_every_key_with_its_default(site, tmp_path) -> None:
    text = text_of(look(site, "reference/config/", tmp_path / "config.png"))
    assert "Configuration keys" in text
    for section in ("[partition]", "[train]", "[run]", "[fedala]"):
        assert section in text, section
    default = {key: value for key, _, value, _ in describe_keys()}["train.local_epochs"]
    assert re.search(rf"train\.local_epochs local_epochs {default} ", text), "local_epochs and its default"


def test_a_method_page(site, tmp_path) -> None:
    text = text_of(look(site, "reference/methods/fedala/", tmp_path / "fedala.png"))
    assert "FedALA" in text
