"""eval.py's settings: `EvalConfig`, one flag per field (its docstring the flag's help), and its presets."""

from __future__ import annotations

from dataclasses import dataclass

from opd.eval.benchmarks import LOADERS

ALL_BENCHMARKS = ",".join(LOADERS)  # Table 1 order


@dataclass
class EvalConfig:
    preset: str = "default"
    """Starting values (only 'default'; flags set everything)."""
    model: str | None = None
    """HF image-text-to-text checkpoint (folder or hub id), a train.py run or checkpoint folder (its policy/;
    a sharded --fsdp checkpoint is exported there first), or a built-in name: 'toy' (the toy world's base, untrained
    by OPD: train.py's default starts from it) or 'tiny' (a random-weight tiny model). With
    --backend openai optional: it identifies the served weights (the resume key: its files' digest, taken on
    trust: the server's weights are not compared with them) and gives the vision and end-of-sequence token ids
    (a LoRA run's adapter: its base's). Without it the key is the served name, which cannot tell two weights
    apart: such a folder is not resumed (--overwrite or a new --out)."""
    backend: str = "hf"
    """Who answers: hf (Hugging Face generate in this process), openai (an OpenAI-compatible server at
    --base-url: vLLM, SGLang, transformers serve, ...) or vllm (a vLLM server for --model from the vLLM venv,
    scripts/install_vllm.sh, or the one at --vllm-url)."""
    base_url: str | None = None
    """--backend openai: the server's base URL, e.g. http://127.0.0.1:8000/v1 (it must answer /v1/models
    within 5 s)."""
    served_model: str | None = None
    """--backend openai: the model name sent to the server (default: the first one its /v1/models lists)."""
    api_key_env: str = "EVAL_API_KEY"
    """--backend openai: environment variable holding the server's API key (sent as a Bearer token when set)."""
    request_timeout: float = 600.0
    """--backend openai / vllm: seconds to wait for one reply."""
    vllm_url: str | None = None
    """--backend vllm: a vLLM server already running on --model (started with opd.engine.server_command's
    flags) instead of starting one; it must answer /health within 5 s. Its prompts are checked token for token
    against --model's processor, its weights are not: the resume key is --model's files' digest, taken on trust."""
    benchmarks: str = ALL_BENCHMARKS
    """Comma-separated benchmarks: vstar, zoombench, hrbench4k, mmvp, cvbench, mmstar, pope."""
    data_dir: str | None = None
    """Folder holding one sub-folder per benchmark, as shipped (docs/EVAL.md lists the files), or 'toy': the toy
    world's held-out items (built on first use; --benchmarks then defaults to zoombench, whose slot they fill, and
    --view to crop: both views)."""
    out: str = "runs/eval"
    """Output folder: <benchmark>/predictions.jsonl, results.json, results.md, judge_cache.jsonl."""
    view: str = "full"
    """'full' (the paper's protocol) or 'crop': also answer from the crop images (ZoomBench) as <name>@crop
    and report the crop-minus-full gap."""
    batch_size: int = 8
    """Prompts per generate() call (--backend openai / vllm: requests in flight)."""
    max_new_tokens: int = 0
    """Most new tokens per answer; 0 = 64 without thinking (a letter, yes/no or a short phrase), 1024 with
    --enable-thinking (the training response length)."""
    enable_thinking: bool = False
    """Qwen3.5's thinking generation prompt instead of the non-thinking one."""
    dtype: str = "auto"
    """Weight dtype: auto (bfloat16 on CUDA, float32 on CPU), float32, bfloat16, float16, or float64 (--backend
    hf only: replies that do not depend on how items are batched, for tests)."""
    device: str = "auto"
    """Device: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ..."""
    max_prompt_len: int = 0
    """Refuse prompts longer than this many tokens (image tokens included); 0 = no limit."""
    limit: int = 0
    """Answer only the first N items of each benchmark (quick runs); 0 = all."""
    seed: int = 42
    """Seed of python, numpy and torch (greedy decoding does not draw; kept as in the paper)."""
    judge_url: str | None = None
    """OpenAI-compatible endpoint (e.g. http://127.0.0.1:8000/v1) judging free-form answers; none: normalised
    exact match."""
    judge_model: str | None = None
    """Model name sent to the judge endpoint."""
    judge_key_env: str = "JUDGE_API_KEY"
    """Environment variable holding the judge's API key (sent as a Bearer token when set)."""
    judge_timeout: float = 60.0
    """Seconds to wait for one judge reply."""
    label: str | None = None
    """Row label of this run in the tables (default: the --out folder's name, or its parent's when that name is
    generic, e.g. runs/paper-4b/eval -> paper-4b: opd.eval.report.default_label)."""
    overwrite: bool = False
    """Answer the named benchmarks again from scratch: their stored predictions in --out are deleted
    (once the model has loaded). Without it, a folder holding another model's predictions is refused."""
    progress: bool = True
    """Show a progress bar per benchmark."""


PRESETS: dict[str, dict] = {"default": {}}
