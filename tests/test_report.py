"""results.json writing and the Table 1 style tables."""

import json

import pytest

from opd.eval.report import compare_runs, markdown_table, read_results, row_scores, write_results

FULL = {"vstar": {"score": 80.0}, "zoombench": {"score": 50.5}, "hrbench4k": {"score": 70.0},
        "mmvp": {"score": 75.0}, "cvbench": {"score": 82.125}, "mmstar": {"score": 60.0}, "pope": {"score": 88.0}}


def test_write_results_is_atomic_and_round_trips(tmp_path):
    path = write_results(tmp_path / "run" / "results.json", FULL, {"model": "m", "label": "base"})
    assert read_results(path) == {"meta": {"model": "m", "label": "base"}, "benchmarks": FULL}
    assert read_results(tmp_path / "run")["benchmarks"] == FULL
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["results.json"]  # no temp file left


def test_write_results_failure_keeps_old_file(tmp_path):
    path = write_results(tmp_path / "results.json", FULL)
    with pytest.raises(ValueError):
        write_results(path, {"vstar": {"score": float("nan")}})
    assert read_results(path)["benchmarks"] == FULL
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_read_results_errors_name_the_file(tmp_path):
    (tmp_path / "results.json").write_text(json.dumps({"scores": {}}))
    with pytest.raises(ValueError, match="results.json: field 'benchmarks' missing"):
        read_results(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        read_results(tmp_path / "nowhere" / "results.json")


def test_markdown_table_order_and_average():
    table = markdown_table(FULL, label="Qwen3.5-4B")
    lines = table.strip().splitlines()
    assert lines[0] == ("| Model | V*Bench | ZoomBench | HR-Bench 4K | MMVP | CV-Bench | MMStar | POPE | Avg. |")
    avg = sum(v["score"] for v in FULL.values()) / 7
    assert lines[2] == f"| Qwen3.5-4B | 80.00 | 50.50 | 70.00 | 75.00 | 82.12 | 60.00 | 88.00 | {avg:.2f} |"
    assert "missing" not in table


def test_markdown_table_names_missing_benchmarks():
    table = markdown_table({"mmvp": {"score": 60.0}, "pope": {"score": 90.0}})
    assert "| model | - | - | - | 60.00 | - | - | 90.00 | 75.00 |" in table
    assert "missing V*Bench, ZoomBench, HR-Bench 4K, CV-Bench, MMStar; Avg. is over the 2 present." in table
    assert row_scores({})["avg"] is None


def test_compare_runs_rows_and_deltas(tmp_path):
    write_results(tmp_path / "base" / "results.json", FULL)
    better = {k: {"score": v["score"] + 1.0} for k, v in FULL.items()}
    better["pope"] = {"score": 86.5}
    write_results(tmp_path / "learned25" / "results.json", better, {"label": "Learned-25"})
    text = compare_runs([tmp_path / "base", tmp_path / "learned25" / "results.json"])
    assert "| base | 80.00 |" in text and "| Learned-25 | 81.00 |" in text
    assert "Delta vs base (points)" in text
    delta_row = next(line for line in text.splitlines() if line.startswith("| Learned-25 | +1.00"))
    assert delta_row.split(" | ")[7] == "-1.50"  # POPE
    assert "not comparable" not in text


def test_compare_runs_flags_different_benchmark_sets(tmp_path):
    write_results(tmp_path / "a" / "results.json", FULL)
    write_results(tmp_path / "b" / "results.json", {"vstar": {"score": 70.0}})
    text = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert "| b | -10.00 | - |" in text
    assert "not comparable" in text and "b: missing ZoomBench" in text
    with pytest.raises(ValueError):
        compare_runs([])


def _run(path, label=None, given=False, ledger=False):
    """A results.json as eval.py writes it: meta label (its default, or --label's) and where it came from."""
    from opd.eval.report import default_label

    meta = {"label": label or default_label(path), "label_from": "--label" if given else "folder"}
    if ledger:
        (path.parent / "ledger.jsonl").parent.mkdir(parents=True, exist_ok=True)
        (path.parent / "ledger.jsonl").write_text("")
    write_results(path / "results.json", FULL, meta)
    return path


def _labels(text: str) -> list[str]:
    rows = text.split("\n\n")[1].splitlines()[2:]  # the scores table, past its header lines
    return [row.split(" | ")[0].removeprefix("| ") for row in rows]


def test_default_labels_name_the_run_not_its_eval_folder(tmp_path):
    from opd.eval.report import default_label

    runs = tmp_path / "runs"
    assert default_label(runs / "paper-4b" / "eval") == "paper-4b"  # the docs' own layout
    assert default_label(runs / "paper-4b" / "eval-vllm") == "paper-4b"
    assert default_label(runs / "qwen3.5-4b") == "qwen3.5-4b"  # a folder of its own keeps its name
    (runs / "fsdp").mkdir(parents=True)
    (runs / "fsdp" / "ledger.jsonl").write_text("")
    assert default_label(runs / "fsdp" / "step-4") == "fsdp"  # any folder inside a train.py run
    text = compare_runs([_run(runs / "qwen3.5-4b"), _run(runs / "paper-4b" / "eval")])
    assert _labels(text) == ["qwen3.5-4b", "paper-4b"] and "Delta vs qwen3.5-4b (points)" in text


def test_labels_that_would_collide_are_told_apart_by_their_paths(tmp_path):
    runs = tmp_path / "runs"
    two_evals = [_run(runs / "fsdp" / "eval-2", ledger=True), _run(runs / "fsdp" / "eval-4", ledger=True)]
    assert _labels(compare_runs(two_evals)) == ["fsdp/eval-2", "fsdp/eval-4"]
    same_name = [_run(runs / "a" / "eval"), _run(tmp_path / "other" / "a" / "eval"), _run(runs / "b" / "eval")]
    assert _labels(compare_runs(same_name)) == ["runs/a/eval", "other/a/eval", "b"]


def test_a_stored_label_wins(tmp_path):
    runs = tmp_path / "runs"
    given = _run(runs / "paper-4b" / "eval", "Learned-25", given=True)
    old = runs / "old" / "eval"  # written before label_from: a label other than the folder's name was given
    write_results(old / "results.json", FULL, {"label": "Baseline"})
    plain = runs / "legacy" / "eval"  # ... and the folder's own name was the default
    write_results(plain / "results.json", FULL, {"label": "eval"})
    clash = _run(tmp_path / "x" / "Learned-25")  # a default that equals a given label moves aside
    assert _labels(compare_runs([given, old, plain, clash])) == ["Learned-25", "Baseline", "legacy", "x/Learned-25"]
