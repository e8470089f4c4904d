"""The package layers import downward only (docs/explanations/design.md has the picture).

Every module under src/pflkit is scanned, top-level ones (config.py, cli.py, bench*.py) included,
and every import form is resolved to the pflkit "unit" it reaches (a subpackage, a top-level
module, or the root package ``pflkit`` itself): ``import pflkit.x``, ``from pflkit.x import y``,
``from pflkit import x``, and relative imports of any level (``from . import x``,
``from ..x import y``, ``from .. import x``), resolved against the importing module's package.
Imports inside functions (lazy imports) count like any other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "pflkit"
ROOT = "pflkit"  # the root package (src/pflkit/__init__.py: only __version__)
BENCHMARKS = "benchmarks"  # the scripts of benchmarks/, checked like a unit
BENCHMARK_DIR = SRC.parents[1] / "benchmarks"
DESIGN = SRC.parents[1] / "docs" / "explanations" / "design.md"

_BASE = {"functional", "models", "data"}
_CORE = _BASE | {"algorithms"}
_BELOW_FEDERATION = _CORE | {"engines", "methods", "config"}
_BELOW_APPS = _BELOW_FEDERATION | {"federation", "reporting"}

# What each unit may import from pflkit besides itself and the root package. Every unit that exists
# under src/pflkit must have an entry (a new module fails test_every_unit_has_an_allowed_entry), and
# docs/explanations/design.md's table of layers must say the same (test_design_md_states_these_layers).
ALLOWED: dict[str, set[str]] = {
    ROOT: set(),  # the root package imports nothing of pflkit (everyone may import it)
    # leaves
    "functional": set(),  # parameter dicts, seeded streams, losses, SGD
    "models": set(),
    "reporting": set(),  # summaries, plots, the papers' tables: knows no other layer
    "data": {"functional"},
    "algorithms": {"functional", "models", "data"},
    # siblings above algorithms: engines do not know ALA, ALA does not know engines
    "personalize": {"algorithms", "functional", "models", "data"},
    "engines": {"algorithms", "functional", "models", "data"},
    # the registry with its plug-ins: where ALA is registered, explicitly
    "methods": {"algorithms", "personalize", "models"},
    # the config schema validates names against the registry; no plug-in, engine or report
    "config": _CORE | {"methods"},
    # the methods as users read them: the listing and the documentation pages, from the cards
    "catalogue": {"methods", "algorithms", "engines"},
    # what both the simulator and Flower need; no summaries or plots (those belong to run/ and flower/)
    "federation": _BELOW_FEDERATION,  # summaries and figures come in through run_all's `report`
    # the simulator and Flower: each other's peers, so flower does not import run/ nor run/ flower/
    "run": _BELOW_APPS,
    "flower": _BELOW_APPS,
    # entry points
    "bench": _BELOW_APPS | {"run"},
    "bench_scale": _BELOW_APPS | {"run", "bench"},
    "cli": _BELOW_APPS | {"run", "flower", "bench", "bench_scale", "catalogue"},
    # the scripts under benchmarks/ (outside the package): the library as a user sees it
    BENCHMARKS: _BELOW_APPS | {"run", "bench", "bench_scale"},
}


def units(src: Path = SRC) -> set[str]:
    """The root package, every subpackage and every top-level module of ``src``."""
    subpackages = {p.relative_to(src).parts[0] for p in src.glob("*/**/*.py")}
    modules = {p.stem for p in src.glob("*.py") if p.stem != "__init__"}
    return {ROOT} | subpackages | modules | ({BENCHMARKS} if src == SRC else set())


def module_name(path: Path, src: Path = SRC) -> tuple[str, bool]:
    """Dotted name of the module at ``path`` and whether it is a package's ``__init__``."""
    parts = [ROOT, *path.relative_to(src).with_suffix("").parts]
    if parts[-1] == "__init__":
        return ".".join(parts[:-1]), True
    return ".".join(parts), False


def unit_of(module: str, known: set[str]) -> str | None:
    """The pflkit unit a dotted module (or root attribute) name belongs to; None outside pflkit."""
    parts = module.split(".")
    if parts[0] != ROOT:
        return None
    if len(parts) > 1 and parts[1] in known and parts[1] != ROOT:
        return parts[1]
    return ROOT  # `import pflkit`, or a name defined in pflkit/__init__.py (`from pflkit import __version__`)


