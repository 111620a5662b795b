"""eval.py --backend openai / vllm (opd.eval.backends) against real servers, and their one-line errors.

* openai: `transformers serve` (transformers' own OpenAI-compatible server, `pip install -r
  requirements-serve.txt`; skipped with the reason when it is not importable) serving the tiny model on
  127.0.0.1: its greedy replies equal the in-process HF backend's on every item of every benchmark, the crop
  view included, and its prompts have the same token counts.
* vllm: one vLLM server per session (tests/vllm_fixtures.py, skipped when the vLLM venv is not built) on the
  vLLM-shaped tiny model; eval.py --backend vllm --vllm-url gives HF greedy's parsed answers (and replies) on
  every item whose greedy tokens agree (bf16 engine vs float32 HF part at near-ties).
"""

import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from bench_fixtures import write_all_fixtures

import eval as eval_py
from opd.cli import UserError
from opd.eval.backends import OpenAIBackend, api_base, chat_messages, server_kind

ROOT = Path(__file__).resolve().parents[1]
KEYS = ["vstar", "zoombench", "zoombench@crop", "hrbench4k", "mmvp", "cvbench", "mmstar", "pope"]
MAX_NEW = 8


def say(msg: str) -> None:
    sys.__stdout__.write(f"\n[backends] {msg}\n")


def argv(data_dir, out, *extra) -> list[str]:
    return ["--data-dir", str(data_dir), "--out", str(out), "--batch-size", "4", "--max-new-tokens", str(MAX_NEW),
            "--no-progress", "--view", "crop", *map(str, extra)]


def run_quiet(args) -> dict:
    with contextlib.redirect_stdout(io.StringIO()):
        return eval_py.main(args)


def rows(folder: Path) -> dict[str, dict]:
    lines = (folder / "predictions.jsonl").read_text(encoding="utf-8").splitlines()
    return {r["index"]: r for r in map(json.loads, lines)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("benchdata")
    return SimpleNamespace(dir=root, golds=write_all_fixtures(root))


# ----------------------------------------------------------------------------- openai: transformers serve

SERVE = "import sys; from transformers.cli.transformers import main; sys.argv[0] = 'transformers'; sys.exit(main())"


@pytest.fixture(scope="module")
def transformers_serve(tiny, tmp_path_factory):
    """`transformers serve <tiny model> --host 127.0.0.1 --port P --device cpu`, stopped by its PID at the end."""
    from transformers.utils.import_utils import is_serve_available

    if not is_serve_available():
        reason = "transformers serve is not importable (pip install -r requirements-serve.txt)"
        say(f"skipped: {reason}")
        pytest.skip(reason)
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-c", SERVE, "serve", str(tiny[0]), "--host", "127.0.0.1", "--port", str(port),
           "--device", "cpu"]  # fmt: skip
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    try:
        while True:
            assert proc.poll() is None, log.read_text()[-2000:]
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.perf_counter() - t0 < 180, "transformers serve not healthy after 180 s: " + log.read_text()[-2000:]
            time.sleep(0.5)
        say(f"transformers serve pid {proc.pid} at {url}, healthy in {time.perf_counter() - t0:.1f} s")
        yield SimpleNamespace(url=url + "/v1", model=str(tiny[0]), log=log)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


