"""Benchmark loaders read each shipped layout, and bad files fail naming file, row and field."""

import base64
import importlib.util
import json

import pytest
from bench_fixtures import (
    ZOOMBENCH_ANSWERS,
    cvbench_rows,
    hrbench_rows,
    image_bytes,
    mmstar_rows,
    pope_rows,
    write_all_fixtures,
    write_cvbench_fixture,
    write_hrbench4k_fixture,
    write_mmstar_fixture,
    write_mmvp_fixture,
    write_pope_fixture,
    write_vstar_fixture,
    write_zoombench_fixture,
    zoombench_rows,
)
from PIL import Image

import opd.eval.bench_rows as bench_rows
import opd.eval.benchmarks as bm
from opd.answers.options import split_options
from opd.eval.bench_items import BenchItem, BenchmarkDataError, ImageRef, load_image, prompt_text
from opd.eval.benchmarks import load_benchmark

HAS_PYARROW = importlib.util.find_spec("pyarrow") is not None


def by_index(items):
    return {item.index: item for item in items}


def assert_images_decode(items, size=None):
    for item in items:
        img = item.image()
        assert isinstance(img, Image.Image) and img.mode == "RGB"
        if size:
            assert img.size == size


def fake_parquet(monkeypatch, tmp_path, name, rows, rel="data/test-00000-of-00001.parquet"):
    """Stand in for pyarrow: the parquet reader yields ``rows`` (HF structs) for a placeholder file."""
    path = tmp_path / name / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"PAR1")
    monkeypatch.setattr(bench_rows, "_read_parquet", lambda p: ((r, f"{p} row {i}") for i, r in enumerate(rows)))
    return path


# ----------------------------------------------------------------------------- each layout


def test_registry_names_the_seven_benchmarks_and_the_familys():
    assert list(bm.LOADERS) == ["vstar", "zoombench", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope", "hrbench8k",
                                "mmerealworld", "mmerealworld_cn"]
    assert bm.PAPER == tuple(list(bm.LOADERS)[:7])


