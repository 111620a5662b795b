"""Tiny benchmark fixtures in each shipped layout, for loader tests and end-to-end eval tests.

Each ``write_<name>_fixture(data_dir, ...)`` writes into ``data_dir/<name>/`` the layout that
``opd.eval.benchmarks.load_benchmark(name, data_dir)`` reads, and returns ``{index: gold answer}``.
``<name>_rows()`` give the Hugging Face parquet rows (images as ``{"bytes", "path"}`` structs);
``fmt="parquet"`` writes them with pyarrow (callers skip when it is missing).
"""

from __future__ import annotations

import base64
import csv
import io
import json
import random
from pathlib import Path

from PIL import Image


def image_bytes(seed: int, size=(12, 8), fmt: str = "PNG") -> bytes:
    """A small solid-colour image, its colour drawn from ``seed``."""
    rng = random.Random(seed)
    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _struct(seed: int, size=(12, 8)) -> dict:
    return {"bytes": image_bytes(seed, size), "path": f"{seed}.png"}


def _root(data_dir, name: str) -> Path:
    root = Path(data_dir) / name
    root.mkdir(parents=True, exist_ok=True)
    return root


def _write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)


def _write_tsv(path: Path, header: list[str], rows: list[list]) -> None:
    with open(path, "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh, delimiter="\t")
        writer.writerow(header)
        writer.writerows(rows)


def _write_visionopd(root: Path, rows: list[dict], image_key: str = "image", prompt_key: str = "question",
                     answer_key: str = "answer") -> None:
    """The same rows as a Vision-OPD eval JSON with image files beside it."""
    out = []
    for n, row in enumerate(rows):
        (root / "images").mkdir(exist_ok=True)
        rel = f"images/{n}.png"
        (root / rel).write_bytes(row[image_key]["bytes"])
        entry = {"images": [rel], "query": "<image>" + row[prompt_key], "response": row[answer_key]}
        entry.update({k: v for k, v in row.items() if isinstance(v, (str, int)) and k not in (prompt_key, answer_key)})
        out.append(entry)
    (root / "eval.json").write_text(json.dumps(out, indent=1), encoding="utf-8")


VSTAR_QUESTIONS = [
    ("What is the color of the umbrella?", ["red", "blue", "green", "yellow"], "A", "direct_attributes"),
    ("What is the material of the glove?", ["rubber", "cotton", "leather", "wool"], "C", "direct_attributes"),
    ("Is the cup on the left or right side of the plate?", ["left", "right"], "B", "relative_position"),
    ("Is the dog on the left or right side of the cat?", ["left", "right"], "A", "relative_position"),
]


def write_vstar_fixture(data_dir, fmt: str = "jsonl") -> dict[str, str]:
    """V*Bench: ``test_questions.jsonl`` + image folders (fmt "jsonl") or a VLMEvalKit TSV ("tsv")."""
    root = _root(data_dir, "vstar")
    answers = {}
    lines, tsv_rows = [], []
    for n, (question, options, label, category) in enumerate(VSTAR_QUESTIONS):
        data = image_bytes(100 + n, fmt="JPEG")
        opts = "\n".join(f"({chr(65 + i)}) {o}" for i, o in enumerate(options))
        text = f"{question}\n{opts}\nAnswer with the option's letter from the given choices directly."
        if fmt == "jsonl":
            (root / category).mkdir(exist_ok=True)
            (root / category / f"sa_{n}.jpg").write_bytes(data)
            lines.append({"image": f"{category}/sa_{n}.jpg", "text": text, "category": category,
                          "question_id": n, "label": label})
        else:
            cells = [options[i] if i < len(options) else "" for i in range(4)]
            tsv_rows.append([n, question, *cells, label, category, base64.b64encode(data).decode()])
        answers[str(n)] = label
    if fmt == "jsonl":
        (root / "test_questions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines), encoding="utf-8")
    else:
        _write_tsv(root / "VStarBench.tsv", ["index", "question", "A", "B", "C", "D", "answer", "category", "image"],
                   tsv_rows)
    return answers


def hrbench_rows() -> list[dict]:
    """3 questions x 2 option cycles; "single" and "cross" categories; one image per question."""
    base = [("What is written on the sign?", ["STOP", "GO", "EXIT", "OPEN"], 0, "single"),
            ("What color is the small boat?", ["white", "red", "blue", "black"], 2, "single"),
            ("Which is closer to the tree, the car or the bike?", ["car", "bike", "both", "neither"], 1, "cross")]
    rows, index = [], 0
    for cycle in range(2):
        for q, (question, options, gold, category) in enumerate(base):
            rotated = options[cycle:] + options[:cycle]
            row = {"index": index, "question": question, "answer": chr(65 + rotated.index(options[gold])),
                   "category": category, "cycle_category": f"cycle{cycle}", "image": _struct(200 + q)}
            row.update({chr(65 + i): o for i, o in enumerate(rotated)})
            rows.append(row)
            index += 1
    return rows


def write_hrbench4k_fixture(data_dir, fmt: str = "tsv") -> dict[str, str]:
    """HR-Bench 4K: ``hr_bench_4k.tsv`` (base64 images; repeated images stored as the index of the row
    holding them, as VLMEvalKit does) plus an 8K file that must be ignored; or parquet."""
    root = _root(data_dir, "hrbench4k")
    rows = hrbench_rows()
    if fmt == "parquet":
        _write_parquet(root / "data" / "hr_bench_4k-00000.parquet", rows)
    else:
        header = ["index", "question", "answer", "category", "A", "B", "C", "D", "cycle_category", "image"]
        out, first = [], {}
        for r in rows:
            b64 = base64.b64encode(r["image"]["bytes"]).decode()
            image = str(first[b64]) if b64 in first else b64
            first.setdefault(b64, r["index"])
            out.append([r[h] if h != "image" else image for h in header])
        _write_tsv(root / "hr_bench_4k.tsv", header, out)
        _write_tsv(root / "hr_bench_8k.tsv", header, [["x"] * len(header)])
    return {str(r["index"]): r["answer"] for r in rows}


MMVP_ROWS = [
    (1, "Is the dog facing left or right?", "(a) Left (b) Right", "(a)"),
    (2, "Is the dog facing left or right?", "(a) Left (b) Right", "(b)"),
    (3, "Is the door open?", "(a) Yes (b) No", "(b)"),
    (4, "Is the door open?", "(a) Yes (b) No", "(a)"),
]


def write_mmvp_fixture(data_dir, header_index: str = "Index") -> dict[str, str]:
    """MMVP original: ``Questions.csv`` + ``MMVP Images/<Index>.jpg``. ``header_index="lndex"``
    reproduces the misspelt header of some copies."""
    root = _root(data_dir, "mmvp")
    (root / "MMVP Images").mkdir(exist_ok=True)
    with open(root / "Questions.csv", "w", encoding="utf-8", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([header_index, "Question", "Options", "Correct Answer"])
        for index, question, options, answer in MMVP_ROWS:
            writer.writerow([index, question, options, answer])
            (root / "MMVP Images" / f"{index}.jpg").write_bytes(image_bytes(300 + index, fmt="JPEG"))
    return {str(i): a.strip("()").upper() for i, _, _, a in MMVP_ROWS}


def cvbench_rows() -> list[dict]:
    """2 ADE20K + 2 COCO (2D) and 3 Omni3D (3D) questions."""
    spec = [("2D", "Count", "ADE20K", "How many chairs are in the image?", ["1", "2", "3", "4"], "(B)"),
            ("2D", "Relation", "ADE20K", "Is the lamp left of the bed?", ["left", "right"], "(A)"),
            ("2D", "Count", "COCO", "How many cups are in the image?", ["0", "1", "2", "3"], "(D)"),
            ("2D", "Relation", "COCO", "Is the cat above the sofa?", ["above", "below"], "(B)"),
            ("3D", "Depth", "Omni3D", "Which is closer to the camera?", ["the table", "the door"], "(A)"),
            ("3D", "Distance", "Omni3D", "Which is closer to the lamp?", ["the chair", "the desk"], "(B)"),
            ("3D", "Depth", "Omni3D", "Which is farther from the camera?", ["the car", "the tree"], "(A)")]
    rows = []
    for idx, (kind, task, source, question, choices, answer) in enumerate(spec):
        opts = "\n".join(f"({chr(65 + i)}) {c}" for i, c in enumerate(choices))
        rows.append({"idx": idx, "type": kind, "task": task, "source": source,
                     "prompt": f"{question} Select from the following choices.\n{opts}", "choices": choices,
                     "answer": answer, "filename": f"img/{kind}/{task.lower()}/{source.lower()}_{idx}.png",
                     "image": _struct(400 + idx)})
    return rows


def write_cvbench_fixture(data_dir, fmt: str = "jsonl") -> dict[str, str]:
    """CV-Bench: ``test.jsonl`` with images at their ``filename`` (fmt "jsonl"), or parquet
    ``test_2d.parquet`` + ``test_3d.parquet`` ("parquet")."""
    root = _root(data_dir, "cvbench")
    rows = cvbench_rows()
    if fmt == "parquet":
        for kind in ("2D", "3D"):
            _write_parquet(root / f"test_{kind.lower()}.parquet", [r for r in rows if r["type"] == kind])
    else:
        with open(root / "test.jsonl", "w", encoding="utf-8") as fh:
            for r in rows:
                path = root / r["filename"]
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_bytes(r["image"]["bytes"])
                fh.write(json.dumps({k: v for k, v in r.items() if k != "image"}) + "\n")
    return {f"{r['type']}/{r['idx']}": r["answer"].strip("()") for r in rows}


def mmstar_rows() -> list[dict]:
    """MMStar parquet rows: options inline in the question ("Options: A: ..., B: ...")."""
    spec = [("Which option describes the scene?", ["A beach.", "A forest.", "A city.", "A desert."], "C",
             "coarse perception", "image scene and topic"),
            ("How many birds are there?", ["1", "2", "3", "4"], "A", "fine-grained perception", "object counting"),
            ("What is the value of x?", ["2", "4", "6", "8"], "D", "math", "geometry")]
    rows = []
    for n, (question, options, answer, category, l2) in enumerate(spec):
        inline = ", ".join(f"{chr(65 + i)}: {o}" for i, o in enumerate(options))
        rows.append({"index": n, "question": f"{question}\nOptions: {inline}", "image": _struct(500 + n),
                     "answer": answer, "category": category, "l2_category": l2, "meta_info": {"source": "x"}})
    return rows


def write_mmstar_fixture(data_dir, fmt: str = "tsv") -> dict[str, str]:
    """MMStar: VLMEvalKit ``MMStar.tsv`` (option columns A-D) or HF parquet (options inline)."""
    root = _root(data_dir, "mmstar")
    rows = mmstar_rows()
    if fmt == "parquet":
        _write_parquet(root / "mmstar.parquet", rows)
    else:
        from opd.answers.options import split_options

        out = []
        for r in rows:
            question, options = split_options(r["question"])
            out.append([r["index"], question, *[options[k] for k in "ABCD"], r["answer"], r["category"],
                        r["l2_category"], base64.b64encode(r["image"]["bytes"]).decode()])
        _write_tsv(root / "MMStar.tsv", ["index", "question", "A", "B", "C", "D", "answer", "category",
                                         "l2-category", "image"], out)
    return {str(r["index"]): r["answer"] for r in rows}


def pope_rows() -> list[dict]:
    """2 questions per split (adversarial, popular, random), one yes and one no each."""
    rows = []
    for s, split in enumerate(("adversarial", "popular", "random")):
        for k, (obj, answer) in enumerate((("dog", "yes"), ("snowboard", "no"))):
            qid = s * 2 + k + 1
            rows.append({"id": str(qid), "question_id": str(qid), "question": f"Is there a {obj} in the image?",
                         "answer": answer, "image_source": f"COCO_{qid}", "image": _struct(600 + qid),
                         "category": split})
    return rows


def write_pope_fixture(data_dir, fmt: str = "json") -> dict[str, str]:
    """POPE: HF parquet under ``data/`` (fmt "parquet") or a Vision-OPD eval JSON ("json")."""
    root = _root(data_dir, "pope")
    rows = pope_rows()
    if fmt == "parquet":
        _write_parquet(root / "data" / "test-00000-of-00001.parquet", rows)
        return {f"{r['category']}/{r['question_id']}": r["answer"] for r in rows}
    _write_visionopd(root, rows)
    return {r["id"]: r["answer"] for r in rows}


def zoombench_rows() -> list[dict]:
    """ZoomBench parquet rows (id, query, response, question_type, image, crop_image): two multiple-choice
    (golds "B" and "C. 71"), one open, one open with a yes/no gold."""
    spec = [("<image>What is the brand on the cup?\nA. Nike\nB. Adidas\nC. Puma\nD. Reebok", "B", "mcq"),
            ("<image>What number is on the jersey?\n(A) 7\n(B) 17\n(C) 71", "C. 71", "mcq"),
            ("<image>What word is written on the small sign? A. B. C. are not options here.", "Exit", "open"),
            ("<image>Is the light in the window on?", "Yes", "open")]
    return [{"id": f"zb{n}", "image": _struct(700 + n, (16, 16)), "crop_image": _struct(800 + n, (8, 8)),
             "query": query, "response": response, "question_type": qtype}
            for n, (query, response, qtype) in enumerate(spec)]


ZOOMBENCH_ANSWERS = {"zb0": "B", "zb1": "C", "zb2": "Exit", "zb3": "yes"}


def write_zoombench_fixture(data_dir, fmt: str = "json") -> dict[str, str]:
    """ZoomBench: HF parquet under ``data/`` (fmt "parquet") or a Vision-OPD eval JSON with
    ``crop_images`` ("json", the layout Vision-OPD's converter writes)."""
    root = _root(data_dir, "zoombench")
    rows = zoombench_rows()
    if fmt == "parquet":
        _write_parquet(root / "data" / "test-00000-of-00001.parquet", rows)
    else:
        (root / "images").mkdir(exist_ok=True)
        out = []
        for r in rows:
            (root / "images" / f"{r['id']}.jpg").write_bytes(r["image"]["bytes"])
            (root / "images" / f"{r['id']}_crop.jpg").write_bytes(r["crop_image"]["bytes"])
            out.append({"source_id": r["id"], "query": r["query"], "response": r["response"],
                        "images": [f"images/{r['id']}.jpg"], "crop_images": [f"images/{r['id']}_crop.jpg"],
                        "question_format": "multiple_choice" if r["question_type"] == "mcq" else "open_question"})
        (root / "zoombench.json").write_text(json.dumps(out, indent=1), encoding="utf-8")
    return dict(ZOOMBENCH_ANSWERS)


def write_all_fixtures(data_dir) -> dict[str, dict[str, str]]:
    """Every benchmark in its default fixture format (none needs pyarrow)."""
    return {
        "vstar": write_vstar_fixture(data_dir),
        "zoombench": write_zoombench_fixture(data_dir),
        "hrbench4k": write_hrbench4k_fixture(data_dir),
        "mmvp": write_mmvp_fixture(data_dir),
        "cvbench": write_cvbench_fixture(data_dir),
        "mmstar": write_mmstar_fixture(data_dir),
        "pope": write_pope_fixture(data_dir),
    }
