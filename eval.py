"""Evaluation on the paper's seven benchmarks (Table 1) from their shipped local files.

    python eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --model Qwen/Qwen3.5-4B --benchmarks zoombench --view crop --data-dir data/eval --out runs/base
    python eval.py --compare runs/base runs/paper-4b/eval
    torchrun --nproc_per_node 8 eval.py --model runs/paper-4b --data-dir data/eval --out runs/paper-4b/eval
    python eval.py --backend openai --base-url http://127.0.0.1:8000/v1 --model runs/paper-4b --data-dir data/eval

Greedy decoding (temperature 0, seed 42) with plain Hugging Face `generate`, the model and processor
loaded as in training, the non-thinking prompt unless --enable-thinking. Predictions are appended to
OUT/<benchmark>/predictions.jsonl as they come, so a stopped run resumes where it stopped (with the
same model: its files' digest, not its path, is the resume key); the scores go to OUT/results.json and
OUT/results.md (Table 1 order, unweighted average). docs/EVAL.md lists the files each benchmark needs
and where scoring departs from the paper. Errors the user can fix are one line and exit code 2.

A sharded (--fsdp) training checkpoint without a policy/ export is exported first (`opd.export`). Under a
launcher (torchrun, accelerate launch) each process answers its share of every benchmark
(`opd.eval.parallel`); rank 0 merges and scores. --backend openai / vllm answer through a server
(`opd.eval.backends`) with the same prompts, parsers and aggregates.
"""

import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from opd.cli import UserError, build_parser, run_cli
from opd.eval.backends import BACKENDS
from opd.eval.benchmarks import LOADERS, BenchmarkDataError, expected_files, has_files, load_benchmark

ALL_BENCHMARKS = ",".join(LOADERS)  # Table 1 order


