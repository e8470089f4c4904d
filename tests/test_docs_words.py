"""README, the documentation pages and pflkit's messages describe the product (what it does, how to
use it, how to reproduce a number), never how it was developed: no sessions, leases, issue numbers,
turns or citations of a specification that is not in the repository. CHANGELOG.md is exempt."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

from tests.support.paths import REPO

WORDS = re.compile(r"\bsessions?\b|\blease[sd]?\b|\blent\b|\bissues? #?\d+|\bthis turn\b|\bspec\s*§", re.I)

#: Phrases in which such a word is the product's own or another project's (removed before matching).
ALLOWED = re.compile(
    "|".join(
        [
            r"\brun sessions?\b",  # pflkit's RunSession: one (algorithm, seed) run
            r"\bruns the session\b",  # the same, in the design page
            r"\bRay(?:'s)? sessions?\b|\btoken for that session\b",  # a Ray instance's session
            r"\bprevious session has missed\b",  # a Flower SuperNode's session with the SuperLink
            r"\b[\w.-]+/[\w.-]+ issue #?\d+",  # an issue of another project's repository
        ]
    ),
    re.I,
)


def hits(text: str) -> list[tuple[int, str]]:
    """The development words in ``text`` with their offsets, less the allowed phrases."""
    text = ALLOWED.sub(lambda m: " " * len(m.group(0)), text)
    return [(m.start(), m.group(0)) for m in WORDS.finditer(text)]


def pages() -> list[Path]:
    """README.md and the documentation's Markdown pages (not the committed result cells)."""
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if "results" not in p.relative_to(REPO / "docs").parts]
    return [REPO / "README.md", *docs]


def page_hits(path: Path) -> Iterator[str]:
    """``file:line: 'word'`` for every hit in a Markdown page, outside code blocks and code spans."""
    fenced = False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            for _, word in hits(re.sub(r"`[^`]*`", " ", line)):
                yield f"{path.relative_to(REPO)}:{number}: {word!r}"


def _command_docstrings(tree: ast.Module) -> set[int]:
    """The ids of the docstrings of click commands (their help text)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and isinstance(first := node.body[0], ast.Expr):
            decorators = [d.func if isinstance(d, ast.Call) else d for d in node.decorator_list]
            if any(isinstance(d, ast.Attribute) and d.attr in ("command", "group") for d in decorators):
                found.add(id(first.value))
    return found


def message_hits(path: Path, scripts: bool = False) -> Iterator[str]:
    """``file:line: 'word'`` for every hit in a module's user-facing strings: every string but the
    docstrings of modules, classes and functions (a click command's docstring is its help: kept; so
    is a script's module docstring, its ``--help`` description, with ``scripts``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = set()
    kinds = (
        (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if scripts
        else (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    )
    for node in ast.walk(tree):
        if isinstance(node, kinds) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                docstrings.add(id(first.value))
    docstrings -= _command_docstrings(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            for offset, word in hits(node.value):
                line = node.lineno + node.value[:offset].count("\n")
                yield f"{path.relative_to(REPO)}:{line}: {word!r}"


def test_readme_and_documentation_pages_describe_the_product() -> None:
    found = [hit for path in pages() for hit in page_hits(path)]
    assert not found, "words about how pflkit was developed:\n" + "\n".join(found)


def test_messages_and_command_help_describe_the_product() -> None:
    found = [hit for path in sorted((REPO / "src" / "pflkit").rglob("*.py")) for hit in message_hits(path)]
    assert not found, "words about how pflkit was developed, in user-facing strings:\n" + "\n".join(found)


def test_benchmark_scripts_help_and_messages_describe_the_product() -> None:
    scripts = sorted((REPO / "benchmarks").glob("*.py"))
    assert scripts
    found = [hit for path in scripts for hit in message_hits(path, scripts=True)]
    assert not found, "words about how pflkit was developed, in the benchmark scripts:\n" + "\n".join(found)


def test_the_word_check_finds_what_it_should_and_allows_the_products_own_sessions() -> None:
    text = "as the spec §5.4 says; issue 23; one lease; this turn; a GPU lent; the session ended"
    assert [word for _, word in hits(text)] == ["spec §", "issue 23", "lease", "this turn", "lent", "session"]
    assert hits("a run session; a Ray session; TsingZ0/FedALA issue #9; the previous session has missed") == []


#: Tests whose own text holds the citation they look for.
CITATION_CHECKS = {"tests/test_docs_words.py", "tests/cli/test_next_steps.py", "tests/catalogue/test_cards.py"}


def test_code_comments_and_docstrings_cite_only_what_the_repository_ships() -> None:
    # The specification behind the early code is not shipped: a reader cannot open its sections.
    found = []
    for folder in ("src", "tests", "benchmarks", "flower-app"):
        for path in sorted((REPO / folder).rglob("*.py")):
            rel = str(path.relative_to(REPO))
            if rel in CITATION_CHECKS:
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if re.search(r"\bspec\s*§", line, re.I):
                    found.append(f"{rel}:{number}")
    assert not found, "citations of an unshipped specification (cite a docs page or the paper):\n" + "\n".join(found)
