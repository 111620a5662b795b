"""Training records: both JSONL forms, crops, eligibility, clear errors, the step batches, the tiny builder."""

import json

import numpy as np
import pytest
from PIL import Image

from opd.models.chat import encode_prompt, prompt_text, user_message
from opd.data.records import crop_image, full_image, shard, step_prompt_indices
from opd.data.settings import DataError
from opd.data.sources import load_records
from opd.models.loading import load_model, load_processor


@pytest.fixture
def folder(tmp_path):
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (40, 60, 3), dtype=np.uint8)).save(tmp_path / "full.png")
    Image.fromarray(rng.integers(0, 255, (10, 12, 3), dtype=np.uint8)).save(tmp_path / "crop.png")
    return tmp_path


def write(folder, rows) -> str:
    path = folder / "train.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_both_record_forms_and_eligibility(folder):
    path = write(
        folder,
        [
            {"images": ["full.png"], "teacher_images": ["crop.png"], "problem": "<image>Q1", "answer": "A"},
            {"image": "full.png", "bbox": [6, 4, 36, 24], "problem": "<image>Q2", "answer": "B"},
            {"images": ["full.png"], "problem": "Q3", "answer": "C"},
        ],
    )
    a, b, c = load_records(path)
    assert (a.eligible, b.eligible, c.eligible) == (True, True, False)
    assert a.area_ratio == pytest.approx(12 * 10 / (60 * 40))  # crop file cut at native resolution
    assert c.area_ratio == 0.0
    assert b.area_ratio == pytest.approx(30 * 20 / (60 * 40))
    assert crop_image(a).size == (12, 10)
    cut = np.asarray(crop_image(b))
    assert cut.shape == (20, 30, 3)
    assert np.array_equal(cut, np.asarray(full_image(b))[4:24, 6:36])
    assert a.source.endswith("train.jsonl:1") and c.source.endswith("train.jsonl:3")


def test_a_crop_file_larger_than_the_image_gives_area_ratio_one(folder):
    Image.new("RGB", (120, 80)).save(folder / "big_crop.png")  # an upscaled crop: 4x the full image's area
    path = write(folder, [{"images": ["full.png"], "teacher_images": ["big_crop.png"], "problem": "q", "answer": "a"}])
    assert load_records(path)[0].area_ratio == 1.0


@pytest.mark.parametrize("fmt,key", [("PNG", "image"), ("JPEG", "image"), ("PNG", "images"), ("JPEG", "teacher_images")])
def test_a_damaged_image_body_fails_at_load_time_naming_the_rows_own_key(folder, fmt, key):
    """The header reads, the body is cut: refused when the file is read, naming the key the row uses."""
    rng = np.random.default_rng(1)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / "whole", format=fmt)
    data = (folder / "whole").read_bytes()
    (folder / "cut").write_bytes(data[: len(data) // 2])
    with Image.open(folder / "cut") as im:  # the header alone still reads
        assert im.size == (64, 64)
    row = {"problem": "q", "answer": "a"}
    if key == "teacher_images":
        row.update(images=["full.png"], teacher_images=["cut"])
    else:
        row[key] = "cut" if key == "image" else ["cut"]
    with pytest.raises(DataError, match=rf"train.jsonl:1: field '{key}': cannot read image"):
        load_records(write(folder, [row]))


@pytest.mark.parametrize(
    "row,field,words",
    [
        ("{not json", None, "malformed JSON"),
        ({"problem": "q", "answer": "a"}, "images", "missing"),
        ({"images": ["nope.png"], "problem": "q", "answer": "a"}, "images", "not found"),
        ({"images": ["full.png"], "teacher_images": ["gone.png"], "problem": "q", "answer": "a"}, "teacher_images", "not found"),
        ({"images": ["full.png"], "answer": "a"}, "problem", "missing"),
        ({"image": "full.png", "bbox": [0, 0, 61, 10], "problem": "q", "answer": "a"}, "bbox", "outside"),
        ({"image": "full.png", "bbox": [5, 5, 5, 9], "problem": "q", "answer": "a"}, "bbox", "empty"),
        ({"image": "full.png", "bbox": [-1, 0, 5, 9], "problem": "q", "answer": "a"}, "bbox", "outside"),
        ({"image": "full.png", "bbox": [1, 2, 3], "problem": "q", "answer": "a"}, "bbox", "x1, y1, x2, y2"),
        ({"images": ["full.png", "full.png"], "problem": "q", "answer": "a"}, "images", "exactly one"),
        ({"images": ["broken.png"], "problem": "q", "answer": "a"}, "images", "cannot read"),
    ],
)
def test_bad_records_name_file_line_and_field(folder, row, field, words):
    (folder / "broken.png").write_bytes(b"not an image")
    good = {"images": ["full.png"], "problem": "q", "answer": "a"}
    path = write(folder, [good, "", row])
    with pytest.raises(DataError) as err:
        load_records(path)
    message = str(err.value)
    assert f"{path}:3" in message and words in message
    if field:
        assert f"'{field}'" in message


def test_missing_and_empty_files(tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(DataError, match="no records"):
        load_records(tmp_path / "empty.jsonl")


def test_step_batches_cover_an_epoch_without_repeats_and_are_reproducible():
    epoch = [i for s in range(10) for i in step_prompt_indices(31, 3, s, seed=42)]
    assert len(set(epoch)) == 30  # floor(31 / 3) = 10 steps, the last partial batch dropped
    assert step_prompt_indices(31, 3, 4, 42) == step_prompt_indices(31, 3, 4, 42)
    assert step_prompt_indices(31, 3, 10, 42) != step_prompt_indices(31, 3, 0, 42)  # a new epoch, a new order
    assert shard(list(range(8)), 1, 2) == [4, 5, 6, 7]
    with pytest.raises(ValueError, match="do not split"):
        shard(list(range(7)), 0, 2)


def test_user_message_places_images_where_marked():
    assert user_message("<image>What?", 1)[0]["content"] == [{"type": "image"}, {"type": "text", "text": "What?"}]
    assert user_message("Look: <image> now", 1)[0]["content"] == [
        {"type": "text", "text": "Look:"}, {"type": "image"}, {"type": "text", "text": "now"},
    ]  # fmt: skip
    assert user_message("No mark", 1)[0]["content"][0] == {"type": "image"}
    with pytest.raises(ValueError, match="marks"):
        user_message("<image><image>", 1)


def test_tiny_model_loads_through_from_pretrained(tiny):
    model_dir, _ = tiny
    model, processor = load_model(str(model_dir)), load_processor(str(model_dir))
    assert type(model).__name__ == "Qwen3_5ForConditionalGeneration"
    assert type(processor).__name__ == "Qwen3VLProcessor"
    text = prompt_text(processor, "<image>Hi?", 1)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "<think>" not in prompt_text(processor, "<image>Hi?", 1, enable_thinking=True).split("assistant")[-1]
    tok = processor.tokenizer
    assert tok.decode(tok("Hello, (B) 42!").input_ids) == "Hello, (B) 42!"
    enc = encode_prompt(processor, [Image.new("RGB", (64, 64))], "<image>Hi?")
    n_image_tokens = int((enc.input_ids == model.config.image_token_id).sum())
    assert n_image_tokens == int(enc.image_grid_thw.prod()) // 4
    with pytest.raises(ValueError, match="maximum prompt length"):
        encode_prompt(processor, [Image.new("RGB", (64, 64))], "<image>Hi?", max_len=5)