@pytest.fixture(scope="module")
def hf_run(tiny, data, tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "eval"
    return SimpleNamespace(out=out, ret=run_quiet(["--model", str(tiny[0]), "--device", "cpu", *argv(data.dir, out)]))


@pytest.mark.slow
def test_openai_backend_on_transformers_serve_equals_local_greedy(transformers_serve, hf_run, tiny, data, tmp_path):
    out = tmp_path / "openai"
    t0 = time.perf_counter()
    ret = run_quiet(["--backend", "openai", "--base-url", transformers_serve.url, "--model", str(tiny[0]),
                     *argv(data.dir, out)])
    say(f"--backend openai on transformers serve: {ret['meta']['requests']} requests in {time.perf_counter() - t0:.1f} s")
    assert ret["meta"]["server_kind"] == "transformers" and ret["meta"]["served_model"] == transformers_serve.model
    replies = 0
    for key in KEYS:
        local, served = rows(hf_run.out / key), rows(out / key)
        assert local.keys() == served.keys(), key
        for index, row in local.items():
            assert served[index]["reply"] == row["reply"], (key, index, served[index]["reply"], row["reply"])
            assert served[index]["pred"] == row["pred"], (key, index)
            replies += bool(row["reply"])
        settings = json.loads((out / key / "settings.json").read_text())
        assert settings["backend"] == "openai" and settings["base_url"] == transformers_serve.url
    assert replies > 30  # non-empty replies: the comparison is not vacuous
    assert ret["results"] == hf_run.ret["results"]


@pytest.mark.slow
def test_the_server_renders_the_trainers_prompt(transformers_serve, tiny, data):
    """Per item, the server's prompt has the token count of eval.py's own encoding (image tokens included), and
    without the suppression of vision tokens nothing else in the request matters for this checkpoint."""
    from opd.eval.benchmarks import load_benchmark
    from opd.eval.inference import encode_item
    from opd.model import load_processor

    processor = load_processor(str(tiny[0]))
    backend = OpenAIBackend.connect(transformers_serve.url)
    assert backend.kind == "transformers" and backend.served_model == transformers_serve.model
    for name in ("vstar", "zoombench", "pope"):
        for item in load_benchmark(name, data.dir)[:2]:
            out = backend._post(backend.body(item, "full", 1, False), item)
            assert out["usage"]["prompt_tokens"] == len(encode_item(processor, item)), (name, item.index)
    with pytest.raises(UserError, match=r"--served-model 'other': .* serves '"):
        OpenAIBackend.connect(transformers_serve.url, "other")


# ----------------------------------------------------------------------------- vllm


@pytest.fixture(scope="module")
def vllm_engine(tmp_path_factory):
    from vllm_fixtures import start_engine

    yield from start_engine(tmp_path_factory)


@pytest.mark.slow
def test_vllm_backend_gives_hf_greedys_answers_where_the_tokens_agree(vllm_engine, data, tmp_path):
    from vllm_fixtures import hf, hf_greedy_ids

    from opd.engine import generate_greedy_ids
    from opd.eval.benchmarks import load_benchmark
    from opd.eval.inference import encode_item, item_image

    model_dir = vllm_engine.model_a
    hf_out, vllm_out = tmp_path / "hf", tmp_path / "vllm"
    t0 = time.perf_counter()
    served = run_quiet(["--backend", "vllm", "--vllm-url", vllm_engine.server.url, "--model", str(model_dir),
                        *argv(data.dir, vllm_out)])
    seconds = time.perf_counter() - t0
    run_quiet(["--model", str(model_dir), "--device", "cpu", *argv(data.dir, hf_out)])
    model, processor, ids = hf(model_dir)
    agree = total = 0
    for key in KEYS:
        name, view = key.split("@")[0], "crop" if key.endswith("@crop") else "full"
        items = [i for i in load_benchmark(name, data.dir) if view == "full" or i.crop is not None]
        prompts = [encode_item(processor, i, view) for i in items]
        engine = generate_greedy_ids(vllm_engine.server, prompts, [[item_image(i, view)] for i in items], MAX_NEW,
                                     **ids)
        local = hf_greedy_ids(model, prompts, MAX_NEW, ids)
        a, b = rows(hf_out / key), rows(vllm_out / key)
        assert a.keys() == b.keys() == {i.index for i in items}
        for item, e, h in zip(items, engine, local):
            total += 1
            if e == h:
                agree += 1
                assert b[item.index]["reply"] == a[item.index]["reply"], (key, item.index)
                assert b[item.index]["pred"] == a[item.index]["pred"], (key, item.index)
    say(f"--backend vllm: {total} items in {seconds:.1f} s; greedy tokens equal to HF float32's on {agree}/{total}")
    assert agree >= total // 2
    settings = json.loads((vllm_out / "vstar" / "settings.json").read_text())
    assert settings["backend"] == "vllm" and settings["dtype"] == "bfloat16"
    assert served["meta"]["device"] == "server"


# ----------------------------------------------------------------------------- errors, without a server


def run_eval_py(*args, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "eval.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **(env or {})})


def assert_one_line(proc, expected: str) -> None:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("eval.py: error: "), proc.stderr
    assert expected in lines[0], lines[0]


def test_bad_backend_flags_are_one_line(tiny, tmp_path):
    from bench_fixtures import write_vstar_fixture

    write_vstar_fixture(tmp_path)
    out = tmp_path / "out"
    common = ["--data-dir", tmp_path, "--out", out, "--benchmarks", "vstar"]
    refused = socket.socket()  # bound, never listening: connections are refused at once
    refused.bind(("127.0.0.1", 0))
    silent = socket.socket()  # listening, never answering: the connect check times out
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        cases = {
            "unreachable": (["--backend", "openai", "--base-url", f"http://127.0.0.1:{refused.getsockname()[1]}/v1"],
                            "no OpenAI-compatible server answers GET"),
            "silent": (["--backend", "openai", "--base-url", f"http://127.0.0.1:{silent.getsockname()[1]}"],
                       "/v1/models within 5 s (timed out)"),
            "no url": (["--backend", "openai"], "--backend openai needs --base-url"),
            "unknown": (["--backend", "tgi", "--model", tiny[0]], "--backend 'tgi': choose hf, openai or vllm"),
            "url without openai": (["--model", tiny[0], "--base-url", "http://127.0.0.1:1/v1"],
                                   "--base-url is for --backend openai"),
            "not a url": (["--backend", "openai", "--base-url", "127.0.0.1:8000"], "expected an http:// or https://"),
        }
        for case, (flags, expected) in cases.items():
            t0 = time.perf_counter()
            proc = run_eval_py(*flags, *common)
            seconds = time.perf_counter() - t0
            assert_one_line(proc, expected)
            assert seconds < 30, (case, seconds)
            if case == "silent":
                say(f"a --base-url that never answers: refused after {seconds:.1f} s")
    finally:
        refused.close()
        silent.close()
    proc = run_eval_py("--backend", "vllm", "--model", tiny[0], *common,
                       env={"BAS_OPD_VLLM_VENV": str(tmp_path / "no-venv")})
    assert_one_line(proc, "scripts/install_vllm.sh")
    assert not out.exists()  # nothing written


def test_requests_are_greedy_and_neutral_for_each_server_kind(tiny, data):
    from opd.chat import user_message
    from opd.eval.backends import config_special_ids
    from opd.eval.benchmarks import load_benchmark, prompt_text

    assert api_base("http://h:8000") == api_base("http://h:8000/v1/") == "http://h:8000/v1"
    assert api_base("http://h:8000/v1/chat/completions") == "http://h:8000/v1"
    assert server_kind({"owned_by": "vllm"}) == "vllm" and server_kind({"owned_by": "sglang"}) == "sglang"
    assert server_kind({"owned_by": "local", "status": {"value": "loaded"}}) == "transformers"
    assert server_kind({"owned_by": "openai"}) == "openai"
    item = load_benchmark("zoombench", data.dir)[0]
    [message] = chat_messages(item)
    local = user_message(prompt_text(item), 1)[0]["content"]  # what eval.py's processor renders
    assert [p["type"] for p in message["content"]] == ["image_url" if p["type"] == "image" else p["type"] for p in local]
    assert message["content"][0]["image_url"]["url"].startswith("data:image/png;base64,")
    ids = config_special_ids(str(tiny[0]))
    bodies = {kind: OpenAIBackend("http://h/v1", "m", kind, ids).body(item, "crop", 5, True)
              for kind in ("transformers", "vllm", "openai")}
    for kind, body in bodies.items():
        assert body["temperature"] == 0.0 and body["top_p"] == 1.0 and body["max_tokens"] == 5
        assert body["chat_template_kwargs"] == {"enable_thinking": True} and body["frequency_penalty"] == 0.0
        assert body["logit_bias"] == {str(t): -100.0 for t in ids["vision"]}, kind
    generation = json.loads(bodies["transformers"]["generation_config"])
    assert generation == {"eos_token_id": ids["eos"], "pad_token_id": ids["pad"], "do_sample": False,
                          "max_new_tokens": 5, "suppress_tokens": ids["vision"]}
    assert bodies["vllm"]["repetition_penalty"] == 1.0 and "repetition_penalty" not in bodies["openai"]
    assert "generation_config" not in bodies["vllm"] and "generation_config" not in bodies["openai"]
