"""eval.py's command line: its settings (`opd.eval.config.EvalConfig`, one flag per field), their checks, `main`.

    python eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --compare runs/base runs/paper-4b/eval

`main(argv)` is the whole command (eval.py is a thin wrapper around it, and code such as the toy studies'
experiments/harness/experiment.py calls it directly): it refuses impossible settings and missing benchmark files up
front (`check_config`, one line naming the flag), and runs the evaluation under the lock of --out
(`opd.eval.run.evaluate_locked`: `opd.eval.lock`, one run per folder; imported when it runs, as the run imports torch);
`--compare` prints stored runs side by side instead (`opd.eval.report.compare_runs`). A user error is a `UserError`;
`opd.cli.run_cli` prints it as one line.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from opd.builtin import builtin_path, is_builtin
from opd.cli import UserError, build_parser
from opd.eval.benchmarks import LOADERS, expected_files, has_files
from opd.eval.config import BACKENDS, PRESETS, EvalConfig, default_out
from opd.eval.report import compare_runs

DESCRIPTION = ("Evaluation on the paper's seven benchmarks (Table 1), or the family's six (--preset family), from "
               "their shipped local files.")

def parse_args(argv: list[str] | None) -> tuple[EvalConfig, list[str] | None]:
    """(config, runs to compare or None): the EvalConfig flags plus ``--compare RUN [RUN ...]``."""
    parser = build_parser(EvalConfig, PRESETS, DESCRIPTION)
    parser.add_argument("--compare", nargs="+", metavar="RUN",
                        help="Print these runs (folders or results.json files) side by side with deltas, then exit.")
    args = vars(parser.parse_args(argv))
    compare = args.pop("compare")
    preset = args.pop("preset")
    given = {k: v for k, v in args.items() if v is not None}
    if is_builtin(given.get("data_dir"), "bench"):  # a built-in world's held-out items: ZoomBench's slot, with crops
        given = {"benchmarks": "zoombench", "view": "crop", **given}
    cfg = dataclasses.replace(EvalConfig(preset=preset, **PRESETS[preset]), **given)
    if cfg.out is None:  # each model its own folder: runs/eval/<its name>
        cfg = dataclasses.replace(cfg, out=default_out(cfg.model, cfg.served_model))
    return cfg, compare


def check_config(cfg: EvalConfig) -> list[str]:
    """The benchmark names, after refusing impossible settings with a message naming the flag."""
    names = [n.strip().lower() for n in cfg.benchmarks.split(",") if n.strip()]
    unknown = [n for n in names if n not in LOADERS]
    problems = []
    if unknown:
        problems.append(f"--benchmarks: unknown benchmark(s) {', '.join(map(repr, unknown))}; "
                        f"known: {', '.join(LOADERS)}")
    if not names:
        problems.append(f"--benchmarks is empty; known: {', '.join(LOADERS)}")
    if cfg.backend not in BACKENDS:
        problems.append(f"--backend {cfg.backend!r}: choose {', '.join(BACKENDS[:-1])} or {BACKENDS[-1]}")
    elif cfg.backend == "openai" and not cfg.base_url:
        problems.append("--backend openai needs --base-url (the server's base URL, e.g. http://127.0.0.1:8000/v1)")
    if cfg.base_url and cfg.backend != "openai":
        problems.append("--base-url is for --backend openai")
    if cfg.served_model and cfg.backend != "openai":
        problems.append("--served-model is for --backend openai")
    if cfg.vllm_url and cfg.backend != "vllm":
        problems.append("--vllm-url is for --backend vllm")
    if cfg.model is None and cfg.backend != "openai":
        problems.append("--model is required (a checkpoint folder, hub id, train.py run folder, 'toy' or 'tiny')")
    if cfg.data_dir is None:
        problems.append("--data-dir is required (a folder with one sub-folder per benchmark, see docs/EVAL.md; or "
                        "'toy': the toy world's held-out items; 'tiny': the tiny model's)")
    if cfg.view not in ("full", "crop"):
        problems.append(f"--view {cfg.view!r}: choose full or crop")
    if cfg.dtype not in ("auto", "float32", "bfloat16", "float16", "float64"):
        problems.append(f"--dtype {cfg.dtype!r}: choose auto, float32, bfloat16, float16 or float64")
    elif cfg.dtype == "float64" and cfg.backend == "vllm":
        problems.append("--dtype float64 is for --backend hf (vLLM computes in float32, bfloat16 or float16)")
    for flag in ("batch_size",):
        if getattr(cfg, flag) < 1:
            problems.append(f"--{flag.replace('_', '-')} {getattr(cfg, flag)}: must be at least 1")
    for flag in ("max_new_tokens", "limit", "max_prompt_len"):
        if getattr(cfg, flag) < 0:
            problems.append(f"--{flag.replace('_', '-')} {getattr(cfg, flag)}: must be >= 0")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        problems.append(f"--out {cfg.out}: is a file; give a folder (it holds one sub-folder per benchmark)")
    if cfg.judge_url and not cfg.judge_model:
        problems.append("--judge-url needs --judge-model (the model name the endpoint serves)")
    for flag in ("base_url", "vllm_url"):
        url = getattr(cfg, flag)
        if url and not url.strip().startswith(("http://", "https://")):
            problems.append(f"--{flag.replace('_', '-')} {url!r}: expected an http:// or https:// URL")
    if cfg.request_timeout <= 0:
        problems.append(f"--request-timeout {cfg.request_timeout}: must be > 0")
    if cfg.judge_url and not cfg.judge_url.strip().startswith(("http://", "https://")):
        problems.append(f"--judge-url {cfg.judge_url!r}: expected an http:// or https:// URL")
    if problems:
        raise UserError("; ".join(problems))
    if not is_builtin(cfg.data_dir, "bench"):  # a built-in name: its files are checked once built (`builtin_data`)
        check_data(names, cfg.data_dir)
    return list(dict.fromkeys(names))


def builtin_data(cfg: EvalConfig, names: list[str]) -> EvalConfig:
    """`cfg` with a built-in --data-dir ('toy', 'tiny': `opd.builtin`) as its folder, built on first use, and its files
    checked; any other --data-dir unchanged."""
    folder = builtin_path(cfg.data_dir, "bench")
    if folder is None:
        return cfg
    check_data(names, str(folder))
    return dataclasses.replace(cfg, data_dir=str(folder))


def check_data(names: list[str], data_dir: str) -> None:
    """Refuses up front when benchmarks have no files: all missing ones with the files each expects,
    and the present ones with the --benchmarks that runs them."""
    if Path(data_dir).exists() and not Path(data_dir).is_dir():
        first = names[0] if names else "vstar"
        raise UserError(f"--data-dir {data_dir}: is a file, not a folder; --data-dir takes the folder holding one "
                        f"sub-folder per benchmark with its files as shipped (a file of {first}: DATA/{first}/"
                        f"{Path(data_dir).name}, then --data-dir DATA; docs/EVAL.md lists each benchmark's files)")
    if not Path(data_dir).is_dir():
        raise UserError(f"--data-dir {data_dir}: no such folder (it holds one sub-folder per benchmark)")
    missing = [n for n in dict.fromkeys(names) if not has_files(n, data_dir)]
    if not missing:
        return
    present = [n for n in dict.fromkeys(names) if n not in missing]
    lines = [f"{len(missing)} of {len(set(names))} benchmarks have no files under {data_dir} "
             "(docs/EVAL.md lists the layouts):"]
    lines += [f"  {n}: expected {Path(data_dir) / n}/ with {expected_files(n)}" for n in missing]
    lines.append(f"present: {', '.join(present)}; to run only those: --benchmarks {','.join(present)}"
                 if present else "none of them is present.")
    raise UserError("\n".join(lines))


def main(argv: list[str] | None = None) -> dict:
    """eval.py: `--compare` prints the runs side by side; otherwise the evaluation of the settings in argv under
    --out's lock (every launched process calls it alike). Returns what `opd.eval.run.evaluate` returns."""
    cfg, compare = parse_args(argv)
    if compare:
        try:
            text = compare_runs(compare)
        except (FileNotFoundError, ValueError) as exc:  # a missing or foreign results file, named
            raise UserError(f"--compare: {exc}") from exc
        print(text, end="")
        return {"compare": text}
    names = check_config(cfg)
    cfg = builtin_data(cfg, names)
    from opd.eval.run import evaluate_locked  # torch-free module: eval.py --help (the run imports torch)

    return evaluate_locked(cfg, names)
