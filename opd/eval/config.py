"""Evaluation's settings, torch-free: eval.py's `EvalConfig`, one flag per field (its docstring the flag's help), and
its presets; train.py's live evaluation (`LiveEvalConfig`, run by `opd.eval.live`)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from opd.builtin import is_builtin
from opd.run_folder import RUN_EVAL
from opd.cli import Section, resumable
from opd.eval.benchmarks import FAMILY, LOADERS, PAPER, expected_files, has_files

ALL_BENCHMARKS = ",".join(PAPER)  # the paper's seven, Table 1 order
BACKENDS = ("hf", "openai", "vllm")  # --backend's choices (`opd.eval.backends`)


@dataclass
class EvalConfig:
    preset: str = "default"
    """Starting values: 'default' (the paper's seven benchmarks) or 'family' (the six of Vision-OPD's table: V*Bench,
    ZoomBench, HR-Bench 4K and 8K, MME-RealWorld EN and CN); flags override them."""
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
    """--backend vllm: a vLLM server already running on --model (started with opd.engine.vllm_server.server_command's
    flags) instead of starting one; it must answer /health within 5 s. Its prompts are checked token for token
    against --model's processor, its weights are not: the resume key is --model's files' digest, taken on trust."""
    benchmarks: str = ALL_BENCHMARKS
    """Comma-separated benchmarks: the paper's seven (Table 1), vstar, zoombench, hrbench4k, mmvp, cvbench, mmstar,
    pope, and the family's hrbench8k, mmerealworld, mmerealworld_cn (--preset family: its six)."""
    data_dir: str | None = None
    """Folder holding one sub-folder per benchmark, as shipped (docs/EVAL.md lists the files), or a built-in name:
    'toy' (the toy world's held-out items) or 'tiny' (16 items of the tiny model's task), built on first use;
    --benchmarks then defaults to zoombench, whose slot they fill, and --view to crop: both views."""
    out: str | None = None
    """Output folder: <benchmark>/predictions.jsonl, results.json, results.md, judge_cache.jsonl (default: one per
    model, `default_out`: a train.py run's RUN/eval (runs/default/eval), any other model's runs/eval/<its name>
    (runs/eval/toy))."""
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
    """Row label of this run in the tables (default: in the model's own --out folder, the model's name,
    `model_name`: runs/paper-4b -> paper-4b, Qwen/Qwen3.5-4B -> Qwen3.5-4B, toy -> toy; in any other --out, that
    folder's name, or its parent's when that name is generic: runs/paper-4b/eval -> paper-4b,
    opd.eval.report.default_label)."""
    overwrite: bool = False
    """Answer the named benchmarks again from scratch: their stored predictions in --out are deleted
    (once the model has loaded). Without it, a folder holding another model's predictions is refused."""
    progress: bool = True
    """Show a progress bar per benchmark."""


PRESETS: dict[str, dict] = {"default": {}, "family": {"benchmarks": ",".join(FAMILY)}}

OUT_ROOT = Path("runs/eval")
"""Where an evaluation of a model outside any train.py run writes without --out: OUT_ROOT/<its name> (`default_out`)."""


def _checkpoint(folder: Path) -> bool:
    """A train.py checkpoint folder (checkpoint-N/ with its state.pt)."""
    return (folder / "state.pt").is_file()


def _run(folder: Path) -> bool:
    """A train.py run folder (its `latest` or its ledger is there)."""
    return (folder / "latest").is_file() or (folder / "ledger.jsonl").is_file()


def _in_run(model: str) -> tuple[Path | None, str]:
    """(the train.py run folder `model` lies in, or None; the part below it: '' for the run itself,
    'checkpoint-000008' for a checkpoint or its policy/ export, 'checkpoint-000008-merged' for its merged/ export)."""
    path = Path(model).expanduser().resolve()
    suffix = ""
    if path.name in ("policy", "merged") and _checkpoint(path.parent):
        path, suffix = path.parent, ("-merged" if path.name == "merged" else "")
    if _checkpoint(path) and _run(path.parent):
        return path.parent, path.name + suffix
    return (path, "") if _run(path) and not suffix else (None, "")


def _folder_name(name: str) -> str:
    return re.sub(r"[^\w.+-]+", "-", name).strip("-.") or "model"


