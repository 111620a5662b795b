"""eval.py is a thin command line over opd.eval.cli (issue 26): library code calls `opd.eval.cli.main(argv)` without
the script, and the evaluation code keeps the team's rules (no function over 80 lines, no import of a top-level
script)."""

import ast
import contextlib
import io
import json
from pathlib import Path

from bench_fixtures import write_vstar_fixture

import eval as eval_py
from opd.eval import cli

ROOT = Path(__file__).resolve().parents[1]
OWN = [ROOT / "eval.py", ROOT / "opd" / "export.py", ROOT / "opd" / "identity.py"] + sorted(
    p for p in (ROOT / "opd" / "eval").glob("*.py") if p.name not in ("answers.py", "live.py"))  # fmt: skip


def functions(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    return names


def test_eval_py_is_the_library_main():
    assert eval_py.main is cli.main and eval_py.EvalConfig is cli.EvalConfig
    source = (ROOT / "eval.py").read_text(encoding="utf-8")
    assert [n for n, _ in functions(ROOT / "eval.py")] == []  # no logic of its own
    assert 'run_cli(main, sys.argv[1:], "eval.py")' in source


def test_no_function_over_80_lines_and_no_top_level_script_imported():
    scripts = {p.stem for p in ROOT.glob("*.py")}  # train, eval, ...
    long = [f"{p.relative_to(ROOT)}:{name} ({n} lines)" for p in OWN for name, n in functions(p) if n > 80]
    assert long == []
    library = [p for p in OWN if p.name != "eval.py"]
    assert {str(p.relative_to(ROOT)): sorted(imported_modules(p) & scripts) for p in library
            if imported_modules(p) & scripts} == {}  # fmt: skip


def test_the_library_main_evaluates_like_the_script(tiny, tmp_path):
    write_vstar_fixture(tmp_path / "data")
    common = ["--model", str(tiny[0]), "--data-dir", str(tmp_path / "data"), "--benchmarks", "vstar",
              "--max-new-tokens", "3", "--device", "cpu", "--no-progress"]  # fmt: skip
    with contextlib.redirect_stdout(io.StringIO()):
        lib = cli.main([*common, "--out", str(tmp_path / "lib")])
        script = eval_py.main([*common, "--out", str(tmp_path / "script")])
    assert lib["results"] == script["results"] and lib["results"]["vstar"]["n"] == 4
    rows = [(tmp_path / k / "vstar" / "predictions.jsonl").read_text().splitlines() for k in ("lib", "script")]
    assert [json.loads(r)["reply"] for r in rows[0]] == [json.loads(r)["reply"] for r in rows[1]]
