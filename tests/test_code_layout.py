"""The code as the formatter lays it out: no line packed past the configured width by a
`# fmt: skip` mark (a mark belongs only on an aligned data table, and few of those), and no line
over the configured length, so size limits are met by simplifying, not by packing; and the
package's modules and functions within their sizes."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("slime", "slime_plugins", "tests", "benchmarks")
WIDTH = 110  # pyproject.toml's [tool.ruff] line-length
GENERATED = {os.path.join("tests", "fixtures", "rm_cases.py")}
"""Recorded outputs of slime's own code (a data table under `# fmt: off`), kept as produced."""
MAX_MARKS = 30


def python_files():
    for package in PACKAGES:
        for folder, _, names in os.walk(os.path.join(ROOT, package)):
            for name in names:
                if name.endswith(".py"):
                    path = os.path.join(folder, name)
                    yield os.path.relpath(path, ROOT), path


def test_few_fmt_skip_marks_and_no_line_past_the_width():
    marks, long_lines = [], []
    for rel, path in python_files():
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if re.search(r"#\s*fmt:\s*skip\s*$", line):
                    marks.append(f"{rel}:{n}")
                if len(line.rstrip("\n")) > WIDTH and rel not in GENERATED:
                    long_lines.append(f"{rel}:{n}")
    assert len(marks) <= MAX_MARKS, f"{len(marks)} '# fmt: skip' marks (at most {MAX_MARKS}): {marks[:20]}"
    assert long_lines == [], f"lines over {WIDTH} columns: {long_lines[:20]}"


def test_no_module_of_the_package_over_500_lines_or_function_over_80():
    """The sizes of slime's own code, measured as `ruff format` lays it out."""
    import ast

    big, long_functions = [], []
    for rel, path in python_files():
        if not rel.startswith("slime" + os.sep):
            continue
        with open(path, encoding="utf-8") as f:
            source = f.read()
        if len(source.splitlines()) > 500:
            big.append(rel)
        for node in ast.walk(ast.parse(source)):
            function = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            if function and node.end_lineno - node.lineno + 1 > 80:
                long_functions.append(f"{rel}:{node.lineno} {node.name}")
    assert big == [] and long_functions == [], (big, long_functions)