def model_name(model: str | None, served_model: str | None = None) -> str:
    """The model's own name, its row label: a built-in name itself ('toy', 'tiny'); a train.py run folder its name
    (runs/default -> default, runs/lora -> lora); one of its checkpoints the run's and the checkpoint's names
    (runs/lora/checkpoint-000008 -> lora-checkpoint-000008), its policy/ export the same and its merged/ export (a
    LoRA run's) with '-merged'; any other folder its name; a hub id the name after its organisation
    (Qwen/Qwen3.5-4B -> Qwen3.5-4B); none (--backend openai) the served name. Characters that do not belong in a
    folder name become '-'."""
    if model is None:
        return _folder_name(served_model or "served")
    if is_builtin(model, "model"):
        return model
    if not Path(model).expanduser().exists():  # a hub id
        return _folder_name(model.rstrip("/").split("/")[-1])
    run, below = _in_run(model)
    if run is not None:
        return _folder_name(f"{run.name}-{below}" if below else run.name)
    return _folder_name(Path(model).expanduser().resolve().name)


def default_out(model: str | None, served_model: str | None = None) -> str:
    """--out when none is given, one folder per model: a train.py run's evaluation beside its checkpoints (RUN/eval,
    RUN/eval-checkpoint-000008, RUN/eval-checkpoint-000008-merged), any other model's OUT_ROOT/<model_name>
    (runs/eval/toy, runs/eval/Qwen3.5-4B)."""
    if model is not None and not is_builtin(model, "model") and Path(model).expanduser().exists():
        run, below = _in_run(model)
        if run is not None:
            out = run / (f"{RUN_EVAL}-{below}" if below else RUN_EVAL)
            return str(out.relative_to(Path.cwd().resolve())) if out.is_relative_to(Path.cwd().resolve()) else str(out)
    return str(OUT_ROOT / model_name(model, served_model))


@dataclass
class LiveEvalConfig(Section):
    """train.py's --eval-* flags (a section of its TrainConfig: field f is flag --eval-f)."""

    every: int = resumable(0)
    """Score the policy on held benchmark items every N steps and at the last (opd/eval/live.py); 0 = never."""
    data: str | None = resumable(None)
    """The benchmark folder of --eval-every (eval.py's --data-dir: one sub-folder per benchmark), 'toy': the toy
    world's held-out items (zoombench, with crops; built on first use), or 'tiny': the tiny model's benchmark folder."""
    benchmarks: str = resumable("zoombench")
    """Benchmarks of --eval-every, comma-separated (eval.py's names)."""
    limit: int = resumable(100)
    """Items per benchmark of --eval-every (each benchmark's first; 0 = all)."""
    views: str = resumable("full")
    """Views of --eval-every: full, or full,crop (the crop view: the collapse warning sign)."""
    max_new_tokens: int = resumable(64)
    """Most new tokens per answer of --eval-every."""
    batch: int = resumable(8)
    """Prompts per generate() call of --eval-every."""
    before: bool = resumable(False)
    """With --eval-every: also score the policy before step 0 (the weights the run starts from), for a before/after
    comparison (the console and summary.md show both)."""

    PREFIX = "eval_"

    def names(self) -> list[str]:
        return [n.strip().lower() for n in self.benchmarks.split(",") if n.strip()]

    def view_list(self) -> list[str]:
        return [v.strip() for v in self.views.split(",") if v.strip()]

    def check(self) -> list[str]:
        """Problems with the flags, each naming its flag (the data folder is checked too)."""
        if not self.every:
            unused = [f for f, v in (("--eval-data", self.data), ("--eval-before", self.before)) if v]
            return [f"{' and '.join(unused)} has no effect without --eval-every N (evaluate every N steps): give "
                    f"--eval-every, or drop {' and '.join(unused)}"] if unused else []
        problems = []
        if self.every < 0:
            problems.append(f"--eval-every {self.every}: must be >= 0")
        if not self.data:
            return problems + ["--eval-every needs --eval-data (a folder with one sub-folder per benchmark, as eval.py's "
                               "--data-dir)"]
        unknown = [n for n in self.names() if n not in LOADERS]
        if unknown or not self.names():
            problems.append(f"--eval-benchmarks {self.benchmarks!r}: choose from {', '.join(LOADERS)}")
        elif not is_builtin(self.data, "bench") and not all(has_files(n, self.data) for n in self.names()):
            missing = [n for n in self.names() if not has_files(n, self.data)]
            problems.append(f"--eval-data {self.data}: no files for {', '.join(missing)} (expected "
                            f"{'; '.join(f'{n}/ with {expected_files(n)}' for n in missing)})")
        if not set(self.view_list()) <= {"full", "crop"} or "full" not in self.view_list():
            problems.append(f"--eval-views {self.views!r}: full, or full,crop")
        if self.limit < 0 or self.max_new_tokens < 1 or self.batch < 1:
            problems.append("--eval-limit must be >= 0, --eval-max-new-tokens and --eval-batch >= 1")
        return problems
