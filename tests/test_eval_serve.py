"""`python -m opd.eval.serve` (docs/EVAL.md, "Other toolkits"): the project's vLLM server for lmms-eval and VLMEvalKit,
under a model name, greedy clients' defaults, with the client commands it prints and the VLMEvalKit config it writes.
The server is tests/test_vllm.py's stand-in (a venv whose python serves /health); the toolkits are not run here."""

import json
from pathlib import Path

import pytest
from test_vllm import fake_venv

from opd.cli import UserError
from opd.eval import serve


def test_serve_starts_the_projects_server_under_a_name_and_prints_the_toolkits_commands(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("BAS_OPD_VLLM_VENV", str(fake_venv(tmp_path)))
    monkeypatch.setenv("FAKE_MODE", "serve")
    out = tmp_path / "toolkits"
    lines: list[str] = []
    server = serve.start(serve.parse_args(["--model", str(tiny[0]), "--port", "0", "--name", "paper-4b", "--out",
                                           str(out)]), say=lines.append)
    try:
        args = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode().split("\0")
        flag = lambda name: args[args.index(name) + 1]  # noqa: E731
        assert flag("--served-model-name") == "paper-4b" and flag("--generation-config") == "vllm"
        assert json.loads(flag("--default-chat-template-kwargs")) == {"enable_thinking": False}
        assert flag("--seed") == "42" and flag("--dtype") == "bfloat16"
        url = f"{server.url}/v1"
        assert f"serve: paper-4b at {url} (OpenAI-compatible chat completions); Ctrl-C stops it." in lines[2]
        lmms, vlmevalkit = lines[3].strip(), lines[4].strip()
        assert lmms.startswith(f"OPENAI_API_BASE={url} OPENAI_API_KEY=sk-local python -m lmms_eval --model "
                               "openai_compatible --model_args model_version=paper-4b,")
        assert "--tasks vstar_bench,hrbench4k,hrbench8k,mmerealworld,mmerealworld_cn" in lmms
        config_file = out / "vlmevalkit.json"
        assert vlmevalkit.startswith(f"python run.py --config {config_file} --work-dir {out / 'vlmevalkit'}")
        config = json.loads((out / "vlmevalkit.json").read_text())
        model = config["model"]["paper-4b"]
        assert model["api_base"] == f"{url}/chat/completions" and model["temperature"] == 0
        assert model["key"].startswith("sk-") and model["img_size"] == -1  # VLMEvalKit's key check; full-size images
        assert config["data"]["HRBench8K"] == {"class": "HRBenchDataset", "dataset": "HRBench8K"}
        assert config["data"]["MME-RealWorld-CN"] == {"class": "MMERealWorld", "dataset": "MME-RealWorld-CN"}
        assert (out / "vllm-server.log").is_file()
    finally:
        server.stop()


def test_serve_refuses_a_lora_adapter_and_a_missing_venv_in_one_line(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("BAS_OPD_VLLM_VENV", str(tmp_path / "no-venv"))
    with pytest.raises(UserError, match="scripts/install_vllm.sh"):
        serve.start(serve.parse_args(["--model", str(tiny[0])]))
    monkeypatch.setenv("BAS_OPD_VLLM_VENV", str(fake_venv(tmp_path)))
    adapter = tmp_path / "lora" / "policy"
    adapter.mkdir(parents=True)
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": str(tiny[0]), "r": 8}))
    with pytest.raises(UserError, match="a LoRA adapter"):
        serve.start(serve.parse_args(["--model", str(adapter)]))
