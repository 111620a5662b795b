"""eval.py's tables show what was evaluated, --data-dir names a file as a file, and the family's benchmarks (issue 44):
HR-Bench 8K and MME-RealWorld EN / CN read from small files in their shipped layouts, scored against hand-computed
values, and the family's six-benchmark preset beside the paper's seven."""

import json

import pytest

from opd.cli import UserError
from opd.eval import cli
from opd.eval.report import compare_runs, markdown_table, write_results


# ----------------------------------------------------------------------------- tables and --data-dir (item 4)


def test_the_table_shows_only_the_benchmarks_evaluated(tmp_path):
    """The toy / tiny world fills ZoomBench's slot alone: its table had six empty columns and "missing V*Bench,
    HR-Bench 4K, ..." under it; now one column, no note."""
    common = ["--data-dir", "tiny", "--limit", "3", "--max-new-tokens", "2", "--device", "cpu", "--no-progress"]
    result = cli.main(["--model", "tiny", *common, "--out", str(tmp_path / "out"), "--label", "tiny"])
    lines = result["table"].splitlines()
    assert lines[0] == "| Model | ZoomBench | Avg. |"
    score = result["results"]["zoombench"]["score"]
    assert lines[2] == f"| tiny | {score:.2f} | {score:.2f} |"
    assert "missing" not in result["table"]
    assert (tmp_path / "out" / "results.md").read_text().startswith("| Model | ZoomBench | Avg. |\n")


def test_a_table_names_the_benchmarks_asked_for_but_absent_and_compare_takes_the_union(tmp_path):
    table = markdown_table({"hrbench8k": {"score": 70.0}}, "run", ["vstar", "hrbench8k"])
    assert table.splitlines()[0] == "| Model | V*Bench | HR-Bench 8K | Avg. |"
    assert "run: missing V*Bench; Avg. is over the 1 present." in table
    write_results(tmp_path / "a" / "results.json", {"zoombench": {"score": 40.0}, "zoombench@crop": {"score": 90.0}})
    write_results(tmp_path / "b" / "results.json", {"zoombench": {"score": 45.0}, "mmerealworld_cn": {"score": 60.0}})
    text = compare_runs([tmp_path / "a", tmp_path / "b"])
    assert "| Run | ZoomBench | MME-RealWorld CN | Avg. |" in text
    assert "| a | 40.00 | - | 40.00 |" in text and "| b | 45.00 | 60.00 | 52.50 |" in text
    assert "a: missing MME-RealWorld CN; Avg. is over the 1 present." in text and "V*Bench" not in text


