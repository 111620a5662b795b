"""Training data from Hugging Face datasets: parquet (a file, a folder of shards), save_to_disk folders and a cached
hub id, with images embedded (the Image feature's bytes) or as paths; the same records as from the JSONL, the same
one-line errors naming the row and field. Every dataset is built here; no network."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from opd.data.records import crop_image, full_image
from opd.data.settings import DataError
from opd.data.settings import parse_columns
from opd.data.sources import load_records

datasets.disable_progress_bars()
ROOT = Path(__file__).resolve().parent.parent

FEATURES = {
    "images": datasets.List(datasets.Image()),
    "image": datasets.Image(),
    "teacher_images": datasets.List(datasets.Image()),
    "bbox": datasets.List(datasets.Value("int64")),
    "problem": datasets.Value("string"),
    "answer": datasets.Value("string"),
    "solution": datasets.Value("string"),
    "task": datasets.Value("string"),
    "level": datasets.Value("int64"),
}


@pytest.fixture
def folder(tmp_path):
    """Images (PNG full images, a JPEG crop) and rows of both forms: a crop file, a bbox, none; extra fields."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "full.png")
    Image.fromarray(rng.integers(0, 255, (30, 50, 3), dtype=np.uint8)).save(tmp_path / "other.png")
    Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "crop.jpg", quality=90)
    return tmp_path