@pytest.mark.parametrize("fmt", ["jsonl", "tsv"])
def test_vstar(tmp_path, fmt):
    answers = write_vstar_fixture(tmp_path, fmt=fmt)
    items = load_benchmark("vstar", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    first = by_index(items)["0"]
    assert first.question == "What is the color of the umbrella?"
    assert first.options == {"A": "red", "B": "blue", "C": "green", "D": "yellow"}
    assert (first.kind, first.category) == ("choice", "direct_attributes")
    assert by_index(items)["2"].options == {"A": "left", "B": "right"}
    assert_images_decode(items, (12, 8))


def test_prompt_text_formats():
    item = BenchItem("v", "0", "What color?", {"A": "red", "B": "blue"}, "A", "choice", "c", lambda: None)
    assert prompt_text(item) == ("What color?\n(A) red\n(B) blue\n"
                                 "Answer with the option's letter from the given choices directly.")
    yn = BenchItem("p", "0", "Is there a dog in the image?", {}, "yes", "yesno", "c", lambda: None)
    assert prompt_text(yn) == "Is there a dog in the image?\nAnswer yes or no."
    op = BenchItem("z", "0", "What word is on the sign?", {}, "Exit", "open", "c", lambda: None)
    assert prompt_text(op) == "What word is on the sign?"


def test_hrbench4k_tsv_with_index_referenced_images_and_8k_ignored(tmp_path):
    answers = write_hrbench4k_fixture(tmp_path)
    items = load_benchmark("hrbench4k", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    assert len(items) == 6  # the 8K file beside it is not read
    item = by_index(items)["3"]  # cycle 1 of question 0: options rotated, image stored as "0"
    assert item.meta == {"cycle_category": "cycle1"} and item.category == "single"
    assert item.options == {"A": "GO", "B": "EXIT", "C": "OPEN", "D": "STOP"} and item.answer == "D"
    assert item.image().tobytes() == by_index(items)["0"].image().tobytes()
    assert_images_decode(items, (12, 8))


@pytest.mark.parametrize("header", ["Index", "lndex"])
def test_mmvp_csv_and_image_folder(tmp_path, header):
    answers = write_mmvp_fixture(tmp_path, header_index=header)
    items = load_benchmark("mmvp", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    item = by_index(items)["3"]
    assert item.question == "Is the door open?"
    assert item.options == {"A": "Yes", "B": "No"}  # "(a) Yes (b) No" -> upper-case keys
    assert item.answer == "B" and item.meta == {"pair": 2}
    assert [i.meta["pair"] for i in items] == [1, 1, 2, 2]
    assert_images_decode(items, (12, 8))


def test_cvbench_jsonl(tmp_path):
    answers = write_cvbench_fixture(tmp_path)
    items = load_benchmark("cvbench", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    item = by_index(items)["2D/0"]
    assert item.question == "How many chairs are in the image?"
    assert item.options == {"A": "1", "B": "2", "C": "3", "D": "4"}
    assert item.meta == {"source": "ADE20K", "type": "2D", "task": "Count"} and item.category == "Count"
    assert by_index(items)["3D/4"].meta["source"] == "Omni3D"
    assert_images_decode(items, (12, 8))


def test_mmstar_tsv(tmp_path):
    answers = write_mmstar_fixture(tmp_path)
    items = load_benchmark("mmstar", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    item = by_index(items)["0"]
    assert item.question == "Which option describes the scene?"
    assert item.options == {"A": "A beach.", "B": "A forest.", "C": "A city.", "D": "A desert."}
    assert item.meta == {"l2_category": "image scene and topic"} and item.category == "coarse perception"
    assert_images_decode(items, (12, 8))


def test_pope_visionopd_json(tmp_path):
    answers = write_pope_fixture(tmp_path)
    items = load_benchmark("pope", tmp_path)
    assert {i.index: i.answer for i in items} == answers
    assert all(i.kind == "yesno" and i.options == {} for i in items)
    assert items[0].question == "Is there a dog in the image?"  # "<image>" removed
    assert [i.category for i in items] == ["adversarial"] * 2 + ["popular"] * 2 + ["random"] * 2
    assert_images_decode(items, (12, 8))


def test_zoombench_visionopd_json_with_crops(tmp_path):
    answers = write_zoombench_fixture(tmp_path)
    items = by_index(load_benchmark("zoombench", tmp_path))
    assert {k: i.answer for k, i in items.items()} == answers
    assert [items[k].kind for k in ("zb0", "zb1", "zb2", "zb3")] == ["choice", "choice", "open", "yesno"]
    assert items["zb0"].question == "What is the brand on the cup?"
    assert items["zb0"].options == {"A": "Nike", "B": "Adidas", "C": "Puma", "D": "Reebok"}
    assert items["zb1"].answer == "C"  # gold "C. 71"
    assert items["zb2"].options == {}  # open question: "A. B. C." in its text are not options
    assert items["zb0"].category == "multiple_choice" and items["zb2"].category == "open_question"
    assert items["zb0"].crop().size == (8, 8) and items["zb0"].image().size == (16, 16)


def test_all_fixtures_load(tmp_path):
    expected = write_all_fixtures(tmp_path)
    for name, answers in expected.items():
        assert {i.index: i.answer for i in load_benchmark(name, tmp_path)} == answers, name


# ----------------------------------------------------------------------------- parquet rows (HF structs)


def test_pope_parquet_rows(monkeypatch, tmp_path):
    fake_parquet(monkeypatch, tmp_path, "pope", pope_rows())
    items = by_index(load_benchmark("pope", tmp_path))
    assert set(items) == {f"{s}/{q}" for s, q in zip(["adversarial"] * 2 + ["popular"] * 2 + ["random"] * 2,
                                                    "123456")}
    item = items["popular/4"]
    assert (item.answer, item.kind, item.meta) == ("no", "yesno", {"split": "popular", "image_source": "COCO_4"})
    assert item.image().size == (12, 8)


def test_zoombench_parquet_rows(monkeypatch, tmp_path):
    path = fake_parquet(monkeypatch, tmp_path, "zoombench", zoombench_rows())
    items = by_index(load_benchmark("zoombench", tmp_path))
    assert {k: i.answer for k, i in items.items()} == ZOOMBENCH_ANSWERS
    assert items["zb2"].kind == "open" and items["zb2"].category == "open"
    assert items["zb3"].kind == "yesno" and items["zb0"].meta == {"question_type": "mcq"}
    assert items["zb1"].crop().size == (8, 8)
    rows = zoombench_rows()
    rows[1]["query"] = "What number is on the jersey?"
    fake_parquet(monkeypatch, tmp_path, "zoombench", rows)
    expect_error(tmp_path, "zoombench", f"{path} row 1", "field 'query'", "mcq")


def test_cvbench_mmstar_hrbench_mmvp_parquet_rows(monkeypatch, tmp_path):
    fake_parquet(monkeypatch, tmp_path, "cvbench", cvbench_rows(), rel="test.parquet")
    assert by_index(load_benchmark("cvbench", tmp_path))["3D/6"].answer == "A"
    fake_parquet(monkeypatch, tmp_path, "mmstar", mmstar_rows(), rel="mmstar.parquet")
    star = by_index(load_benchmark("mmstar", tmp_path))
    assert star["2"].options == {"A": "2", "B": "4", "C": "6", "D": "8"} and star["2"].answer == "D"
    fake_parquet(monkeypatch, tmp_path, "hrbench4k", hrbench_rows(), rel="hr_bench_4k.parquet")
    assert len(load_benchmark("hrbench4k", tmp_path)) == 6
    rows = [{"Index": 1, "Question": "Open?", "Options": "(a) Yes (b) No", "Correct Answer": "(b)",
             "image": {"bytes": image_bytes(1), "path": "1.jpg"}}]
    fake_parquet(monkeypatch, tmp_path, "mmvp", rows)
    assert load_benchmark("mmvp", tmp_path)[0].answer == "B"


@pytest.mark.skipif(not HAS_PYARROW, reason="pyarrow not installed")
@pytest.mark.parametrize("name, writer", [("pope", write_pope_fixture), ("zoombench", write_zoombench_fixture),
                                          ("cvbench", write_cvbench_fixture), ("mmstar", write_mmstar_fixture),
                                          ("hrbench4k", write_hrbench4k_fixture)])
def test_real_parquet_files(tmp_path, name, writer):
    answers = writer(tmp_path, fmt="parquet")
    assert {i.index: i.answer for i in load_benchmark(name, tmp_path)} == answers


@pytest.mark.skipif(HAS_PYARROW, reason="pyarrow is installed")
def test_parquet_without_pyarrow_says_what_to_install(tmp_path):
    (tmp_path / "pope").mkdir()
    (tmp_path / "pope" / "test.parquet").write_bytes(b"PAR1")
    with pytest.raises(ImportError, match=r"test\.parquet needs pyarrow: pip install pyarrow"):
        load_benchmark("pope", tmp_path)


# ----------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    "text, question, options",
    [
        ("Q?\n(A) x\n(B) y\nAnswer with the option's letter from the given choices directly.", "Q?",
         {"A": "x", "B": "y"}),
        ("Q? (a) Open (b) Closed", "Q?", {"A": "Open", "B": "Closed"}),
        ("Q?\nA. one\nB. two\nC. three", "Q?", {"A": "one", "B": "two", "C": "three"}),
        ("Q?\nOptions: A: on the bed., B: under it, C: x", "Q?", {"A": "on the bed.", "B": "under it", "C": "x"}),
        ("What is (a) here?", "What is (a) here?", {}),
        ("<image>Is there a cat? Please answer yes or no.", "Is there a cat?", {}),
    ],
)
def test_split_options(text, question, options):
    assert split_options(text) == (question, options)


def test_load_image_accepts_paths_bytes_callables(tmp_path):
    data = image_bytes(5, (4, 3))
    (tmp_path / "x.png").write_bytes(data)
    for src in (data, tmp_path / "x.png", str(tmp_path / "x.png"), ImageRef("t", data=data),
                lambda: Image.new("L", (4, 3))):
        img = load_image(src)
        assert img.mode == "RGB" and img.size == (4, 3)


# ----------------------------------------------------------------------------- bad files


def expect_error(tmp_path, name, *fragments):
    with pytest.raises(BenchmarkDataError) as err:
        load_benchmark(name, tmp_path)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


def test_missing_folder_and_missing_files(tmp_path):
    expect_error(tmp_path, "vstar", str(tmp_path / "vstar"), "not found")
    (tmp_path / "mmvp").mkdir()
    expect_error(tmp_path, "mmvp", str(tmp_path / "mmvp"), "no mmvp files found", "Questions.csv")
    with pytest.raises(BenchmarkDataError, match="unknown benchmark 'mmbench'"):
        load_benchmark("mmbench", tmp_path)


def test_missing_column_names_file_and_column(tmp_path):
    write_hrbench4k_fixture(tmp_path)
    path = tmp_path / "hrbench4k" / "hr_bench_4k.tsv"
    lines = path.read_text().splitlines()
    cut = [line.split("\t") for line in lines]
    col = cut[0].index("cycle_category")
    path.write_text("\n".join("\t".join(c[:col] + c[col + 1:]) for c in cut) + "\n")
    expect_error(tmp_path, "hrbench4k", str(path), "missing column 'cycle_category'")


def test_bad_json_line_names_file_and_line(tmp_path):
    write_vstar_fixture(tmp_path)
    path = tmp_path / "vstar" / "test_questions.jsonl"
    path.write_text(path.read_text() + "{not json\n")
    expect_error(tmp_path, "vstar", f"{path} line 5", "bad JSON")


def test_missing_field_in_a_row(tmp_path):
    write_vstar_fixture(tmp_path)
    path = tmp_path / "vstar" / "test_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[2]["category"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect_error(tmp_path, "vstar", f"{path} line 3", "missing field 'category'")


def test_missing_image_file_names_row_and_field(tmp_path):
    write_mmvp_fixture(tmp_path)
    (tmp_path / "mmvp" / "MMVP Images" / "3.jpg").unlink()
    expect_error(tmp_path, "mmvp", str(tmp_path / "mmvp" / "Questions.csv") + " line 4", "field 'image'",
                 "image file not found", "3.jpg")


def test_undecodable_image_names_row_and_field(tmp_path):
    write_mmstar_fixture(tmp_path)
    path = tmp_path / "mmstar" / "MMStar.tsv"
    lines = path.read_text().splitlines()
    cells = lines[2].split("\t")
    cells[-1] = base64.b64encode(b"not an image at all").decode()
    lines[2] = "\t".join(cells)
    path.write_text("\n".join(lines) + "\n")
    expect_error(tmp_path, "mmstar", f"{path} line 3", "field 'image'", "cannot decode image")


def test_image_neither_path_nor_base64(tmp_path):
    write_mmstar_fixture(tmp_path)
    path = tmp_path / "mmstar" / "MMStar.tsv"
    lines = path.read_text().splitlines()
    lines[1] = "\t".join(lines[1].split("\t")[:-1] + ["%%%% not base64 %%%%"])
    path.write_text("\n".join(lines) + "\n")
    expect_error(tmp_path, "mmstar", f"{path} line 2", "field 'image'", "neither an image path nor base64")


def test_answer_not_among_options(tmp_path):
    write_cvbench_fixture(tmp_path)
    path = tmp_path / "cvbench" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[3]["answer"] = "(C)"  # the question has two choices
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect_error(tmp_path, "cvbench", f"{path} line 4", "field 'answer'", "'(C)' is not among the options")


def test_bad_values_named(tmp_path, monkeypatch):
    rows = pope_rows()
    rows[1]["answer"] = "maybe"
    path = fake_parquet(monkeypatch, tmp_path, "pope", rows)
    expect_error(tmp_path, "pope", f"{path} row 1", "field 'answer'", "not yes/no")
    cv = cvbench_rows()
    cv[0]["source"] = "KITTI"
    path = fake_parquet(monkeypatch, tmp_path, "cvbench", cv, rel="test.parquet")
    expect_error(tmp_path, "cvbench", f"{path} row 0", "field 'source'", "KITTI")


def test_duplicate_index(tmp_path):
    write_vstar_fixture(tmp_path)
    path = tmp_path / "vstar" / "test_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[1]["question_id"] = 0
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect_error(tmp_path, "vstar", f"{path} line 2", "duplicate index '0'")


def test_tsv_row_with_wrong_field_count(tmp_path):
    write_mmstar_fixture(tmp_path)
    path = tmp_path / "mmstar" / "MMStar.tsv"
    path.write_text(path.read_text() + "9\tonly two\n")
    expect_error(tmp_path, "mmstar", f"{path} line 5", "2 fields, header has 10")


def test_images_are_not_decoded_at_load_time(tmp_path, monkeypatch):
    write_vstar_fixture(tmp_path)
    calls = []
    real_convert = Image.Image.convert
    monkeypatch.setattr(Image.Image, "convert", lambda self, *a, **k: calls.append(1) or real_convert(self, *a, **k))
    items = load_benchmark("vstar", tmp_path)
    assert calls == []
    items[0].image()
    assert calls == [1]


def test_rows_without_options_are_named(tmp_path):
    write_mmvp_fixture(tmp_path)
    path = tmp_path / "mmvp" / "Questions.csv"
    path.write_text(path.read_text().replace("(a) Yes (b) No", "Yes or No", 1))
    expect_error(tmp_path, "mmvp", f"{path} line 4", "field 'Options'")
    write_vstar_fixture(tmp_path)
    path = tmp_path / "vstar" / "test_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[0]["text"] = "What is the color of the umbrella?"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    expect_error(tmp_path, "vstar", f"{path} line 1", "field 'text'", "no \"(A) ...\" options")


def test_mmvp_without_image_folder(tmp_path):
    write_mmvp_fixture(tmp_path)
    (tmp_path / "mmvp" / "MMVP Images").rename(tmp_path / "mmvp" / "pictures")
    expect_error(tmp_path, "mmvp", str(tmp_path / "mmvp" / "Questions.csv"), "no image folder 'MMVP Images/'")
