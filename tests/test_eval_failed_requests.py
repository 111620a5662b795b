"""A request that fails after its retries is never scored as an answer (issue 44: lmms-eval and VLMEvalKit have scored
"Failed to obtain answer via API." as a wrong answer): eval.py stops with one line, writes no prediction row for the
failed item, keeps the rows before it, and the same command continues. Through --backend vllm (a stand-in vLLM server
at --vllm-url) and --backend openai (a stand-in OpenAI-compatible server, as vLLM's own /v1 is)."""

import http.server
import json

import pytest
from bench_fixtures import write_vstar_fixture
from fake_http import LocalServer, send_json

from opd.cli import run_cli
from opd.eval import backends, cli

GOLD = {"0": "A", "1": "C", "2": "B", "3": "A"}  # bench_fixtures' V*Bench items


class FlakyServer(LocalServer):
    """A stand-in server: GET answers (vLLM's /health, the OpenAI /v1/models); every POST for the `fail`-th distinct
    prompt (0-based, in the order first seen) answers HTTP 500, the others `answer(prompt)`. `posts` counts the POSTs
    per distinct prompt, retries included."""

    def __init__(self, answer, key, fail: int | None = None):
        self.seen: list = []
        self.posts: list[int] = []
        self.fail = fail
        fake = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                send_json(self, {"object": "list", "data": [{"id": "served", "owned_by": "vllm"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                prompt = key(body)
                if prompt not in fake.seen:
                    fake.seen.append(prompt)
                    fake.posts.append(0)
                n = fake.seen.index(prompt)
                fake.posts[n] += 1
                if n == fake.fail:
                    data = json.dumps({"error": {"message": "Encoder cache miss"}}).encode()
                    self.send_response(500)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                send_json(self, answer(body))

        super().__init__(Handler)


def run(argv, capsys) -> tuple[int, list[str]]:
    """eval.py's command line in this process: (exit code, stderr lines)."""
    try:
        run_cli(cli.main, [str(a) for a in argv], "eval.py")
        code = 0
    except SystemExit as exc:
        code = exc.code
    return code, [line for line in capsys.readouterr().err.splitlines() if line.strip()]


def indices(out) -> list[str]:
    lines = (out / "vstar" / "predictions.jsonl").read_text().splitlines()
    return [json.loads(line)["index"] for line in lines]


def check_stop_and_continue(server, argv, out, capsys, expected_line: str):
    code, err = run(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("eval.py: error: "), err
    assert expected_line in err[0], err[0]
    assert server.posts == [1, 1, 3]  # items 0 and 1 once; item 2 three times (its retries), then the stop
    assert indices(out) == ["0", "1"]  # no row for the failed item (nor any after it), the rows before kept
    assert not (out / "results.json").exists()
    server.fail = None
    code, err = run(argv, capsys)
    assert code == 0 and err == []
    assert server.posts == [1, 1, 4, 1]  # the rerun asks only for items 2 and 3
    assert indices(out) == ["0", "1", "2", "3"]
    result = json.loads((out / "results.json").read_text())["benchmarks"]["vstar"]
    right = sum(gold == "A" for gold in GOLD.values())  # every reply is "A"
    assert result["score"] == pytest.approx(100 * right / 4) and result["n"] == 4


def test_vllm_backend_a_request_failing_after_its_retries_stops_the_run_without_a_row(tiny, tmp_path, monkeypatch,
                                                                                       capsys):
    from opd.engine import vllm_rollouts
    from opd.models.loading import load_processor

    write_vstar_fixture(tmp_path / "data")
    monkeypatch.setattr(backends, "RETRY_WAIT", 0.0)
    # the stand-in echoes the prompt ids it was sent: send the trainer's own (a real server expands each image-pad
    # token to the image's token count itself)
    monkeypatch.setattr(vllm_rollouts, "engine_prompt_ids", lambda ids, image_token_id: list(ids))
    letter = load_processor(str(tiny[0])).tokenizer("A", add_special_tokens=False)["input_ids"]
    answer = lambda body: {"prompt_token_ids": body["token_ids"], "choices": [{"token_ids": letter}]}  # noqa: E731
    out = tmp_path / "out"
    with FlakyServer(answer, key=lambda body: body["token_ids"], fail=2) as server:
        argv = ["--backend", "vllm", "--vllm-url", server.url.removesuffix("/v1"), "--model", tiny[0], "--data-dir",
                tmp_path / "data", "--benchmarks", "vstar", "--out", out, "--batch-size", "1", "--no-progress"]
        check_stop_and_continue(server, argv, out, capsys,
                                "/inference/v1/generate: HTTP 500: Encoder cache miss (after 3 tries); answering vstar "
                                "item(s) 2: none of them stored")


def test_openai_backend_a_request_failing_after_its_retries_stops_the_run_without_a_row(tiny, tmp_path, monkeypatch,
                                                                                         capsys):
    write_vstar_fixture(tmp_path / "data")
    monkeypatch.setattr(backends, "RETRY_WAIT", 0.0)
    answer = lambda body: {"choices": [{"message": {"role": "assistant", "content": "A"}}]}  # noqa: E731
    question = lambda body: json.dumps(body["messages"][0]["content"][-1])  # noqa: E731 (the text part)
    out = tmp_path / "out"
    with FlakyServer(answer, key=question, fail=2) as server:
        argv = ["--backend", "openai", "--base-url", server.url, "--model", tiny[0], "--data-dir", tmp_path / "data",
                "--benchmarks", "vstar", "--out", out, "--batch-size", "1", "--no-progress"]
        check_stop_and_continue(server, argv, out, capsys,
                                "failed for vstar item 2 after 3 tries: HTTP 500")