ROWS = [
    {"images": ["full.png"], "teacher_images": ["crop.jpg"], "problem": "<image>Q1", "answer": "A", "task": "ocr", "level": 1},
    {"image": "other.png", "bbox": [6, 4, 36, 24], "problem": "<image>Q2", "answer": "B", "task": "count", "level": 2},
    {"images": ["full.png"], "problem": "Q3", "answer": "C", "solution": "because", "task": "ocr", "level": 3},
    {"images": ["other.png"], "bbox": [0, 0, 50, 30], "problem": "Q4 <image>", "answer": "D", "task": "chart", "level": 4},
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def columns_of(rows: list[dict], embed: Path | None) -> dict[str, list]:
    """Table columns of JSONL rows (absent fields null); images as the Image feature's embedded bytes from
    `embed`'s files, or left as the path strings when `embed` is None."""
    names = list(dict.fromkeys(k for r in rows for k in r))

    def image(value):
        if embed is None or value is None:
            return value
        if isinstance(value, list):
            return [image(v) for v in value]
        return {"bytes": (embed / value).read_bytes(), "path": None}

    return {k: [image(r.get(k)) if k in ("images", "image", "teacher_images") else r.get(k) for r in rows] for k in names}


def dataset_of(rows: list[dict], folder: Path):
    """A `datasets.Dataset` of the rows with the images embedded (Image feature bytes)."""
    cols = columns_of(rows, folder)
    return datasets.Dataset.from_dict(cols, features=datasets.Features({k: FEATURES[k] for k in cols}))


def signature(record) -> tuple:
    """What a record holds, apart from where it came from and where its image file lies."""
    return (record.problem, record.answer, record.solution, record.eligible, record.crop is not None, record.bbox,
            round(record.area_ratio, 12), record.extra, record.image_size, record.crop_size, record.image_key)  # fmt: skip


def pixels(record) -> tuple:
    full = np.asarray(full_image(record))
    return full, np.asarray(crop_image(record)) if record.eligible else None


def assert_same_records(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert signature(x) == signature(y)
        (fx, cx), (fy, cy) = pixels(x), pixels(y)
        assert np.array_equal(fx, fy)
        assert (cx is None and cy is None) or np.array_equal(cx, cy)


def test_every_layout_gives_the_jsonl_records(folder):
    """The same rows as JSONL, as parquet with embedded bytes, as save_to_disk (Dataset and DatasetDict), as parquet
    shards, as parquet of path strings and of path-only Image structs: the same records, pixels included."""
    reference = load_records(write_jsonl(folder / "train.jsonl", ROWS))
    cache = folder / "cache"
    ds = dataset_of(ROWS, folder)

    ds.to_parquet(str(folder / "train.parquet"))
    ds.save_to_disk(str(folder / "saved"))
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(folder / "dict"))
    (folder / "shards" / "data").mkdir(parents=True)
    for i in range(2):
        ds.shard(2, i, contiguous=True).to_parquet(str(folder / "shards" / "data" / f"train-0000{i}-of-00002.parquet"))
    cols = columns_of(ROWS, None)
    pq.write_table(pa.table(cols), folder / "paths.parquet")  # plain path strings, relative to the file's folder
    by_path = datasets.Dataset.from_dict(cols).cast_column("image", datasets.Image())
    pq.write_table(by_path.data.table, folder / "struct_paths.parquet")  # Image structs of a relative path, no bytes
    assert pq.read_table(folder / "struct_paths.parquet").column("image")[1].as_py() == {"bytes": None, "path": "other.png"}

    forms = {
        "parquet": load_records(folder / "train.parquet", image_cache=cache),
        "save_to_disk": load_records(folder / "saved", image_cache=cache),
        "DatasetDict": load_records(folder / "dict", split="train", image_cache=cache),
        "shards": load_records(folder / "shards", image_cache=cache),
        "path strings": load_records(folder / "paths.parquet", image_cache=cache),
        "path structs": load_records(folder / "struct_paths.parquet", image_cache=cache),
    }
    for name, records in forms.items():
        assert_same_records(reference, records), name
    assert [r.source for r in forms["parquet"]] == [f"{folder / 'train.parquet'} row {i}" for i in range(4)]
    assert forms["save_to_disk"][2].source == f"{folder / 'saved'} row 2"
    assert forms["DatasetDict"][3].source == f"{folder / 'dict'}[train] row 3"
    shard_1 = folder / "shards" / "data" / "train-00001-of-00002.parquet"
    assert [r.source for r in forms["shards"]][2:] == [f"{shard_1} row 0", f"{shard_1} row 1"]  # rows per shard file
    assert forms["path strings"][0].image == folder / "full.png"  # paths: the files themselves, no copy
    embedded = forms["parquet"][0]
    assert embedded.image.parent.parent == cache and embedded.crop.suffix == ".jpg"
    assert embedded.image.name == hashlib.sha256((folder / "full.png").read_bytes()).hexdigest() + ".png"
    assert embedded.crop.read_bytes() == (folder / "crop.jpg").read_bytes()


def test_embedded_images_are_written_once_by_content(folder, monkeypatch):
    """The cache is content-addressed: rows sharing an image share a file, a reload rewrites nothing; by default it
    lies under opd.tiny.cache_dir() ($BAS_OPD_CACHE)."""
    monkeypatch.setenv("BAS_OPD_CACHE", str(folder / "bas"))
    dataset_of(ROWS, folder).to_parquet(str(folder / "train.parquet"))
    first = load_records(folder / "train.parquet")
    files = sorted((folder / "bas" / "data-images").rglob("*.*"))
    assert len(files) == 3  # full.png, other.png, crop.jpg: each once, though full.png and other.png recur
    assert first[0].image == first[2].image and first[1].image == first[3].image
    stamps = [f.stat().st_mtime_ns for f in files]
    time.sleep(0.01)
    assert [r.image for r in load_records(folder / "train.parquet")] == [r.image for r in first]
    assert [f.stat().st_mtime_ns for f in files] == stamps
    assert not list((folder / "bas" / "data-images").rglob(".*.tmp"))


def test_bad_rows_name_the_row_and_field(folder):
    rows = [dict(r) for r in ROWS]
    rows[3]["bbox"] = [0, 0, 51, 30]  # outside the 50x30 image
    dataset_of(rows, folder).to_parquet(str(folder / "train.parquet"))
    with pytest.raises(DataError, match=r"train\.parquet row 3: field 'bbox': \[0, 0, 51, 30\] is empty or outside the 50x30"):
        load_records(folder / "train.parquet", image_cache=folder / "c")

    cut = (folder / "full.png").read_bytes()[:200]  # the header reads, the body is cut
    ds = dataset_of(ROWS[:2], folder)
    cols = ds.to_dict()
    cols["teacher_images"][0] = [{"bytes": cut, "path": "crop_0.png"}]
    datasets.Dataset.from_dict(cols, features=ds.features).save_to_disk(str(folder / "saved"))
    with pytest.raises(DataError, match=r"saved row 0: field 'teacher_images': cannot read image \(embedded, 200 bytes, 'crop_0.png'\)"):
        load_records(folder / "saved", image_cache=folder / "c")

    pq.write_table(pa.table({"image": ["full.png", "gone.png"], "problem": ["q", "q"], "answer": ["a", "a"]}), folder / "p.parquet")
    with pytest.raises(DataError, match=r"p\.parquet row 1: field 'image': image file not found: .*gone\.png"):
        load_records(folder / "p.parquet")
    pq.write_table(pa.table({"image": ["full.png"], "problem": ["<image><image>"], "answer": ["a"]}), folder / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet row 0: field 'problem': 2 '<image>' marks"):
        load_records(folder / "m.parquet")


def test_missing_columns_are_listed_with_the_columns_there(folder):
    pq.write_table(pa.table({"img": ["full.png"], "question": ["q"], "answer": ["a"]}), folder / "t.parquet")
    with pytest.raises(DataError) as err:
        load_records(folder / "t.parquet")
    message = str(err.value)
    assert "\n" not in message and "t.parquet: missing fields 'images' (or 'image'), 'problem'; its columns: img, question, answer" in message


def test_a_column_mapping_renames_columns_and_errors_name_the_column(folder):
    rows = [{"img": "full.png", "question": "<image>Q", "answer": "A", "area": "x"},
            {"img": "full.png", "question": "Q", "answer": "B", "area": "y"}]  # fmt: skip
    pq.write_table(pa.table({k: [r[k] for r in rows] for k in rows[0]}), folder / "t.parquet")
    mapping = parse_columns("img=image, question=problem ,area=task")
    assert mapping == {"img": "image", "question": "problem", "area": "task"}
    a, b = load_records(folder / "t.parquet", columns=mapping)
    assert (a.problem, b.answer, a.field("task"), a.image_key, a.image) == ("<image>Q", "B", "x", "img", folder / "full.png")
    assert load_records(folder / "t.parquet", columns="img=image,question=problem")[1].problem == "Q"  # the string form
    same = load_records(write_jsonl(folder / "t.jsonl", rows), columns=mapping)  # JSONL keys are mapped alike
    assert [signature(r) for r in same] == [signature(r) for r in (a, b)]

    pq.write_table(pa.table({"img": ["full.png"], "question": ["<image><image>"], "answer": ["a"]}), folder / "m.parquet")
    with pytest.raises(DataError, match=r"m\.parquet row 0: field 'question': 2 '<image>' marks"):
        load_records(folder / "m.parquet", columns={"img": "image", "question": "problem"})
    with pytest.raises(DataError, match=r"names column 'area', which the data does not have \(columns: img, question, answer\)"):
        load_records(folder / "m.parquet", columns=mapping)
    pq.write_table(pa.table({"image": ["full.png"], "question": ["q"], "problem": ["p"], "answer": ["a"]}), folder / "c.parquet")
    with pytest.raises(DataError, match=r"maps 'question' to 'problem', but the data has a 'problem' column too"):
        load_records(folder / "c.parquet", columns={"question": "problem"})


def test_a_jsonl_mapping_of_a_key_no_row_has_is_refused_as_a_tables(folder):
    """A mapped JSONL key that no row has is refused in one line, as a table's missing column is (a typo in
    --data-columns is not silently ignored); a key some rows have is mapped where it is."""
    rows = [{"img": "full.png", "question": "<image>Q", "answer": "A"}, {"img": "full.png", "problem": "Q", "answer": "B"}]
    path = write_jsonl(folder / "t.jsonl", rows)
    with pytest.raises(DataError) as err:
        load_records(path, columns={"img": "image", "qestion": "problem"})
    assert str(err.value) == f"{path}: the column mapping names key 'qestion', which no row has (keys: img, question, answer, problem)"
    a, b = load_records(path, columns={"img": "image", "question": "problem"})
    assert (a.problem, b.problem) == ("<image>Q", "Q")


def test_a_hub_split_is_loaded_alone(monkeypatch):
    """Given a split, `datasets.load_dataset` is asked for that split only (the others are not prepared); a split the
    dataset lacks is one line naming it."""
    calls = []
    table = datasets.Dataset.from_dict({"image": ["x.png"], "problem": ["q"], "answer": ["a"]})

    def load_dataset(name, **kwargs):
        calls.append((name, kwargs))
        if kwargs.get("split") not in (None, "test"):
            raise ValueError(f'Unknown split "{kwargs["split"]}". Should be one of [\'test\'].')
        return table if kwargs.get("split") else datasets.DatasetDict(test=table)

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    with pytest.raises(DataError, match="x.png"):  # loaded: its row names the missing image
        load_records("org/name", split="test")
    assert calls == [("org/name", {"split": "test"})]
    with pytest.raises(DataError, match=r"^org/name: no split 'dev' \(Unknown split \"dev\""):
        load_records("org/name", split="dev")


@pytest.mark.parametrize(
    "text,words",
    [("question", "expected COLUMN=FIELD pairs"), ("a=b,,c=d", "got ''"), ("=problem", "got '=problem'"),
     ("a=b=c", "got 'a=b=c'"), ("a=problem,a=answer", "column 'a' is mapped twice"),
     ("a=problem,b=problem", "two columns are mapped to field 'problem'")],
)  # fmt: skip
def test_the_column_mapping_string_is_checked_in_one_line(text, words):
    with pytest.raises(DataError, match="^--data-columns ") as err:
        parse_columns(text)
    assert words in str(err.value) and "\n" not in str(err.value)
    assert parse_columns(None) == {} and parse_columns(" ") == {}


def test_splits_are_chosen_or_refused_in_one_line(folder):
    ds = dataset_of(ROWS, folder)
    datasets.DatasetDict(train=ds, test=ds.select([0])).save_to_disk(str(folder / "dict"))
    with pytest.raises(DataError, match=r"dict: holds splits train, test; choose one \(--data-split\)"):
        load_records(folder / "dict")
    with pytest.raises(DataError, match=r"dict: no split 'dev' \(splits: train, test\)"):
        load_records(folder / "dict", split="dev")
    assert len(load_records(folder / "dict", split="test", image_cache=folder / "c")) == 1
    datasets.DatasetDict(train=ds).save_to_disk(str(folder / "one"))
    assert load_records(folder / "one", image_cache=folder / "c")[0].source.endswith("one[train] row 0")  # its only split

    (folder / "hub" / "data").mkdir(parents=True)
    ds.to_parquet(str(folder / "hub" / "data" / "train-00000-of-00001.parquet"))
    ds.select([1]).to_parquet(str(folder / "hub" / "data" / "test-00000-of-00001.parquet"))
    with pytest.raises(DataError, match=r"hub: holds parquet files of splits test, train; choose one"):
        load_records(folder / "hub")
    assert len(load_records(folder / "hub", split="train", image_cache=folder / "c")) == 4
    assert [r.problem for r in load_records(folder / "hub", split="test", image_cache=folder / "c")] == ["<image>Q2"]
    with pytest.raises(DataError, match=r"no parquet file of split 'validation' .*splits found: test, train"):
        load_records(folder / "hub", split="validation")

    ds.save_to_disk(str(folder / "saved"))
    for path in (folder / "saved", folder / "hub" / "data" / "test-00000-of-00001.parquet",
                 write_jsonl(folder / "t.jsonl", ROWS)):  # fmt: skip
        with pytest.raises(DataError, match=r"which has no splits; drop the split 'train'"):
            load_records(path, split="train")


def test_folders_and_files_that_are_not_data_are_refused_in_one_line(folder):
    with pytest.raises(DataError, match=r"is a folder holding neither parquet files nor a dataset saved by datasets' save_to_disk"):
        load_records(folder)  # images only
    (folder / "bad.parquet").write_bytes(b"PAR1" + b"\0" * 16 + b"PAR1")
    with pytest.raises(DataError) as err:
        load_records(folder / "bad.parquet")
    assert str(err.value).startswith(f"{folder / 'bad.parquet'}: cannot read parquet file: ") and "\n" not in str(err.value)
    pq.write_table(pa.table({"image": pa.array([], pa.string()), "problem": pa.array([], pa.string()),
                             "answer": pa.array([], pa.string())}), folder / "empty.parquet")  # fmt: skip
    with pytest.raises(DataError, match=r"empty\.parquet: no records"):
        load_records(folder / "empty.parquet")
    (folder / "train.arrow").write_bytes(b"x")
    with pytest.raises(DataError, match=r"not a JSONL or parquet file; give the folder save_to_disk wrote"):
        load_records(folder / "train.arrow")
    (folder / "saved").mkdir()
    (folder / "saved" / "state.json").write_text("{not json")
    with pytest.raises(DataError, match=r"saved: cannot read the datasets folder \(save_to_disk\): "):
        load_records(folder / "saved")


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty datasets cache and no network: HF_HUB_OFFLINE set (so `hub_reachable` says no at once)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    return tmp_path / "hf-datasets"


def test_a_hub_id_not_in_the_cache_fails_fast_offline(hub_cache):
    start = time.monotonic()
    with pytest.raises(DataError) as err:
        load_records("some-org/not-cached", split="train")
    assert time.monotonic() - start < 30  # no network wait (most of it is importing opd.models.loading)
    assert str(err.value) == (f"some-org/not-cached: not a local file or folder, not in the datasets cache ({hub_cache}), "
                              "and the hub cannot be reached (offline)")  # fmt: skip
    with pytest.raises(DataError, match="training data file not found"):
        load_records("some-org/train.jsonl")  # a data file's name is no hub id


def test_a_hub_id_in_the_cache_loads_offline(folder, hub_cache):
    """A hub dataset as `load_dataset` leaves it in its cache (ORG___NAME/default/VERSION/HASH, NAME-SPLIT.arrow),
    built here by datasets' parquet builder: read through datasets' offline mode, sources 'org/name[split] row N'."""
    from datasets.packaged_modules.parquet.parquet import Parquet

    ds = dataset_of(ROWS, folder)
    (folder / "src").mkdir()
    ds.to_parquet(str(folder / "src" / "train.parquet"))
    ds.select([2]).to_parquet(str(folder / "src" / "test.parquet"))
    files = {s: str(folder / "src" / f"{s}.parquet") for s in ("train", "test")}
    builder = Parquet(cache_dir=str(hub_cache), dataset_name="name", data_files=files, hash="0123abcd")
    builder.download_and_prepare()
    (hub_cache / "org___name" / "default" / "0.0.0").mkdir(parents=True)
    shutil.move(builder.cache_dir, hub_cache / "org___name" / "default" / "0.0.0" / "0123abcd")

    records = load_records("org/name", split="train", image_cache=folder / "c")
    assert_same_records(load_records(write_jsonl(folder / "t.jsonl", ROWS)), records)
    assert [r.source for r in records] == [f"org/name[train] row {i}" for i in range(4)]
    with pytest.raises(DataError, match=r"^org/name: holds splits train, test; choose one"):
        load_records("org/name")
    assert [r.problem for r in load_records("org/name", split="test", image_cache=folder / "c")] == ["Q3"]


def test_jsonl_and_parquet_do_not_import_datasets(folder):
    """datasets is imported only for a save_to_disk folder or a hub id."""
    jsonl = write_jsonl(folder / "t.jsonl", ROWS)
    pq.write_table(pa.table(columns_of(ROWS, None)), folder / "paths.parquet")
    code = ("import sys; from opd.data.sources import load_records; "
            f"load_records({str(jsonl)!r}); load_records({str(folder / 'paths.parquet')!r}); "
            "assert 'datasets' not in sys.modules, 'datasets imported'")  # fmt: skip
    proc = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_training_from_parquet_and_save_to_disk_gives_the_jsonl_ledger(tmp_path, tiny):
    """train.py --data X.parquet (the Image feature's embedded bytes) and --data DIR (save_to_disk), built from the
    tiny default's JSONL: the same records, so the same ledger as the JSONL run (timings aside), same seed."""
    import train
    from opd.loop.ledger import read_ledger

    jsonl = tiny[1]
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    for r in rows:  # one form for the table: images as a list, the bbox form's crop cut from its image
        if "image" in r:
            r["images"] = [r.pop("image")]
    table = dataset_of(rows, jsonl.parent)
    table.to_parquet(str(tmp_path / "train.parquet"))
    table.save_to_disk(str(tmp_path / "saved"))
    common = ["--preset", "tiny", "--steps", "2", "--policy", "random", "--rho", "0.5"]
    ledgers = {}
    for name, data in (("jsonl", jsonl), ("parquet", tmp_path / "train.parquet"), ("saved", tmp_path / "saved")):
        train.main([*common, "--data", str(data), "--out", str(tmp_path / name)])
        ledgers[name] = read_ledger(tmp_path / name / "ledger.jsonl")
    timing = lambda k: k.endswith("_s") or k.startswith("teacher_forward_s_") or k == "launch"  # noqa: E731
    for name in ("parquet", "saved"):
        assert len(ledgers[name]) == 2
        for a, b in zip(ledgers["jsonl"], ledgers[name], strict=True):
            assert {k: v for k, v in a.items() if not timing(k)} == {k: v for k, v in b.items() if not timing(k)}, name
