"""Serves a checkpoint for other evaluation toolkits: the project's vLLM server (`opd.engine.vllm_server.VLLMServer`,
from the vLLM venv of scripts/install_vllm.sh) on 127.0.0.1 under a model name, until Ctrl-C.

    .venv/bin/python -m opd.eval.serve --model runs/paper-4b --port 8000 --out runs/paper-4b/toolkits

--model is resolved as eval.py resolves it (a run folder's latest policy/, a sharded checkpoint exported first; a LoRA
adapter is refused: serve its merged/ export). Greedy clients get no sampling defaults from the checkpoint
(`--generation-config vllm`) and Qwen3.5's non-thinking prompt unless --thinking. It prints the OpenAI base URL and
the one-line lmms-eval and VLMEvalKit commands for the family's benchmarks, and writes OUT/vlmevalkit.json, the
VLMEvalKit config those commands name (docs/EVAL.md, "Other toolkits").
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transformers import AutoConfig

from opd.cli import UserError, run_cli
from opd.engine.vllm_server import VLLMServer, check_venv
from opd.eval.backends import refuse_adapter
from opd.eval.config import model_name
from opd.eval.run import resolve_model

LMMS_TASKS = "vstar_bench,hrbench4k,hrbench8k,mmerealworld,mmerealworld_cn"
VLMEVALKIT_DATA = ("VStarBench", "HRBench4K", "HRBench8K", "MME-RealWorld", "MME-RealWorld-CN")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m opd.eval.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a checkpoint folder, a train.py run or checkpoint folder")
    parser.add_argument("--port", type=int, default=8000, help="port on 127.0.0.1 (default: 8000)")
    parser.add_argument("--name", help="the served model name (default: the model's name, as eval.py labels it)")
    parser.add_argument("--out", help="folder for vllm-server.log, vlmevalkit.json and the toolkits' outputs (default: "
                        "runs/serve/NAME)")
    parser.add_argument("--dtype", default="bfloat16", help="the engine's dtype (default: bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="prompt + reply tokens (default: min(the model's max positions, 32768))")
    parser.add_argument("--thinking", action="store_true", help="Qwen3.5's thinking prompt by default")
    return parser.parse_args(argv)


def client_commands(url: str, name: str, config: Path, out: Path) -> list[str]:
    """The one-line lmms-eval and VLMEvalKit commands for the family's benchmarks against `url` (.../v1)."""
    return [
        f"OPENAI_API_BASE={url} OPENAI_API_KEY=sk-local python -m lmms_eval --model openai_compatible --model_args "
        f"model_version={name},max_retries=3,timeout=10 --tasks {LMMS_TASKS} --batch_size 16 --log_samples "
        f"--output_path {out / 'lmms-eval'}",
        f"python run.py --config {config} --work-dir {out / 'vlmevalkit'} --api-nproc 16 --judge exact_matching "
        "--reuse",
    ]


def vlmevalkit_config(url: str, name: str) -> dict:
    """VLMEvalKit's --config: its GPT4V client on this server (greedy, full-size images; its key check wants 'sk-')
    and the family's datasets."""
    model = {"class": "GPT4V", "model": name, "api_base": f"{url}/chat/completions", "key": "sk-local",
             "temperature": 0, "img_size": -1, "img_detail": "high", "max_tokens": 1024, "timeout": 600, "retry": 3}
    return {"model": {name: model}, "data": {d: {"class": _dataset_class(d), "dataset": d} for d in VLMEVALKIT_DATA}}


def _dataset_class(name: str) -> str:
    return {"VStarBench": "ImageMCQDataset", "HRBench4K": "HRBenchDataset", "HRBench8K": "HRBenchDataset"}.get(
        name, "MMERealWorld")


def start(args: argparse.Namespace, say=print):
    """The started server (a `VLLMServer`) and the files and lines `--model` is served with."""
    check_venv()
    model_dir = resolve_model(args.model)
    refuse_adapter(model_dir, "vllm")
    if not Path(model_dir).is_dir():
        raise UserError(f"--model {args.model}: not a local folder (a vLLM server starts from one)")
    name = args.name or model_name(args.model)
    out = Path(args.out or Path("runs") / "serve" / name)
    limit = args.max_model_len or min(int(getattr(AutoConfig.from_pretrained(model_dir).get_text_config(),
                                                  "max_position_embeddings", 4096)), 32768)
    extra = ("--served-model-name", name,
             "--default-chat-template-kwargs", json.dumps({"enable_thinking": bool(args.thinking)}))
    server = VLLMServer.start(model_dir, port=args.port, seed=42, dtype=args.dtype, max_model_len=limit,
                              log_path=out / "vllm-server.log", extra_args=extra,
                              say=lambda line: say(f"serve: {line}"))
    url = f"{server.url}/v1"
    config = out / "vlmevalkit.json"
    config.write_text(json.dumps(vlmevalkit_config(url, name), indent=2) + "\n", encoding="utf-8")
    say(f"serve: {name} at {url} (OpenAI-compatible chat completions); Ctrl-C stops it. Other toolkits "
        "(not run in CI; docs/EVAL.md):")
    for line in client_commands(url, name, config, out):
        say(f"  {line}")
    return server


def main(argv: list[str] | None = None) -> None:
    server = start(parse_args(argv))
    try:
        code = server.process.wait()
    finally:
        server.stop()
    raise UserError(f"the vLLM server exited with code {code} (log {server.log_path})")


if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "python -m opd.eval.serve")
