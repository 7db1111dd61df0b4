"""The style rules a reader relies on, checked on every Python file of the project: no
line over 100 characters, no function over 60 lines."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
FOLDERS = ("", "config/", "tests/", "tasks/", "inference/", "scaleout/", "bench/", "bench/peers/")
FILES = sorted(p for folder in FOLDERS for p in ROOT.glob(folder + "*.py"))
MAX_LINE, MAX_FUNCTION = 100, 60


def test_no_line_is_over_100_characters():
    long = [f"{p.name}:{i}" for p in FILES
            for i, line in enumerate(p.read_text().splitlines(), 1) if len(line) > MAX_LINE]
    assert not long, f"lines over {MAX_LINE} characters: {long}"


def test_no_function_is_over_60_lines():
    long = [f"{p.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for p in FILES for node in ast.walk(ast.parse(p.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION]
    assert not long, f"functions over {MAX_FUNCTION} lines: {long}"
