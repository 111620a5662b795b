"""eval.py is a thin command line over opd.eval.cli (issue 26): library code calls `opd.eval.cli.main(argv)` without
the script, and the evaluation code keeps the team's rules (no function over 80 lines, no import of a top-level
script)."""

import ast
import contextlib
import io
import json
from pathlib import Path

import pytest
from bench_fixtures import write_vstar_fixture

import eval as eval_py
from opd.cli import UserError
from opd.eval import cli

ROOT = Path(__file__).resolve().parents[1]
OWN = [ROOT / "eval.py", ROOT / "opd" / "export.py", ROOT / "opd" / "models" / "identity.py"] + sorted(
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


def fake_run(folder: Path, model: Path) -> Path:
    """A train.py run folder as eval.py reads it: `latest` naming checkpoint-000002/, whose policy/ is `model`."""
    import shutil

    import torch

    ckpt = folder / "checkpoint-000002"
    shutil.copytree(model, ckpt / "policy")
    torch.save({"step": 2}, ckpt / "state.pt")
    (folder / "latest").write_text("checkpoint-000002\n")
    return folder


def test_a_models_name_labels_it_and_names_its_default_out(tmp_path, monkeypatch):
    from opd.eval.config import default_out, model_name

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "lora"
    ckpt = run / "checkpoint-000008"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "merged").mkdir()
    (ckpt / "state.pt").write_bytes(b"")
    (run / "latest").write_text("checkpoint-000008\n")
    (tmp_path / "exports" / "my model").mkdir(parents=True)
    cases = {  # --model: (label, default --out)
        "toy": ("toy", "runs/eval/toy"), "tiny": ("tiny", "runs/eval/tiny"),
        "Qwen/Qwen3.5-4B": ("Qwen3.5-4B", "runs/eval/Qwen3.5-4B"),
        "runs/lora": ("lora", "runs/lora/eval"), str(run): ("lora", "runs/lora/eval"),
        "runs/lora/checkpoint-000008": ("lora-checkpoint-000008", "runs/lora/eval-checkpoint-000008"),
        "runs/lora/checkpoint-000008/policy": ("lora-checkpoint-000008", "runs/lora/eval-checkpoint-000008"),
        "runs/lora/checkpoint-000008/merged": ("lora-checkpoint-000008-merged",
                                               "runs/lora/eval-checkpoint-000008-merged"),
        "exports/my model": ("my-model", "runs/eval/my-model"),
    }  # fmt: skip
    assert {m: (model_name(m), default_out(m)) for m in cases} == cases
    assert (model_name(None, "served-4b"), default_out(None)) == ("served-4b", "runs/eval/served")


def test_the_readmes_two_evaluations_run_in_order_each_in_its_own_folder(tiny, tmp_path, monkeypatch, capsys):
    """`eval.py --model RUN --data-dir D` then `eval.py --model BASE --data-dir D`, without --out: both score (they
    shared runs/eval, and the second refused the first's predictions); each row is labelled by its model's name and
    each run says where it wrote; --compare of the two folders keeps those names. An --out given to both is still
    refused (another model's predictions)."""
    from opd.tiny import build_tiny_model

    monkeypatch.chdir(tmp_path)
    fake_run(tmp_path / "runs" / "default", build_tiny_model(tmp_path / "trained", seed=1))
    common = ["--data-dir", "tiny", "--limit", "3", "--max-new-tokens", "2", "--device", "cpu", "--no-progress"]
    first = cli.main(["--model", "runs/default", *common])
    second = cli.main(["--model", "tiny", *common])
    out = capsys.readouterr().out
    assert "eval.py: wrote runs/default/eval/results.md" in out and "eval.py: wrote runs/eval/tiny/results.md" in out
    assert (first["meta"]["out"], second["meta"]["out"]) == ("runs/default/eval", "runs/eval/tiny")
    assert (first["meta"]["label"], second["meta"]["label"]) == ("default", "tiny")
    assert first["meta"]["label_from"] == "model" and "| default |" in first["table"] and "| tiny |" in second["table"]
    assert first["results"]["zoombench"]["n"] == second["results"]["zoombench"]["n"] == 3  # both views scored
    assert "zoombench@crop" in first["results"] and "zoombench@crop" in second["results"]
    table = cli.main(["--compare", "runs/eval/tiny", "runs/default/eval"])["compare"]
    assert "| tiny |" in table and "| default |" in table
    cli.main(["--model", "tiny", *common, "--out", "runs/shared"])
    with pytest.raises(UserError, match="holds predictions made with other settings"):
        cli.main(["--model", "runs/default", *common, "--out", "runs/shared"])


def test_tiny_is_a_benchmark_folder_for_eval_py_and_train_pys_eval_data():
    """The README's claim: eval.py's --data-dir and train.py's --eval-data take 'tiny' as they take 'toy' (16 held-out
    items of the tiny task, ZoomBench's slot, each with its crop)."""
    from opd.config import TrainConfig
    from opd.eval.live import LiveEval, LiveEvalConfig

    cfg, _ = cli.parse_args(["--model", "tiny", "--data-dir", "tiny"])
    assert (cfg.benchmarks, cfg.view) == ("zoombench", "crop")
    folder = Path(cli.builtin_data(cfg, cli.check_config(cfg)).data_dir)
    rows = json.loads((folder / "zoombench" / "tiny.json").read_text())
    assert len(rows) == 16 and all((folder / "zoombench" / r["teacher_images"][0]).is_file() for r in rows)
    assert TrainConfig(eval_every=2, eval_data="tiny", eval_views="full,crop").problems() == []
    live = LiveEval(LiveEvalConfig(every=2, data="tiny", views="full,crop", limit=0), steps=2)
    assert {k: len(v) for k, v in live.items.items()} == {("zoombench", "full"): 16, ("zoombench", "crop"): 16}
