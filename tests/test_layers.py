"""The package layers import downward only (docs/design.md has the picture)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "pflkit"

# what each package may import from pflkit (besides itself)
ALLOWED = {
    "functional": set(),
    "models": set(),
    "reporting": set(),
    "data": {"functional"},
    "algorithms": {"functional", "models", "data"},
    "personalize": {"algorithms", "functional", "models"},
    "engines": {"algorithms", "functional", "models", "data"},
    "federation": {"config", "engines", "algorithms", "functional", "models", "data", "reporting"},
    "run": {"federation", "config", "engines", "algorithms", "functional", "models", "data", "reporting"},
    "flower": {"federation", "config", "engines", "algorithms", "functional", "models", "data", "reporting"},
}


def imported_packages(path: Path, package: str) -> set[str]:
    """Top-level pflkit packages a module imports (relative or absolute, at any depth)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level >= 2 and node.module:  # from ..x import y
                out.add(node.module.split(".")[0])
            elif node.level >= 2:  # from .. import x
                out.update(alias.name for alias in node.names)
            elif node.level == 0 and node.module and node.module.startswith("pflkit."):
                out.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            out.update(a.name.split(".")[1] for a in node.names if a.name.startswith("pflkit."))
    return out - {package}


def test_every_package_imports_only_the_layers_below_it():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in sorted((SRC / package).rglob("*.py")):
            for imported in imported_packages(path, package):
                is_pflkit = (SRC / imported).is_dir() or (SRC / f"{imported}.py").is_file()
                if is_pflkit and imported not in allowed:
                    violations.append(f"{path.relative_to(SRC)} imports pflkit.{imported}")
    assert not violations, "\n".join(violations)


def test_the_checker_sees_relative_and_absolute_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("from ..engines import x\nfrom pflkit.run import y\nfrom .. import flower\nfrom .own import z\n")
    assert imported_packages(module, "algorithms") == {"engines", "run", "flower"}
