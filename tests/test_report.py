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
