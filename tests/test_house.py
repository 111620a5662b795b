"""The house's rules, measured on the code (every import counted, function-level ones included):

- train.py is the command line (at most 300 lines); the loop's `Run.step` reads as Algorithm 1 (at most 70 lines);
  no function in train.py, eval.py or opd/ is over 80 lines;
- the library never imports a script (train.py, eval.py);
- no import cycle among opd's modules;
- the loop (opd/loop.py) imports no objective; an objective imports no other objective and no evaluation code.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARY = sorted((ROOT / "opd").rglob("*.py"))


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path) -> set[str]:
    """Every module `path` imports, anywhere in the file (`from opd import lora` names opd.lora)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}
    return out


def graph() -> dict[str, set[str]]:
    """opd module -> the opd modules it imports (and, for a submodule, its package)."""
    names = {module_name(p) for p in LIBRARY}
    edges = {}
    for p in LIBRARY:
        me = module_name(p)
        found = {m for m in imports(p) if m in names and m != me}
        found |= {".".join(m.split(".")[:k]) for m in found for k in range(2, m.count(".") + 1)} - {me}
        edges[me] = found & names
    return edges


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.lineno, node.end_lineno - node.lineno + 1


def test_train_py_is_the_command_line_and_the_step_reads_as_algorithm_1():
    assert len((ROOT / "train.py").read_text().splitlines()) <= 300
    tree = ast.parse((ROOT / "opd" / "loop.py").read_text())
    (run,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Run"]
    (step,) = [n for n in run.body if isinstance(n, ast.FunctionDef) and n.name == "step"]
    assert step.end_lineno - step.lineno + 1 <= 70


def test_no_function_over_80_lines():
    long = [f"{p.relative_to(ROOT)}:{line} {name} ({n})" for p in [ROOT / "train.py", ROOT / "eval.py", *LIBRARY]
            for name, line, n in functions(p) if n > 80]  # fmt: skip
    assert not long, long


def test_the_library_never_imports_a_script():
    found = [f"{p.relative_to(ROOT)} imports {m}" for p in LIBRARY for m in imports(p) if m.split(".")[0] in ("train", "eval")]
    assert not found, found


def test_no_import_cycle():
    edges = graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(edges[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(edges):
        if m not in state:
            cycle = visit(m)
            assert cycle is None, " -> ".join(cycle)


@pytest.fixture(scope="module")
def objectives() -> set[str]:
    from opd.methods import METHODS

    return {m.objective.__module__ for m in METHODS.values()}


def test_the_loop_imports_no_objective(objectives):
    assert not graph()["opd.loop"] & objectives


def test_an_objective_imports_no_other_objective_and_no_evaluation_code(objectives):
    edges = graph()
    for name in objectives:
        others = edges[name] & (objectives - {name})
        evaluation = {m for m in edges[name] if m == "opd.eval" or m.startswith("opd.eval.")}
        assert not others and not evaluation, (name, others, evaluation)


@pytest.mark.slow
def test_the_package_installs_and_its_tools_run_from_any_folder(tmp_path):
    """`pip install .` installs the library (opd and its subpackages; not the scripts), and `python -m opd.export
    --help` runs from a folder outside the checkout."""
    import os
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site"
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".venv*", ".git", "runs", "build", "*.egg-info", "__pycache__"))
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=600)  # fmt: skip
    assert pip.returncode == 0, pip.stderr[-2000:]
    assert (site / "opd" / "eval" / "cli.py").is_file() and (site / "opd" / "toy").is_dir()
    assert not (site / "train.py").exists() and not (site / "tests").exists()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-m", "opd.export", "--help"], cwd=elsewhere, env=env, capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert run.returncode == 0 and "usage: python -m opd.export" in run.stdout, run.stderr[-2000:]