def test_a_data_dir_that_is_a_file_is_named_as_a_file(tmp_path):
    jsonl = tmp_path / "test_questions.jsonl"
    jsonl.write_text("{}\n")
    with pytest.raises(UserError) as err:
        cli.main(["--model", "tiny", "--data-dir", str(jsonl), "--benchmarks", "vstar", "--out", str(tmp_path / "o")])
    message = str(err.value)
    assert message.startswith(f"--data-dir {jsonl}: is a file, not a folder; --data-dir takes the folder holding one "
                              "sub-folder per benchmark")
    assert "DATA/vstar/test_questions.jsonl, then --data-dir DATA" in message and "no such folder" not in message
    with pytest.raises(UserError, match=r": no such folder"):
        cli.main(["--model", "tiny", "--data-dir", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o")])
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------------- the family's benchmarks (item 7)

import base64  # noqa: E402
import csv  # noqa: E402

from bench_fixtures import (  # noqa: E402
    hrbench_rows,
    image_bytes,
    write_hrbench4k_fixture,
    write_vstar_fixture,
    write_zoombench_fixture,
)

from opd.answers.grade import grade  # noqa: E402
from opd.eval.bench_items import BenchmarkDataError  # noqa: E402
from opd.eval.benchmarks import FAMILY, PAPER, load_benchmark  # noqa: E402
from opd.eval.metrics import score  # noqa: E402

# bench_fixtures.hrbench_rows' golds, worked out by hand (cycle 0: options as written; cycle 1: rotated by one;
# questions 0 and 1 "single", question 2 "cross")
HR_GOLD = {"0": "A", "1": "C", "2": "B", "3": "D", "4": "B", "5": "A"}


def write_tsv(path, header, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter="\t")
        writer.writerow(header)
        writer.writerows(rows)


def write_hrbench8k(data_dir, fmt="tsv"):
    """HR-Bench 8K as shipped (DreamMr/HR-Bench's hr_bench_8k.tsv, base64 images; or the HF parquet split
    hrbench_version_split/hrbench_8k-*.parquet) with a 4K file beside it that must not be read."""
    root = data_dir / "hrbench8k"
    rows = hrbench_rows()
    header = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]
    if fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        split = root / "hrbench_version_split"
        split.mkdir(parents=True)
        pq.write_table(pa.Table.from_pylist(rows), split / "hrbench_8k-00000-of-00001.parquet")
        pq.write_table(pa.Table.from_pylist(rows[:1]), split / "hrbench_4k-00000-of-00001.parquet")
        return
    out = [[r[h] if h != "image" else base64.b64encode(r["image"]["bytes"]).decode() for h in header] for r in rows]
    write_tsv(root / "hr_bench_8k.tsv", header, out)
    write_tsv(root / "hr_bench_4k.tsv", header, [["x"] * len(header)])


# (Question_id, Task, Subtask, Category (l2), Text, the five choices, Ground truth)
MME_EN = [
    ("perception/monitoring/0", "Perception", "Monitoring", "counting/car", "How many cars are in the image?",
     ["3", "4", "5", "6", "The image does not feature cars."], "A"),
    ("perception/monitoring/1", "Perception", "Monitoring", "Color/attribute/motion", "What color is the moving car?",
     ["red", "white", "blue", "black", "The image does not feature a moving car."], "B"),
    ("perception/rs/0", "Perception", "Remote Sensing", "position", "Where is the harbour?",
     ["top left", "top right", "bottom left", "bottom right", "There is no harbour."], "A"),
    ("reasoning/ad/0", "Reasoning", "Autonomous_Driving", "intention/ego", "What should the ego car do next?",
     ["stop", "turn left", "go straight", "turn right", "reverse"], "C"),
    ("reasoning/monitoring/0", "Reasoning", "Monitoring", "color/attribute", "Which car will arrive first?",
     ["the red one", "the white one", "the blue one", "the black one", "none of them"], "A"),
]


def write_mme_official(data_dir, name="mmerealworld", rows=MME_EN, json_name="MME_RealWorld.json"):
    """The official release: MME_RealWorld.json (a list of Question_id, Image, Text, Question Type, Answer
    choices "(A) ...", Ground truth, Category, Subtask, Task) with the images in MME-RealWorld/<folder>/."""
    root = data_dir / name
    out = []
    for n, (qid, task, subtask, category, text, choices, gold) in enumerate(rows):
        rel = f"{subtask.lower().replace(' ', '_')}/{n:05d}.png"
        (root / "MME-RealWorld" / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / "MME-RealWorld" / rel).write_bytes(image_bytes(900 + n))
        out.append({"Question_id": qid, "Image": rel, "Text": text, "Question Type": "Multiple Choice",
                    "Answer choices": [f"({chr(65 + i)}) {c}" for i, c in enumerate(choices)], "Ground truth": gold,
                    "Category": category, "Subtask": subtask, "Task": task})
    (root / json_name).write_text(json.dumps(out, ensure_ascii=False, indent=1), encoding="utf-8")


def mme_lmms_rows(rows):
    """lmms-eval's parquet rows (yifanzhang114/MME-RealWorld(-CN)-Lmms-eval): index, question, multi-choice options,
    answer, category "Task/Subtask", l2-category, bytes (a base64 image)."""
    return [{"index": n, "question": text, "answer": gold,
             "multi-choice options": [f"({chr(65 + i)}) {c}" for i, c in enumerate(choices)], "category": f"{task}/{subtask}", "l2-category": category,
             "bytes": base64.b64encode(image_bytes(950 + n)).decode()}
            for n, (_, task, subtask, category, text, choices, gold) in enumerate(rows)]


MME_CN = [
    ("0", "Perception", "Monitoring", "counting/car", "图中有几辆车？", ["3", "4", "5", "6", "图中没有车。"], "B"),
    ("1", "Perception", "OCR with Complex Context", "text", "招牌上写的是什么？", ["面包", "咖啡", "茶", "书店", "看不清"], "A"),
    ("2", "Reasoning", "Diagram and Table", "table", "哪一年的销量最高？", ["2019", "2020", "2021", "2022", "无法判断"], "E"),
    ("3", "Reasoning", "Monitoring", "person/attribute", "穿红衣服的人在做什么？", ["跑步", "走路", "站着", "坐着", "没有这样的人"], "A"),
]


def write_mme_cn_parquet(data_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = data_dir / "mmerealworld_cn" / "data"
    root.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(mme_lmms_rows(MME_CN)), root / "train-00000-of-00001.parquet")


def write_mme_vlmevalkit(data_dir, name="mmerealworld", rows=MME_EN, tsv="MME-RealWorld.tsv"):
    """VLMEvalKit's TSV: index, image (base64), question, multi-choice options (text), A-E, answer, category,
    l2-category."""
    header = ["index", "image", "question", "multi-choice options", "A", "B", "C", "D", "E", "answer", "category",
              "l2-category"]
    out = []
    for r in mme_lmms_rows(rows):
        options = [o[4:] for o in r["multi-choice options"]]
        out.append([r["index"], r["bytes"], r["question"],
                    "The choices are listed below:\n" + "\n".join(r["multi-choice options"]), *options, r["answer"],
                    r["category"], r["l2-category"]])
    write_tsv(data_dir / name / tsv, header, out)


@pytest.mark.parametrize("fmt", ["tsv", "parquet"])
def test_hrbench8k_reads_its_own_file_and_scores_by_cycles(tmp_path, fmt):
    write_hrbench8k(tmp_path, fmt)
    items = load_benchmark("hrbench8k", tmp_path)
    assert {i.index: i.answer for i in items} == HR_GOLD  # the 4K file beside it is not read
    item = next(i for i in items if i.index == "4")
    assert item.options == {"A": "red", "B": "blue", "C": "black", "D": "white"}
    assert (item.category, item.meta) == ("single", {"cycle_category": "cycle1"})
    assert item.image().size == (12, 8)
    # cycle 0 all right; cycle 1 only question 2 right (every reply "A"): (100 + 33.33) / 2
    replies = {"0": "A", "1": "The answer is C.", "2": "(B)", "3": "A", "4": "A", "5": "A"}
    result = score("hrbench8k", [grade(i, replies[i.index]) for i in items])
    assert result["score"] == pytest.approx((100 + 100 / 3) / 2)
    assert result["per_cycle"] == pytest.approx({"cycle0": 100.0, "cycle1": 100 / 3})
    assert result["single"] == pytest.approx(50.0) and result["cross"] == pytest.approx(100.0)
    (tmp_path / "hrbench4k").mkdir()
    (tmp_path / "hrbench4k" / "hr_bench_8k.tsv").write_text("index\tquestion\n")
    with pytest.raises(BenchmarkDataError, match="no hrbench4k files found"):  # an 8K file is never HR-Bench 4K
        load_benchmark("hrbench4k", tmp_path)


def test_mmerealworld_official_json_with_its_image_folders(tmp_path):
    write_mme_official(tmp_path)
    (tmp_path / "mmerealworld" / "MME_RealWorld_CN.json").write_text("[]")  # a CN file beside it: never read
    items = load_benchmark("mmerealworld", tmp_path)
    assert [i.index for i in items] == [r[0] for r in MME_EN]
    first = items[0]
    assert first.question == "How many cars are in the image?" and first.kind == "choice"
    assert first.options == {"A": "3", "B": "4", "C": "5", "D": "6", "E": "The image does not feature cars."}
    assert first.category == "Perception/Monitoring"
    assert first.meta == {"task": "Perception", "subtask": "Monitoring", "l2_category": "counting/car"}
    assert [i.answer for i in items] == ["A", "B", "A", "C", "A"]
    assert first.image().size == (12, 8)  # found in MME-RealWorld/monitoring/
    # right: items 0, 2, 4 (pooled 3/5); Perception 2/3, Reasoning 1/2; "Color/attribute/motion" and
    # "color/attribute" are one l2 category (the official rule), 1 of its 2 right
    replies = ["A", "A", "The best answer is (A).", "A", "A"]
    result = score("mmerealworld", [grade(i, r) for i, r in zip(items, replies)])
    assert result["score"] == pytest.approx(60.0) and result["n"] == 5 and result["unparsed"] == 0
    assert result["per_task"] == pytest.approx({"Perception": 200 / 3, "Reasoning": 50.0})
    assert result["per_subtask"] == pytest.approx({"Perception/Monitoring": 50.0, "Perception/Remote Sensing": 100.0,
                                                  "Reasoning/Autonomous_Driving": 0.0, "Reasoning/Monitoring": 100.0})
    assert result["per_l2_category"]["color/attribute"] == pytest.approx(50.0)
    assert result["per_l2_category"]["counting/car"] == pytest.approx(100.0)


def test_mmerealworld_vlmevalkit_tsv_and_lmms_eval_parquet(tmp_path):
    write_mme_vlmevalkit(tmp_path)
    tsv = load_benchmark("mmerealworld", tmp_path)
    write_mme_cn_parquet(tmp_path)
    cn = load_benchmark("mmerealworld_cn", tmp_path)
    official = tmp_path / "official"
    write_mme_official(official)
    for got, want in ((tsv, load_benchmark("mmerealworld", official)),):
        assert [(i.question, i.options, i.answer, i.category, i.meta) for i in got] == \
            [(i.question, i.options, i.answer, i.category, i.meta) for i in want]
    base64_json = tmp_path / "b64"  # yifanzhang114/MME-RealWorld-Base64's JSON lists (VLMEvalKit's TSV source)
    (base64_json / "mmerealworld_cn").mkdir(parents=True)
    rows = [{("image" if k == "bytes" else k): v for k, v in r.items()} for r in mme_lmms_rows(MME_CN)]
    (base64_json / "mmerealworld_cn" / "MME-RealWorld-CN.json").write_text(json.dumps(rows), encoding="utf-8")
    assert [(i.question, i.options, i.answer, i.meta) for i in load_benchmark("mmerealworld_cn", base64_json)] == \
        [(i.question, i.options, i.answer, i.meta) for i in cn]
    assert [i.answer for i in cn] == ["B", "A", "E", "A"] and cn[1].question == "招牌上写的是什么？"
    assert cn[1].options == {"A": "面包", "B": "咖啡", "C": "茶", "D": "书店", "E": "看不清"}
    assert cn[2].meta == {"task": "Reasoning", "subtask": "Diagram and Table", "l2_category": "table"}
    assert cn[0].image().size == (12, 8)
    replies = ["B", "答案是 A", "(E)", "B"]  # 3 of 4 right
    result = score("mmerealworld_cn", [grade(i, r) for i, r in zip(cn, replies)])
    assert result["score"] == pytest.approx(75.0) and result["per_task"] == pytest.approx(
        {"Perception": 100.0, "Reasoning": 50.0})


def test_mme_rows_without_options_or_with_a_lite_file_only_are_refused(tmp_path):
    root = tmp_path / "mmerealworld"
    root.mkdir()
    (root / "MME_RealWorld.json").write_text(json.dumps(
        [{"Question_id": "q0", "Image": "x.png", "Text": "?", "Answer choices": [], "Ground truth": "A"}]))
    with pytest.raises(BenchmarkDataError, match=r"MME_RealWorld.json row 0: field 'Answer choices'"):
        load_benchmark("mmerealworld", tmp_path)
    (root / "MME_RealWorld.json").unlink()
    write_mme_vlmevalkit(tmp_path, tsv="mme_realworld_lite.tsv")  # another benchmark (1,919 items)
    with pytest.raises(BenchmarkDataError, match="no mmerealworld files found"):
        load_benchmark("mmerealworld", tmp_path)


def test_the_family_preset_runs_the_six_beside_the_papers_seven(tmp_path):
    """--preset family: V*Bench, ZoomBench, HR-Bench 4K and 8K, MME-RealWorld EN and CN, scored end to end through a
    stand-in OpenAI-compatible server that answers "(A)" to everything; each score worked out from the golds."""
    from fake_http import LocalServer, send_json
    import http.server

    assert PAPER == ("vstar", "zoombench", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope")
    assert FAMILY == ("vstar", "zoombench", "hrbench4k", "hrbench8k", "mmerealworld", "mmerealworld_cn")
    assert cli.parse_args(["--data-dir", "d"])[0].benchmarks == ",".join(PAPER)
    assert cli.parse_args(["--preset", "family", "--data-dir", "d"])[0].benchmarks == ",".join(FAMILY)
    data = tmp_path / "data"
    write_vstar_fixture(data)  # golds A, C, B, A: 50
    write_zoombench_fixture(data)  # golds B, C, "Exit", yes: 0
    write_hrbench4k_fixture(data)
    write_hrbench8k(data)  # each: cycle 0 golds A, C, B; cycle 1 D, B, A: 1/3 per cycle
    write_mme_official(data)  # golds A, B, A, C, A: 60
    write_mme_cn_parquet(data)  # golds B, A, E, A: 50

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            send_json(self, {"object": "list", "data": [{"id": "served", "owned_by": "vllm"}]})

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            send_json(self, {"choices": [{"message": {"role": "assistant", "content": "(A)"}}]})

    with LocalServer(Handler) as server:
        result = cli.main(["--preset", "family", "--backend", "openai", "--base-url", server.url, "--data-dir",
                           str(data), "--out", str(tmp_path / "out"), "--no-progress"])
    expected = {"vstar": 50.0, "zoombench": 0.0, "hrbench4k": 100 / 3, "hrbench8k": 100 / 3, "mmerealworld": 60.0,
                "mmerealworld_cn": 50.0}
    assert {k: v["score"] for k, v in result["results"].items()} == pytest.approx(expected)
    lines = result["table"].splitlines()
    assert lines[0] == ("| Model | V*Bench | ZoomBench | HR-Bench 4K | HR-Bench 8K | MME-RealWorld EN "
                        "| MME-RealWorld CN | Avg. |")
    assert lines[2].endswith(f"| 50.00 | 0.00 | 33.33 | 33.33 | 60.00 | 50.00 | {sum(expected.values()) / 6:.2f} |")
    assert "missing" not in result["table"] and result["meta"]["preset"] == "family"


def test_mmerealworld_as_the_familys_harness_ships_it(tmp_path):
    """The family's harness names its Vision-OPD manifest MME_RealWorld.json too (images, query with the official
    prompt around the "(A) ..." choices, response): read as a Vision-OPD JSON, its options from the query."""
    root = tmp_path / "mmerealworld"
    (root / "images").mkdir(parents=True)
    rows = []
    for n, (_, task, subtask, category, text, choices, gold) in enumerate(MME_EN[:2]):
        (root / "images" / f"{n}.png").write_bytes(image_bytes(980 + n))
        query = ("<image>" + text + " The choices are listed below:\n"
                 + "\n".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(choices))
                 + "\nSelect the best answer to the above multiple-choice question based on the image. Respond with "
                 "only the letter (A, B, C, D, or E) of the correct option.\nThe best answer is:")
        rows.append({"images": [f"images/{n}.png"], "query": query, "response": gold, "category": f"{task}/{subtask}"})
    (root / "MME_RealWorld.json").write_text(json.dumps(rows), encoding="utf-8")
    items = load_benchmark("mmerealworld", tmp_path)
    assert [i.answer for i in items] == ["A", "B"]
    assert items[1].options == {"A": "red", "B": "white", "C": "blue", "D": "black",
                                "E": "The image does not feature a moving car."}
    assert items[0].question.startswith("How many cars are in the image?")
    assert score("mmerealworld", [grade(i, "B") for i in items])["score"] == pytest.approx(50.0)