@dataclass
class EvalConfig:
    preset: str = "default"
    """Starting values (only 'default'; flags set everything)."""
    model: str | None = None
    """HF image-text-to-text checkpoint (folder or hub id), a train.py run or checkpoint folder (its policy/;
    a sharded --fsdp checkpoint is exported there first), or 'tiny' for the built-in tiny model. With
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
    """Folder holding one sub-folder per benchmark, as shipped (docs/EVAL.md lists the files)."""
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
    """Row label of this run in the tables (default: the output folder's name)."""
    overwrite: bool = False
    """Answer the named benchmarks again from scratch: their stored predictions in --out are deleted
    (once the model has loaded). Without it, a folder holding another model's predictions is refused."""
    progress: bool = True
    """Show a progress bar per benchmark."""


PRESETS: dict[str, dict] = {"default": {}}


def parse_args(argv: list[str] | None) -> tuple[EvalConfig, list[str] | None]:
    """(config, runs to compare or None): the EvalConfig flags plus ``--compare RUN [RUN ...]``."""
    import dataclasses

    parser = build_parser(EvalConfig, PRESETS, __doc__.split("\n")[0])
    parser.add_argument("--compare", nargs="+", metavar="RUN",
                        help="Print these runs (folders or results.json files) side by side with deltas, then exit.")
    args = vars(parser.parse_args(argv))
    compare = args.pop("compare")
    preset = args.pop("preset")
    given = {k: v for k, v in args.items() if v is not None}
    return dataclasses.replace(EvalConfig(preset=preset, **PRESETS[preset]), **given), compare


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
        problems.append("--model is required (a checkpoint folder, hub id, train.py run folder, or 'tiny')")
    if cfg.data_dir is None:
        problems.append("--data-dir is required (a folder with one sub-folder per benchmark; see docs/EVAL.md)")
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
    check_data(names, cfg.data_dir)
    return list(dict.fromkeys(names))


def check_data(names: list[str], data_dir: str) -> None:
    """Refuses up front when benchmarks have no files: all missing ones with the files each expects,
    and the present ones with the --benchmarks that runs them."""
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


def resolve_model(path: str, ranks=None) -> str:
    """What to load for --model (`opd.checkpoint.model_source`: 'tiny', a train.py run or checkpoint folder's
    policy/), then `opd.model.resolve_model_source` (a checkpoint folder, made absolute, or a hub id). A sharded
    (--fsdp) checkpoint without policy/ is exported to its policy/ first (`opd.export.ensure_export`, one line
    saying so; by rank 0 alone under a launcher)."""
    from opd.checkpoint import model_source
    from opd.eval.parallel import Ranks
    from opd.export import ensure_export
    from opd.model import resolve_model_source

    (ranks or Ranks()).on_main(ensure_export, path, "--model", lambda line: print(f"eval.py: {line}", flush=True))
    source = resolve_model_source(model_source(path, f"--model {path}"))
    return str(Path(source).resolve()) if Path(source).is_dir() else source


def runtime(cfg: EvalConfig, ranks=None) -> tuple[str, str]:
    """(device, dtype) of this process: under a launcher a bare cuda is cuda:<local rank>. A server backend
    computes where and how its server does: ('server', 'server') for openai, the engine's dtype for vllm."""
    import torch

    from opd.eval.parallel import Ranks, rank_device

    if cfg.backend == "openai":
        return "server", "server"
    if cfg.backend == "vllm":
        return "server", cfg.dtype if cfg.dtype != "auto" else "bfloat16"
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return rank_device(device, ranks or Ranks()), dtype


def main(argv: list[str] | None = None) -> dict:
    cfg, compare = parse_args(argv)
    if compare:
        from opd.eval.report import compare_runs

        try:
            text = compare_runs(compare)
        except (FileNotFoundError, ValueError) as exc:  # a missing or foreign results file, named
            raise UserError(f"--compare: {exc}") from exc
        print(text, end="")
        return {"compare": text}
    names = check_config(cfg)

    from opd.eval.parallel import init_ranks

    ranks = init_ranks()
    try:
        result = evaluate(cfg, names, ranks)
    except BaseException:
        ranks.close(ok=False)  # no barrier: the other ranks may wait in another collective (opd.eval.parallel)
        raise
    ranks.close()
    return result


def model_setup(cfg: EvalConfig, ranks) -> tuple[str | None, object | None]:
    """(the model folder or hub id, an OpenAIBackend or None), before anything is written. --backend openai: the
    server is asked first, by rank 0 (/v1/models within 5 s; an unreachable one is refused), which hands the
    connection to every rank; without --model the served name is the identity. --backend vllm: the vLLM venv
    must be there and --model a local folder (or a hub id in the Hugging Face cache) of a whole checkpoint, not a
    LoRA adapter, unless --vllm-url names a server, which must answer /health within 5 s."""
    server = None
    if cfg.backend == "openai":  # first: an unreachable server is refused in seconds
        import os

        from opd.eval.backends import OpenAIBackend

        server = ranks.on_main(OpenAIBackend.connect, cfg.base_url, cfg.served_model, None,
                               os.environ.get(cfg.api_key_env) or None, cfg.request_timeout, cfg.seed)
    if cfg.backend == "vllm" and not cfg.vllm_url:
        from opd.engine import check_venv

        check_venv()  # a one-line error naming scripts/install_vllm.sh
    model_path = resolve_model(cfg.model, ranks) if cfg.model is not None else None
    if cfg.backend == "vllm":
        from opd.eval.backends import refuse_adapter

        refuse_adapter(model_path, "vllm")
        if not cfg.vllm_url and not Path(model_path).is_dir():  # a hub id the local cache does not hold
            raise UserError(f"--backend vllm --model {cfg.model}: not in the local Hugging Face cache, and a vLLM "
                            "server starts from a local folder; download it first (e.g. one --backend hf run, or "
                            "`hf download` it), then run again")
        if cfg.vllm_url:
            ranks.on_main(check_vllm_url, cfg.vllm_url)
    if server is not None and model_path is not None:
        from opd.eval.backends import config_special_ids

        server.ids = config_special_ids(model_path)  # vision ids to suppress, EOS and pad
    return model_path, server


def check_vllm_url(url: str) -> None:
    """A one-line UserError unless the server at --vllm-url answers /health within CONNECT_TIMEOUT seconds."""
    from opd.engine import VLLMServer
    from opd.eval.backends import CONNECT_TIMEOUT

    if not VLLMServer(url.strip()).healthy(CONNECT_TIMEOUT):
        raise UserError(f"--vllm-url {url}: no vLLM server answers GET {url.strip().rstrip('/')}/health within "
                        f"{CONNECT_TIMEOUT:g} s")


def refuse_served_resume(cfg: EvalConfig, names: list[str], identity: dict) -> None:
    """A served name (`served:<name>`, --backend openai without --model) says nothing about the weights behind it:
    folders of --out already holding predictions are refused unless --overwrite."""
    if cfg.overwrite or not identity["model"].startswith("served:"):
        return
    out = Path(cfg.out)
    keys = [k for n in names for k in (n, f"{n}@crop") if (out / k / "settings.json").is_file()
            or (out / k / "predictions.jsonl").is_file()]  # fmt: skip
    if keys:
        raise UserError(f"--out {out} holds predictions ({', '.join(keys)}) and the server is known only by its name "
                        f"{identity['model'][len('served:'):]!r}, which does not tell its weights apart: they are not "
                        "resumed. Give --overwrite to answer again, a new --out, or --model naming the served "
                        "checkpoint (its files' digest is then the resume key)")


def evaluate(cfg: EvalConfig, names: list[str], ranks) -> dict:
    model_path, server = model_setup(cfg, ranks)  # first: a server that does not answer is refused in seconds

    from transformers import set_seed

    from opd.eval.evaluate import DigestCache, model_identity, predict, score_view, write_jsonl_atomic
    from opd.eval.metrics import zoom_gap
    from opd.eval.report import markdown_table, write_results
    from opd.ledger import write_atomic

    set_seed(cfg.seed)
    out = Path(cfg.out)
    device, dtype = runtime(cfg, ranks)
    max_new = cfg.max_new_tokens or (1024 if cfg.enable_thinking else 64)
    digests = DigestCache(out / "model_digests.json")
    if model_path is not None:  # the resume key: the model's files, not its path (hashed by rank 0 alone)
        identity = ranks.on_main(model_identity, model_path, digests)
    else:
        identity = {"model": f"served:{server.served_model}", "model_revision": None, "model_path": None}
    refuse_served_resume(cfg, names, identity)
    extra = {} if cfg.backend == "hf" else {"backend": cfg.backend}  # hf: the settings.json of earlier runs
    if server is not None:
        extra |= {"base_url": server.base, "served_model": server.served_model}
    cache: dict = {}

    timing = {"load_s": 0.0, "answer_s": {}}  # model load (or server start) and each key's answering, rank 0's view

    def get_model():
        if not cache:
            t0 = time.perf_counter()
            if cfg.backend == "openai":
                cache["engine"] = server
            elif cfg.backend == "vllm":
                from opd.eval.backends import VLLMBackend
                from opd.eval.parallel import visible_gpu

                env = None
                if ranks.world > 1 and not cfg.vllm_url:  # one engine per process, each on its own GPU
                    env = {"CUDA_VISIBLE_DEVICES": visible_gpu(ranks.local_rank)}
                try:
                    cache["engine"] = VLLMBackend.open(
                        model_path, cfg.vllm_url, dtype, cfg.seed,
                        cfg.max_prompt_len + max_new if cfg.max_prompt_len else None,
                        out / f"vllm-server{'' if ranks.main else f'-rank{ranks.rank}'}.log", env, cfg.request_timeout)
                except UserError as exc:  # this process's own server (rank k's may fail alone): it says so
                    raise UserError(str(exc), local=True) from None
            else:
                from opd.model import load_model, load_processor

                cache["engine"] = (load_model(model_path, dtype, device), load_processor(model_path))
            if identity["model"].startswith("hf:"):  # a hub model downloaded just now: its commit is known
                identity.update(model_identity(model_path, digests))
            if ranks.main:
                digests.save()
            timing["load_s"] = round(time.perf_counter() - t0, 3)
        return cache["engine"]

    def view_settings(view: str):
        """What one view's predictions depend on, read when called (a hub model's commit may arrive later)."""
        return lambda: {**identity, "view": view, "enable_thinking": cfg.enable_thinking, "max_new_tokens": max_new,
                        "dtype": dtype, **extra}

    judge = None
    if cfg.judge_url and ranks.main:
        from opd.eval.judge import judge_from_env

        judge = judge_from_env(cfg.judge_url, cfg.judge_model, out / "judge_cache.jsonl", cfg.judge_key_env,
                               cfg.judge_timeout)
    results, notes, no_crop = {}, [], []
    try:
        for name in names:
            try:
                items = load_benchmark(name, cfg.data_dir)
            except (BenchmarkDataError, ImportError) as exc:  # a bad file (named with row and field); no pyarrow
                raise UserError(f"benchmark '{name}': {exc}") from exc
            try:
                views = ["full"] + (["crop"] if cfg.view == "crop" and any(i.crop is not None for i in items) else [])
                if cfg.view == "crop" and len(views) == 1:
                    no_crop.append(name)
                by_view = {}
                for view in views:
                    subset = [item for item in items if view == "full" or item.crop is not None]
                    subset = subset[: cfg.limit] if cfg.limit else subset
                    key = name if view == "full" else f"{name}@crop"
                    t0, loaded = time.perf_counter(), bool(cache)
                    stored = predict(key, subset, out / key, view_settings(view), get_model, cfg.batch_size,
                                     cfg.progress, cfg.max_prompt_len or None, cfg.overwrite, ranks)
                    load = timing["load_s"] if cache and not loaded else 0.0  # loaded in this call
                    timing["answer_s"][key] = round(time.perf_counter() - t0 - load, 3)
                    if ranks.main:  # rank 0 scores (and asks the judge) alone
                        results[key], by_view[view] = score_view(name, subset, stored, judge)
                        write_jsonl_atomic(out / key / "scored.jsonl", by_view[view])
            except BenchmarkDataError as exc:  # a missing/corrupt image met while answering this rank's share
                raise UserError(f"benchmark '{name}': {exc}", local=True) from exc
            if "crop" in by_view:
                gap = results[f"{name}@crop"]["zoom_gap"] = zoom_gap(by_view["full"], by_view["crop"])
                notes.append(f"{name} zoom gap (crop - full, {gap['n']} items): {gap['gap']:+.2f} points "
                             f"(full {gap['full']:.2f}, crop {gap['crop']:.2f})" if gap["n"] else
                             f"{name} zoom gap: no item answered in both views (raise --limit)")
            del items
    finally:
        engine = cache.get("engine")
        if engine is not None and hasattr(engine, "close"):
            engine.close()  # a vLLM server this run started
    requests = sum(ranks.gather(server.requests)) if server is not None else 0  # every rank: one collective
    if not ranks.main:
        return {"rank": ranks.rank, "world_size": ranks.world}
    if no_crop:
        notes.append(f"--view crop: no crop images in {', '.join(no_crop)}; full view only there.")
    label = cfg.label or out.resolve().name
    digests.save()
    meta = {**asdict(cfg), "label": label, "model_path": model_path, "model_identity": identity["model"],
            "model_revision": identity["model_revision"], "device": device, "dtype": dtype,
            "max_new_tokens": max_new, "scoring": f"judge {cfg.judge_model} at {cfg.judge_url}" if judge else
            "free-form answers by normalised exact match", "world_size": ranks.world, **timing,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if server is not None:
        meta |= {"base_url": server.base, "served_model": server.served_model, "server_kind": server.kind,
                 "requests": requests}  # every rank's
    if judge is not None:
        meta["judge_requests"] = judge.requests
    write_results(out / "results.json", results, meta)
    table = markdown_table(results, label) + "".join(f"\n{n}\n" for n in notes)
    write_atomic(out / "results.md", table)
    print("\n" + table, end="", flush=True)
    return {"results": results, "meta": meta, "table": table}


if __name__ == "__main__":
    run_cli(main, sys.argv[1:], "eval.py")
