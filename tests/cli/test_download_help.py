"""``pflkit download --help`` names every dataset the download table holds."""

from __future__ import annotations

import re

from click.testing import CliRunner

from pflkit.cli import main
from pflkit.data.downloads import DOWNLOADS


def test_download_help_names_every_downloadable_dataset():
    result = CliRunner().invoke(main, ["download", "--help"])
    assert result.exit_code == 0, result.output
    listed = re.search(r"Download dataset NAME \(([^)]*)\)", " ".join(result.output.split()))
    assert listed is not None, result.output
    assert sorted(n.strip() for n in listed.group(1).split(",")) == sorted(DOWNLOADS)
