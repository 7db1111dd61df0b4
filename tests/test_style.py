"""The style rules a reader relies on, checked on every Python file of the project: no
line over 100 characters (and few over 90 outside the tests), no function over 60 lines,
and no import circle. (No quota on input checks: a check belongs wherever outside input
arrives, and a quota was met by cutting checks and aliasing helpers.)"""

import ast
import pathlib

ROOT = pathlib.Path(__file__).parent.parent
FOLDERS = ("", "config/", "tests/", "tasks/", "inference/", "scaleout/", "bench/", "bench/peers/")
FILES = sorted(p for folder in FOLDERS for p in ROOT.glob(folder + "*.py"))
MAX_LINE, MAX_FUNCTION = 100, 60
WIDE, MAX_WIDE_SHARE = 90, 0.08   # at most 8% of non-blank lines over 90 (tests aside)


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


def test_few_lines_are_over_90_characters():
    lines = [line for p in FILES if p.parent.name != "tests" and p.name != "conftest.py"
             and not p.name.startswith("test_") for line in p.read_text().splitlines()
             if line.strip()]
    wide = sum(len(line) > WIDE for line in lines)
    assert wide <= MAX_WIDE_SHARE * len(lines), f"{wide} of {len(lines)} lines over {WIDE}"


def module_name(path):
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


def test_no_import_circle():
    modules = {module_name(p): p for p in FILES}
    imports = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        imports[name] = found & set(modules) - {name}

    def reachable(start):
        seen, todo = set(), [start]
        while todo:
            for m in imports[todo.pop()] - seen:
                seen.add(m)
                todo.append(m)
        return seen
    circles = sorted(m for m in modules if m in reachable(m))
    assert not circles, f"modules that import themselves through others: {circles}"
