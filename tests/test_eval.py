"""eval.py end to end on the built-in tiny model over fixture copies of all seven benchmarks.

One module-scoped run (`full_run`: every benchmark, plus ZoomBench's crop view) is shared; the other
tests resume, rescore, judge or compare copies of its output, so the tiny model generates only a
handful of batches in the whole file. The judge talks to a fake OpenAI-compatible server on 127.0.0.1.
"""

import contextlib
import http.server
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_fixtures import ZOOMBENCH_ANSWERS, write_all_fixtures, write_vstar_fixture, write_zoombench_fixture
from fake_http import LocalServer, send_json
from transformers import GenerationConfig

import eval as eval_py
from opd.cli import UserError
from opd.eval import evaluate, inference
from opd.eval.judge import Judge, JudgeError, cache_key, endpoint, parse_verdict
from opd.eval.report import write_results

NAMES = ["vstar", "zoombench", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope"]
HEADER = "| Model | V*Bench | ZoomBench | HR-Bench 4K | MMVP | CV-Bench | MMStar | POPE | Avg. |"
MAX_NEW = 3
BATCH = 4


def args(model, data_dir, out, *extra):
    return ["--model", str(model), "--data-dir", str(data_dir), "--out", str(out), "--batch-size", str(BATCH),
            "--max-new-tokens", str(MAX_NEW), "--device", "cpu", "--no-progress", *map(str, extra)]


def run_quiet(argv):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        ret = eval_py.main(argv)
    return ret, buf.getvalue()


def predictions(folder) -> list[dict]:
    lines = (Path(folder) / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def results(out) -> dict:
    return json.loads((Path(out) / "results.json").read_text(encoding="utf-8"))["benchmarks"]



@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchdata")
    return SimpleNamespace(dir=root, golds=write_all_fixtures(root))


@pytest.fixture(scope="module")
def full_run(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("runs") / "tiny-full"
    ret, stdout = run_quiet(args(tiny[0], data.dir, out, "--view", "crop", "--progress"))
    return SimpleNamespace(model=tiny[0], out=out, stdout=stdout, ret=ret)


def copy_run(src: Path, dst: Path, keys) -> Path:
    for key in keys:
        shutil.copytree(src / key, dst / key)
    return dst


class NoGeneration:
    """Replaces inference.answer_items; fails the test if anything is generated."""

    def __call__(self, model, processor, items, *a, **k):
        items = list(items)
        if items:
            raise AssertionError(f"unexpected generation for {[i.index for i in items]}")
        return iter(())


# ----------------------------------------------------------------------------- end to end


def test_every_benchmark_scored_and_table_printed(full_run, data):
    bench = results(full_run.out)
    assert set(bench) == set(NAMES) | {"zoombench@crop"}
    for name in NAMES:
        assert isinstance(bench[name]["score"], float) and 0.0 <= bench[name]["score"] <= 100.0, name
        assert bench[name]["n"] == len(data.golds[name]), name
        rows = predictions(full_run.out / name)
        assert sorted(r["index"] for r in rows) == sorted(data.golds[name]), name
        for r in rows:
            # the gold stored with each reply is this item's gold: replies land on the right items
            assert r["answer"].lower() == str(data.golds[name][r["index"]]).lower(), (name, r)
            # only new tokens are decoded (a char-level tokenizer: at most MAX_NEW characters), no specials
            assert len(r["reply"]) <= MAX_NEW and "<|" not in r["reply"], r["reply"]
        settings = json.loads((full_run.out / name / "settings.json").read_text())
        assert settings["max_new_tokens"] == MAX_NEW and settings["enable_thinking"] is False
        assert settings["view"] == "full" and settings["dtype"] == "float32"
    lines = full_run.stdout.strip().splitlines()
    assert HEADER in lines
    row = lines[lines.index(HEADER) + 2]
    assert row.startswith("| tiny-full |") and len(row.split("|")) == len(HEADER.split("|"))
    assert (full_run.out / "results.md").read_text().strip() in full_run.stdout
    meta = json.loads((full_run.out / "results.json").read_text())["meta"]
    assert meta["seed"] == 42 and meta["max_new_tokens"] == MAX_NEW and meta["device"] == "cpu"


def test_crop_view_reports_the_zoom_gap(full_run, data):
    bench = results(full_run.out)
    gap = bench["zoombench@crop"]["zoom_gap"]
    assert gap["n"] == len(ZOOMBENCH_ANSWERS)
    assert gap["full"] == pytest.approx(bench["zoombench"]["score"])
    assert gap["crop"] == pytest.approx(bench["zoombench@crop"]["score"])
    assert gap["gap"] == pytest.approx(gap["crop"] - gap["full"])
    crop_rows = predictions(full_run.out / "zoombench@crop")
    assert {r["view"] for r in crop_rows} == {"crop"} and len(crop_rows) == len(ZOOMBENCH_ANSWERS)
    assert "zoombench zoom gap (crop - full, 4 items)" in full_run.stdout
    assert "no crop images" in full_run.stdout and "vstar" in full_run.stdout


def test_crop_view_uses_the_crop_image(data):
    from opd.eval.benchmarks import load_benchmark

    item = load_benchmark("zoombench", data.dir)[0]
    assert inference.item_image(item, "full").size == (16, 16)  # the fixture's full image
    assert inference.item_image(item, "crop").size == (8, 8)  # and its crop
    item.crop = None
    with pytest.raises(ValueError, match="no crop image"):
        inference.item_image(item, "crop")


def test_oracle_replies_score_100_everywhere(tiny, data, tmp_path, monkeypatch):
    """Replies equal to the gold (in a form each parser must read) give 100 on every benchmark."""

    def oracle(model, processor, items, *a, **k):
        for item in items:
            if item.kind == "choice":
                yield item, f"The answer is ({item.answer})."
            elif item.kind == "yesno":
                yield item, item.answer.capitalize() + "."
            else:
                yield item, item.answer

    monkeypatch.setattr(inference, "answer_items", oracle)
    ret, stdout = run_quiet(args(tiny[0], data.dir, tmp_path / "oracle"))
    assert {k: v["score"] for k, v in ret["results"].items()} == {name: 100.0 for name in NAMES}
    assert ret["results"]["mmvp"]["pair_accuracy"] == 100.0
    assert "| oracle | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 | 100.00 |" in stdout


# ----------------------------------------------------------------------------- resume


def test_interrupted_run_resumes_to_the_same_predictions(full_run, data, tmp_path, monkeypatch, capsys):
    out = tmp_path / "resumed"
    argv = args(full_run.model, data.dir, out, "--benchmarks", "hrbench4k", "--progress")
    real = inference.answer_items
    asked: list[str] = []

    def interrupted(model, processor, items, *a, **k):
        for n, pair in enumerate(real(model, processor, items, *a, **k)):
            yield pair
            if n + 1 == BATCH:  # stop after the first batch, like a Ctrl-C
                raise KeyboardInterrupt

    def recording(model, processor, items, *a, **k):
        items = list(items)
        asked.extend(i.index for i in items)
        return real(model, processor, items, *a, **k)

    monkeypatch.setattr(inference, "answer_items", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_quiet(argv)
    first = predictions(out / "hrbench4k")
    assert [r["index"] for r in first] == ["0", "1", "2", "3"]
    with open(out / "hrbench4k" / "predictions.jsonl", "a") as fh:
        fh.write('{"index": "4", "kind": "choice", "rep')  # a torn last line: killed mid-write

    monkeypatch.setattr(inference, "answer_items", recording)
    ret, _ = run_quiet(argv)
    assert asked == ["4", "5"]  # only the missing items, the torn one included
    rows = predictions(out / "hrbench4k")
    assert [r["index"] for r in rows] == [str(i) for i in range(6)]  # each index exactly once
    assert rows == predictions(full_run.out / "hrbench4k")  # greedy: same as the uninterrupted run
    assert ret["results"]["hrbench4k"]["score"] == results(full_run.out)["hrbench4k"]["score"]
    assert "hrbench4k" in capsys.readouterr().err  # the progress bar

    asked.clear()
    run_quiet(argv)  # nothing left: nothing generated, same file
    assert asked == [] and predictions(out / "hrbench4k") == rows

    with pytest.raises(UserError, match="max_new_tokens"):  # other settings never mix into the file
        run_quiet(argv + ["--max-new-tokens", "7"])


def test_limit_and_rescoring_need_no_generation(full_run, data, tmp_path, monkeypatch):
    out = copy_run(full_run.out, tmp_path / "limited", ["vstar"])
    monkeypatch.setattr(inference, "answer_items", NoGeneration())
    ret, _ = run_quiet(args(full_run.model, data.dir, out, "--benchmarks", "vstar", "--limit", "2"))
    assert ret["results"]["vstar"]["n"] == 2
    scored = [json.loads(x) for x in (out / "vstar" / "scored.jsonl").read_text().splitlines()]
    assert [r["index"] for r in scored] == ["0", "1"]


def test_read_jsonl_drops_a_torn_tail_and_names_a_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"index": "a"}\n{"index": "b"}\n{"index": "c", "re')
    assert [r["index"] for r in evaluate.read_jsonl(path)] == ["a", "b"]
    assert path.read_text().endswith('"re')  # untouched without repair
    assert [r["index"] for r in evaluate.read_jsonl(path, repair=True)] == ["a", "b"]
    assert path.read_text() == '{"index": "a"}\n{"index": "b"}\n'
    path.write_text('{"index": "a"}\n{"index": "b"}')  # valid JSON but no newline: torn as well
    assert [r["index"] for r in evaluate.read_jsonl(path, repair=True)] == ["a"]
    path.write_text('{"index": "a"}\nnot json\n{"index": "c"}\n')
    with pytest.raises(ValueError, match="line 2"):
        evaluate.read_jsonl(path)


# ----------------------------------------------------------------------------- generation settings


def test_greedy_is_batch_invariant_and_ignores_checkpoint_sampling_defaults(tiny, data, float64_model):
    from opd.eval.benchmarks import load_benchmark
    from opd.models.loading import load_model, load_processor

    # float64 (tests/float64.py): a padded batch's logits then agree with one prompt's to ~1e-16 relative, so equal
    # greedy replies test the masking, not whether float32 rounding happened to keep a near-tie's order
    model, processor = load_model(str(tiny[0]), "float64"), load_processor(str(tiny[0]))
    items = load_benchmark("zoombench", data.dir)
    base = [r for _, r in inference.answer_items(model, processor, items, BATCH, MAX_NEW)]
    # left padding is masked: a prompt gets the same greedy reply alone as in a padded batch
    assert [r for _, r in inference.answer_items(model, processor, items, 1, MAX_NEW)] == base
    used = sorted({t for r in base for t in processor.tokenizer(r, add_special_tokens=False).input_ids})
    assert used
    # "Shipped" defaults that would change greedy replies if they leaked: every token of the replies banned.
    shipped = GenerationConfig(do_sample=True, temperature=50.0, top_k=0, bad_words_ids=[[t] for t in used],
                               eos_token_id=model.generation_config.eos_token_id,
                               pad_token_id=model.generation_config.pad_token_id)
    model.generation_config = shipped
    again = [r for _, r in inference.answer_items(model, processor, items, BATCH, MAX_NEW)]
    assert again == base
    assert model.generation_config is shipped and not model.training
    think = processor.decode(inference.encode_item(processor, items[0], enable_thinking=False).input_ids)
    assert think.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    plain = processor.decode(inference.encode_item(processor, items[0], enable_thinking=True).input_ids)
    assert plain.endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- judge


class FakeJudgeServer(LocalServer):
    """An OpenAI-compatible /v1/chat/completions on 127.0.0.1: "correct", or "incorrect" for model "strict"."""

    MAX_REQUESTS = 20

    def __init__(self):
        self.requests: list[dict] = []
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append({"path": self.path, "headers": dict(self.headers), "body": body})
                if len(owner.requests) > owner.MAX_REQUESTS:
                    self.send_error(503, "too many requests in a test")
                    return
                verdict = "incorrect" if body.get("model") == "strict" else "Correct."
                send_json(self, {"choices": [{"message": {"role": "assistant", "content": verdict}}]})

        super().__init__(Handler)


def test_judge_scores_free_form_answers_and_caches_verdicts(full_run, data, tmp_path, monkeypatch):
    out = copy_run(full_run.out, tmp_path / "judged", ["zoombench"])
    monkeypatch.setattr(inference, "answer_items", NoGeneration())  # rescoring only
    monkeypatch.setenv("JUDGE_API_KEY", "test-key")
    base = results(full_run.out)["zoombench"]
    open_rows = [r for r in predictions(out / "zoombench") if r["kind"] == "open"]
    assert [r["index"] for r in open_rows] == ["zb2"] and not open_rows[0]["correct"]
    with FakeJudgeServer() as server:
        argv = args(full_run.model, data.dir, out, "--benchmarks", "zoombench", "--judge-url", server.url,
                    "--judge-model", "lenient", "--judge-timeout", "5")
        ret, _ = run_quiet(argv)
        assert len(server.requests) == 1  # one open answer that does not match exactly
        req = server.requests[0]
        assert req["path"] == "/v1/chat/completions" and req["headers"]["Authorization"] == "Bearer test-key"
        assert req["body"]["model"] == "lenient" and req["body"]["temperature"] == 0
        prompt = req["body"]["messages"][-1]["content"]
        assert "Reference answer: Exit" in prompt and f"Model answer: {open_rows[0]['reply']}" in prompt
        zb = ret["results"]["zoombench"]
        assert zb["per_kind"]["open"] == 100.0 and base["per_kind"]["open"] == 0.0
        assert zb["judged"]["correct"] == 1
        assert zb["score"] == pytest.approx(base["score"] + 100.0 / len(ZOOMBENCH_ANSWERS))
        cache = evaluate.read_jsonl(out / "judge_cache.jsonl")
        assert [(c["verdict"], c["gold"]) for c in cache] == [("correct", "Exit")]

        again, _ = run_quiet(argv)  # every verdict cached: no request
        assert len(server.requests) == 1 and again["results"]["zoombench"] == zb

        strict, _ = run_quiet([a if a != "lenient" else "strict" for a in argv])  # another judge model: asked
        assert len(server.requests) == 2 and strict["results"]["zoombench"]["per_kind"]["open"] == 0.0


def test_judge_endpoint_parsing_and_errors(tmp_path):
    assert endpoint("http://h:8000") == "http://h:8000/v1/chat/completions"
    assert endpoint("http://h:8000/v1/") == "http://h:8000/v1/chat/completions"
    assert endpoint("https://h/x/v1/chat/completions") == "https://h/x/v1/chat/completions"
    with pytest.raises(ValueError, match="http"):
        endpoint("h:8000")
    assert [parse_verdict(t) for t in ("Correct.", "incorrect", "It is not correct", "maybe")] == [
        "correct", "incorrect", "incorrect", "unparsed"]
    assert cache_key("q", "g", "r", "m1") != cache_key("q", "g", "r", "m2")

    class Refusing(FakeJudgeServer):
        MAX_REQUESTS = 0  # every request answered 503

    with Refusing() as server:
        judge = Judge(server.url, "m", tmp_path / "cache.jsonl", timeout=5, retries=2, backoff=0.0)
        with pytest.raises(JudgeError, match="HTTP 503"):
            judge.verdict("q", "g", "r")
        assert judge.requests == 2 and len(server.requests) == 2
        assert evaluate.read_jsonl(tmp_path / "cache.jsonl") == []  # a failure is never cached


# ----------------------------------------------------------------------------- compare and errors


def test_compare_prints_runs_side_by_side_with_deltas(full_run, tmp_path, capsys):
    base = results(full_run.out)
    other = {k: dict(v, score=v["score"] + 10.0) if k == "vstar" else v for k, v in base.items()}
    write_results(tmp_path / "better" / "results.json", other, {"label": "better"})
    ret = eval_py.main(["--compare", str(full_run.out), str(tmp_path / "better")])
    printed = capsys.readouterr().out
    assert printed == ret["compare"]
    assert "| tiny-full |" in printed and "| better |" in printed and "Delta vs tiny-full" in printed
    delta_row = next(line for line in printed.splitlines() if line.startswith("| better |") and "+" in line)
    assert delta_row.split("|")[2].strip() == "+10.00"


def test_the_default_label_of_an_eval_folder_in_a_run_is_the_runs_name(full_run, data, tmp_path, monkeypatch, capsys):
    """--out runs/paper-4b/eval (the docs' layout): the row is paper-4b in results.json, results.md and --compare,
    not 'eval'; --label still wins. Rescoring a copied folder: nothing is generated."""
    monkeypatch.setattr(inference, "answer_items", NoGeneration())
    out = copy_run(full_run.out, tmp_path / "runs" / "paper-4b" / "eval", ["vstar"])
    ret, _ = run_quiet(args(full_run.model, data.dir, out, "--benchmarks", "vstar"))
    assert (ret["meta"]["label"], ret["meta"]["label_from"]) == ("paper-4b", "folder")
    assert "| paper-4b |" in (out / "results.md").read_text()
    other = copy_run(full_run.out, tmp_path / "runs" / "base" / "eval", ["vstar"])
    run_quiet(args(full_run.model, data.dir, other, "--benchmarks", "vstar", "--label", "Qwen3.5-4B"))
    text = eval_py.main(["--compare", str(other), str(out)])["compare"]
    assert "| Qwen3.5-4B |" in text and "| paper-4b |" in text and "| eval |" not in text
    capsys.readouterr()


def test_unknown_benchmark_lists_the_known_ones(tmp_path):
    with pytest.raises(UserError) as exc:
        eval_py.main(["--model", "tiny", "--benchmarks", "vstar,imagenet", "--data-dir", str(tmp_path)])
    assert "'imagenet'" in str(exc.value) and "known: " + ", ".join(NAMES) in str(exc.value)


def test_missing_or_malformed_data_names_benchmark_file_and_field(tiny, tmp_path):
    write_vstar_fixture(tmp_path)
    with pytest.raises(UserError, match=r"1 of 2 benchmarks have no files .*\n  mmvp: expected .*Questions.csv"):
        eval_py.main(args(tiny[0], tmp_path, tmp_path / "out", "--benchmarks", "vstar,mmvp"))
    path = tmp_path / "vstar" / "test_questions.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    del rows[1]["label"]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UserError) as exc:
        eval_py.main(args(tiny[0], tmp_path, tmp_path / "out", "--benchmarks", "vstar"))
    assert "benchmark 'vstar'" in str(exc.value) and "test_questions.jsonl line 2" in str(exc.value)
    assert "'label'" in str(exc.value)
    write_zoombench_fixture(tmp_path)
    image = tmp_path / "zoombench" / "images" / "zb1.jpg"
    image.write_bytes(image.read_bytes()[:50])  # the header reads, the pixels do not: found while answering
    with pytest.raises(UserError) as exc:
        eval_py.main(args(tiny[0], tmp_path, tmp_path / "out", "--benchmarks", "zoombench"))
    assert "benchmark 'zoombench'" in str(exc.value) and "zb1.jpg" in str(exc.value)
    assert "cannot decode image" in str(exc.value)
    with pytest.raises(UserError, match="--model is required"):
        eval_py.main(["--data-dir", str(tmp_path)])


def test_all_missing_benchmarks_named_up_front_with_the_command_for_the_present_ones(tmp_path):
    write_vstar_fixture(tmp_path)
    write_zoombench_fixture(tmp_path)
    (tmp_path / "mmvp").mkdir()  # a folder without its files counts as missing too
    with pytest.raises(UserError) as exc:
        eval_py.main(["--model", "tiny", "--data-dir", str(tmp_path)])  # the default: all seven
    lines = str(exc.value).splitlines()
    assert lines[0].startswith(f"5 of 7 benchmarks have no files under {tmp_path}")
    missing = [line.split(":")[0].strip() for line in lines[1:-1]]
    assert missing == ["hrbench4k", "mmvp", "cvbench", "mmstar", "pope"]
    assert "mmvp: expected " + str(tmp_path / "mmvp") + "/ with Questions.csv" in lines[2]
    assert lines[-1] == "present: vstar, zoombench; to run only those: --benchmarks vstar,zoombench"


# ----------------------------------------------------------------------------- the model's identity


def test_a_new_checkpoint_at_the_same_path_is_not_reported_with_the_old_replies(data, tmp_path):
    """Retrain into the same run folder, evaluate into the old --out: refused, or answered anew with --overwrite."""
    from opd.tiny import build_tiny_model

    first, second = build_tiny_model(tmp_path / "a", seed=1), build_tiny_model(tmp_path / "b", seed=2)
    ckpt = tmp_path / "run" / "policy"
    shutil.copytree(first, ckpt)
    out = tmp_path / "eval"
    argv = args(ckpt, data.dir, out, "--benchmarks", "hrbench4k")
    run_quiet(argv)
    old = predictions(out / "hrbench4k")
    shutil.rmtree(ckpt)
    shutil.copytree(second, ckpt)  # the new weights, same path, same file names and sizes
    with pytest.raises(UserError, match=r"other settings .*model: 'sha256:.*--overwrite to delete them"):
        run_quiet(argv)
    assert predictions(out / "hrbench4k") == old  # untouched

    run_quiet(args(second, data.dir, tmp_path / "fresh", "--benchmarks", "hrbench4k"))
    new, _ = run_quiet(argv + ["--overwrite"])
    assert predictions(out / "hrbench4k") == predictions(tmp_path / "fresh" / "hrbench4k")
    assert [r["reply"] for r in old] != [r["reply"] for r in predictions(out / "hrbench4k")]
    assert new["results"]["hrbench4k"] == results(tmp_path / "fresh")["hrbench4k"]
    settings = json.loads((out / "hrbench4k" / "settings.json").read_text())
    assert settings["model_path"] == str(ckpt.resolve()) and settings["model"].startswith("sha256:")

    shutil.rmtree(tmp_path / "run")
    shutil.copytree(second, tmp_path / "moved")  # the same weights elsewhere: the same model, resumed
    again, _ = run_quiet(args(tmp_path / "moved", data.dir, out, "--benchmarks", "hrbench4k"))
    assert again["results"] == new["results"]


def test_a_failed_start_writes_nothing(tiny, data, tmp_path):
    out = tmp_path / "out"
    with pytest.raises(UserError, match="no such model folder: " + str(tmp_path / "typo")):
        run_quiet(args(tmp_path / "typo", data.dir, out, "--benchmarks", "vstar"))
    broken = tmp_path / "broken"
    shutil.copytree(tiny[0], broken)
    (broken / "model.safetensors").write_bytes(b"\0" * 64)  # weights that do not load
    with pytest.raises(Exception):
        run_quiet(args(broken, data.dir, out, "--benchmarks", "vstar"))
    assert not out.exists()  # no settings.json, no digest cache: the folder is not poisoned


def test_model_digests_are_cached_and_follow_the_content(tiny, tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny[0], folder)
    digests = evaluate.DigestCache(tmp_path / "out" / "model_digests.json")
    key = evaluate.model_identity(str(folder), digests)["model"]
    assert not (tmp_path / "out").exists()  # nothing written before save()
    digests.save()
    hashed: list[str] = []
    import opd.models.identity

    real = opd.models.identity.file_sha256
    monkeypatch.setattr(opd.models.identity, "file_sha256", lambda p: hashed.append(Path(p).name) or real(p))
    cached = evaluate.DigestCache(tmp_path / "out" / "model_digests.json")
    assert evaluate.model_identity(str(folder), cached)["model"] == key and hashed == []  # no file re-read
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the weights, same size
    weights.write_bytes(bytes(data))
    assert evaluate.model_identity(str(folder), cached)["model"] != key and hashed == ["model.safetensors"]


def test_a_hub_snapshot_is_identified_by_repo_and_commit(tmp_path):
    snap = tmp_path / "hub" / "models--Qwen--Qwen3.5-4B" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    ident = evaluate.model_identity(str(snap), evaluate.DigestCache(tmp_path / "d.json"))
    assert ident == {"model": "hf:Qwen/Qwen3.5-4B", "model_revision": "0123abcd", "model_path": str(snap)}
    old = {**ident, "model_revision": None}  # first run: downloaded by from_pretrained, commit unknown then
    assert evaluate.settings_diff(old, ident) == []
    assert evaluate.settings_diff({**ident, "model_revision": "ffff"}, ident) == [
        "model_revision: 'ffff' there, '0123abcd' now"]


# ----------------------------------------------------------------------------- the command line


def run_eval_py(*argv) -> subprocess.CompletedProcess:
    root = Path(eval_py.__file__).parent
    return subprocess.run([sys.executable, str(root / "eval.py"), *map(str, argv)], cwd=root,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_user_errors_are_one_line_with_exit_code_2(tiny, tmp_path):
    write_vstar_fixture(tmp_path)
    path = tmp_path / "vstar" / "test_questions.jsonl"
    path.write_text(path.read_text() + "{not json\n")
    cases = {
        "bad data line": args(tiny[0], tmp_path, tmp_path / "out", "--benchmarks", "vstar"),
        "compare": ["--compare", tmp_path / "nowhere"],
        "flag": ["--batch-size", "many"],
        "model": args(tmp_path / "typo", tmp_path, tmp_path / "out", "--benchmarks", "vstar"),
        "non-UTF-8 line": args(tiny[0], tmp_path / "latin1", tmp_path / "out", "--benchmarks", "vstar"),
        "out is a file": args(tiny[0], tmp_path, tmp_path / "a-file", "--benchmarks", "vstar"),
        "flag typo": ["--modle", tiny[0]],
    }
    expected = {"bad data line": "test_questions.jsonl line", "compare": "nowhere", "flag": "--batch-size",
                "model": "no such model folder", "non-UTF-8 line": "line 2: not UTF-8 text (byte 0xe9",
                "out is a file": "a-file: is a file", "flag typo": "unknown flag --modle; did you mean --model?"}
    write_vstar_fixture(tmp_path / "latin1")
    latin1 = tmp_path / "latin1" / "vstar" / "test_questions.jsonl"
    lines = latin1.read_bytes().split(b"\n")
    latin1.write_bytes(b"\n".join([lines[0], lines[1].replace(b"?", "\u00e9?".encode("latin-1"), 1), *lines[2:]]))
    (tmp_path / "a-file").write_text("not a folder")
    for case, argv in cases.items():
        proc = run_eval_py(*argv)
        assert proc.returncode == 2, (case, proc.stderr)
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("eval.py: error: "), (case, proc.stderr)
        assert expected[case] in lines[0], (case, lines[0])
    assert not (tmp_path / "out").exists()
    missing = run_eval_py("--model", "tiny", "--data-dir", tmp_path)  # all seven; six missing: a line each
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert missing.stderr.count("\n") == 8 and "--benchmarks vstar" in missing.stderr


def test_an_incomplete_sharded_checkpoint_is_named_as_such(tmp_path):
    """A --fsdp checkpoint without policy/ is exported first (tests/test_export.py); one whose sharded/ lacks DCP's
    .metadata (a write that never finished) is refused in one line, not as a missing folder."""
    from opd.cli import UserError
    from opd.eval.run import resolve_model

    ckpt = tmp_path / "run" / "checkpoint-000004"
    (ckpt / "sharded").mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(b"")
    with pytest.raises(UserError, match="sharded has no .metadata: an incomplete --fsdp checkpoint"):
        resolve_model(str(ckpt))
