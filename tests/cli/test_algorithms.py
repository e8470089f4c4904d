"""``pflkit algorithms``: one aligned line per method, and the same as JSON."""

from __future__ import annotations

import json

from click.testing import CliRunner

from pflkit.catalogue import names
from pflkit.cli import main


def test_one_aligned_line_per_method_with_its_paper_kind_engine_and_ala():
    result = CliRunner().invoke(main, ["algorithms"])
    assert result.exit_code == 0, result.output
    table = result.output.split("\n\n")[0].splitlines()
    header, rows = table[0], {line.split()[0]: line for line in table[1:]}
    assert list(rows) == names()
    column = header.index("vmap engine")
    assert all(line[column - 2 : column] == "  " for line in rows.values())  # the columns line up
    assert "McMahan et al., AISTATS 2017" in rows["fedavg"] and "global" in rows["fedavg"]
    assert rows["fedfomo"][column:].startswith("one by one") and rows["fedfomo"].rstrip().endswith("no")
    assert rows["pfedme"][column:].startswith("batched (step function)")
    assert rows["ditto"].rstrip().endswith("yes") and "personalised" in rows["ditto"]
    assert "fedavg+ala" not in rows


def test_json_lists_the_same_methods_for_machines():
    result = CliRunner().invoke(main, ["algorithms", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["name"]: r for r in json.loads(result.output)}
    assert list(rows) == names()
    assert rows["fedavg"]["paper"]["year"] == 2017 and rows["fedavg"]["kind"] == "global"
    assert rows["fedprox"]["ala_name"] == "fedprox+ala" and rows["apple"]["ala_name"] is None
    assert rows["partialfed"]["vmap"] == "one by one" and rows["partialfed"]["reconstruction"] is True
    assert rows["fedala"]["full_name"] == "FedALA"
