"""CHANGELOG.md keeps one section per version, newest first, and the package's version is the newest."""

from __future__ import annotations

import re

from pflkit import __version__
from tests.support.paths import REPO

VERSION = re.compile(r"^## \[(\d+\.\d+\.\d+)\] - (\d{4}-\d{2}-\d{2})$", re.M)


def test_the_package_version_is_the_changelogs_newest() -> None:
    text = (REPO / "CHANGELOG.md").read_text(encoding="utf-8")
    assert text.splitlines()[0] == "# Changelog"
    assert "## [Unreleased]" in text
    versions = VERSION.findall(text)
    assert versions, "CHANGELOG.md names no version as '## [X.Y.Z] - YYYY-MM-DD'"
    assert versions[0][0] == __version__, f"pflkit is {__version__}, CHANGELOG.md's newest section is {versions[0][0]}"
    numbers = [tuple(int(x) for x in v.split(".")) for v, _ in versions]
    assert numbers == sorted(numbers, reverse=True), "CHANGELOG.md's versions are not newest first"
    dates = [d for _, d in versions]
    assert dates == sorted(dates, reverse=True), "CHANGELOG.md's dates are not newest first"