def imported_units(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, unit) for every import of a pflkit unit in ``source``, the text of ``module``."""
    package = module if is_package else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(source)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                if node.level - 1 >= len(base):
                    raise ValueError(f"{module}:{node.lineno}: relative import beyond the top-level package")
                base = base[: len(base) - (node.level - 1)]
                resolved = ".".join(base + ([node.module] if node.module else []))
            else:
                resolved = node.module or ""
            if resolved == ROOT:  # from pflkit import x / from . import x at the top: x may be a unit
                targets = [f"{ROOT}.{alias.name}" for alias in node.names]
            else:
                targets = [resolved]
        for target in targets:
            unit = unit_of(target, known)
            if unit is not None:
                out.append((node.lineno, unit))
    return out


def own_unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def edges(src: Path = SRC) -> dict[tuple[str, str], list[str]]:
    """(importer, imported) unit pairs of every module under ``src`` (and, for the real package,
    of every script under benchmarks/), with their file:line."""
    known = units(src)
    out: dict[tuple[str, str], list[str]] = {}
    for path in sorted(src.rglob("*.py")):
        module, is_package = module_name(path, src)
        own = own_unit(module)
        for line, unit in imported_units(path.read_text(encoding="utf-8"), module, is_package, known):
            if unit != own:
                out.setdefault((own, unit), []).append(f"{path.relative_to(src).as_posix()}:{line}")
    if src == SRC:
        for path in sorted(BENCHMARK_DIR.glob("*.py")):
            for line, unit in imported_units(path.read_text(encoding="utf-8"), f"benchmarks.{path.stem}", False, known):
                out.setdefault((BENCHMARKS, unit), []).append(f"benchmarks/{path.name}:{line}")
    return out


def violations(found: dict[tuple[str, str], list[str]], allowed: dict[str, set[str]]) -> list[str]:
    bad = []
    for (importer, imported), where in sorted(found.items()):
        if imported == ROOT:
            continue
        if importer not in allowed:
            bad.append(f"{importer} has no ALLOWED entry ({', '.join(where)})")
        elif imported not in allowed[importer]:
            bad.append(f"{importer} imports pflkit.{imported}: {', '.join(where)}")
    return bad


def test_every_unit_has_an_allowed_entry():
    assert units() == set(ALLOWED)
    assert all(imported in ALLOWED for targets in ALLOWED.values() for imported in targets)


def test_every_module_imports_only_the_layers_below_it():
    found = edges()
    assert not (problems := violations(found, ALLOWED)), "\n".join(problems)


def test_the_layering_is_acyclic():
    order, done = [], set()

    def visit(unit, stack):
        assert unit not in stack, f"import cycle allowed: {' -> '.join([*stack, unit])}"
        if unit not in done:
            for below in sorted(ALLOWED[unit]):
                visit(below, [*stack, unit])
            done.add(unit)
            order.append(unit)

    for unit in sorted(ALLOWED):
        visit(unit, [])
    assert ALLOWED["federation"].isdisjoint(
        {"run", "flower", "cli", "bench", "bench_scale", "reporting", "personalize"}
    )
    assert ALLOWED["config"].isdisjoint({"reporting", "personalize", "engines", "federation"})
    assert "run" not in ALLOWED["flower"] and "flower" not in ALLOWED["run"]
    assert "personalize" not in ALLOWED["engines"] and "engines" not in ALLOWED["personalize"]


def test_real_edges_are_seen():
    """Imports the source is known to hold, in several forms, are found (guards a blind scanner)."""
    found = edges()
    assert ("methods", "personalize") in found  # methods.py: `from . import personalize`
    assert ("config", "methods") in found  # config.py: `from .methods import ...`
    assert (BENCHMARKS, "federation") in found  # benchmarks/profile_round.py: `from pflkit.federation...`
    assert ("data", "functional") in found  # data/partition/spec.py: absolute `from pflkit.functional.streams ...`
    assert ("federation", ROOT) in found  # federation/results.py: `from .. import __version__`
    assert ("cli", "bench_scale") in found  # cli.py: a lazy `from .bench_scale import ...`


SYNTHETIC = """\
import os
import pflkit.run
import pflkit
from pflkit.reporting.plots import plot_accuracy
from pflkit import cli, __version__
from pflkit.flower import strategy
from . import bench
from .. import reporting
from ..run.experiment import run_experiment
from ... import data
from .own import helper
from . import own as own2

def lazy():
    from ..bench_scale import ScaleSettings
"""


@pytest.mark.parametrize("module, is_package", [("pflkit.federation.sub.mod", False), ("pflkit.federation.sub", True)])
def test_the_checker_resolves_every_import_form(module, is_package):
    known = units()
    # the module's package is pflkit.federation.sub: `.` is it, `..` is pflkit.federation, `...` is pflkit
    got = imported_units(SYNTHETIC, module, is_package, known)
    assert got == [
        (2, "run"),
        (3, ROOT),
        (4, "reporting"),
        (5, "cli"),
        (5, ROOT),
        (6, "flower"),
        (7, "federation"),
        (8, "federation"),
        (9, "federation"),
        (10, "data"),
        (11, "federation"),
        (12, "federation"),
        (15, "federation"),
    ]


def test_the_checker_reports_forbidden_edges_of_every_form(tmp_path):
    """A fake pflkit tree: federation/ reaching reporting/, run/, flower/, cli and bench_scale by every
    import form, and a top-level config.py reaching run/ by `from . import run`."""
    (tmp_path / "__init__.py").write_text("__version__ = '0'\n")
    for name in ("federation", "reporting", "run", "flower", "engines"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text("")
    for name in ("cli", "bench_scale"):
        (tmp_path / f"{name}.py").write_text("")
    fed = tmp_path / "federation"
    (fed / "a.py").write_text("import pflkit.reporting.plots\n")
    (fed / "b.py").write_text("from pflkit.run.experiment import x\n")
    (fed / "c.py").write_text("from pflkit import flower\n")
    (fed / "d.py").write_text("from .. import cli\n")
    (fed / "e.py").write_text("from ..bench_scale import y\n")
    (fed / "f.py").write_text(
        "def g():\n    from ..engines import z\n    from . import a\n    from .. import __version__\n"
    )
    (fed / "sub").mkdir()
    (fed / "sub" / "__init__.py").write_text("from ...reporting import summarize\n")
    (tmp_path / "config.py").write_text("from . import run\n")
    found = edges(tmp_path)
    assert found == {
        ("federation", "reporting"): ["federation/a.py:1", "federation/sub/__init__.py:1"],
        ("federation", "run"): ["federation/b.py:1"],
        ("federation", "flower"): ["federation/c.py:1"],
        ("federation", "cli"): ["federation/d.py:1"],
        ("federation", "bench_scale"): ["federation/e.py:1"],
        ("federation", "engines"): ["federation/f.py:2"],
        ("federation", ROOT): ["federation/f.py:4"],
        ("config", "run"): ["config.py:1"],
    }
    assert violations(found, ALLOWED) == [
        "config imports pflkit.run: config.py:1",
        "federation imports pflkit.bench_scale: federation/e.py:1",
        "federation imports pflkit.cli: federation/d.py:1",
        "federation imports pflkit.flower: federation/c.py:1",
        "federation imports pflkit.reporting: federation/a.py:1, federation/sub/__init__.py:1",
        "federation imports pflkit.run: federation/b.py:1",
    ]


def test_a_relative_import_above_the_top_package_is_an_error():
    with pytest.raises(ValueError, match="beyond the top-level package"):
        imported_units("from .... import x\n", "pflkit.federation.mod", False, units())


def design_table(text: str) -> dict[str, set[str]]:
    """The table of layers in docs/explanations/design.md: rows ``| `unit`, `unit` | `imported`, ... |`` (a
    row's second cell without backticks, e.g. "nothing", is the empty set)."""
    import re

    rows = {}
    lines = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0].splitlines()  # that section only
    for line in lines:
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) < 2 or set(cells[0]) <= set("-: "):
            continue
        names = re.findall(r"`([^`]+)`", cells[0])
        imported = set(re.findall(r"`([^`]+)`", cells[1]))
        for name in names:
            rows[name] = imported
    return rows


def test_design_md_states_these_layers():
    """docs/explanations/design.md's table of layers is the rule this file checks, unit by unit."""
    table = design_table(DESIGN.read_text(encoding="utf-8"))
    assert table == {unit: allowed for unit, allowed in ALLOWED.items()}


def test_the_core_never_imports_ray():
    """Ray is an extra (pflkit[ray]): only `pflkit sweep --executor ray` imports it (run/cluster.py, lazily)."""
    import subprocess
    import sys

    # a finder that refuses ray makes the test fail where Ray is installed and where it is not
    code = (
        "import sys\n"
        "class NoRay:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'ray' or name.startswith('ray.'):\n"
        "            raise ImportError('the core imported ' + name)\n"
        "sys.meta_path.insert(0, NoRay())\n"
        "import pflkit.cli, pflkit.run.sweep, pflkit.run.cluster, pflkit.flower.server, pflkit.flower.simulation\n"
        "import pflkit.bench, pflkit.bench_scale, pflkit.methods\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
