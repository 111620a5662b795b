"""One eval.py evaluation: the model (resolved, exported or served), each benchmark and view answered and scored,
the results written.

`evaluate(cfg, names, ranks)` is the run behind `opd.eval.cli.main` (`evaluate_locked` holds --out's lock around it):

1. `model_setup`: what answers, before anything is written (a server that does not answer is refused in
   seconds; a sharded or LoRA checkpoint is exported first, `resolve_model`);
2. the model's identity (`opd.models.identity.model_identity`: its files' digest, the resume key), hashed by rank 0;
3. for each benchmark and view, `opd.eval.evaluate.predict` answers what is not stored yet (the model is loaded
   on first need, `Engine`), and rank 0 scores it (`score_view`, the judge when asked);
4. rank 0 writes results.json and results.md (`write_outputs`) and prints the Table 1 row.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import set_seed

from opd.builtin import model_source
from opd.cli import UserError
from opd.engine import vllm_server
from opd.eval.backends import CONNECT_TIMEOUT, OpenAIBackend, VLLMBackend, config_special_ids, refuse_adapter
from opd.eval.bench_items import BenchmarkDataError
from opd.eval.benchmarks import load_benchmark
from opd.eval.config import EvalConfig, default_out, model_name
from opd.eval.evaluate import predict, score_view
from opd.eval.judge import judge_from_env
from opd.eval.lock import holding
from opd.eval.metrics import zoom_gap
from opd.eval.parallel import Ranks, init_ranks, rank_device, visible_gpu
from opd.eval.report import default_label, markdown_table, write_results
from opd.export import ensure_export
from opd.models.identity import DigestCache, model_identity
from opd.models.loading import load_model, load_processor, resolve_model_source
from opd.storage import write_atomic, write_jsonl_atomic


def say(line: str) -> None:
    """One line of eval.py's progress on stdout (a sharded checkpoint's export, a started vLLM server)."""
    print(f"eval.py: {line}", flush=True)


def resolve_model(path: str, ranks=None) -> str:
    """What to load for --model (`opd.builtin.model_source`: 'toy', 'tiny', a train.py run or checkpoint folder's
    policy/), then `opd.models.loading.resolve_model_source` (a checkpoint folder, made absolute, or a hub id). A sharded
    (--fsdp) checkpoint without policy/ is exported first (`opd.export.ensure_export`, one line saying so; by rank 0
    alone under a launcher): to its policy/, a LoRA run's to merged/ (its adapter merged into the base)."""
    exported = (ranks or Ranks()).on_main(ensure_export, path, "--model", say)
    source = resolve_model_source(str(exported) if exported is not None else model_source(path, f"--model {path}"))
    return str(Path(source).resolve()) if Path(source).is_dir() else source


def runtime(cfg: EvalConfig, ranks=None) -> tuple[str, str]:
    """(device, dtype) of this process: under a launcher a bare cuda is cuda:<local rank>. A server backend
    computes where and how its server does: ('server', 'server') for openai, the engine's dtype for vllm."""
    if cfg.backend == "openai":
        return "server", "server"
    if cfg.backend == "vllm":
        return "server", cfg.dtype if cfg.dtype != "auto" else "bfloat16"
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    return rank_device(device, ranks or Ranks()), dtype


def model_setup(cfg: EvalConfig, ranks) -> tuple[str | None, object | None]:
    """(the model folder or hub id, an OpenAIBackend or None), before anything is written. --backend openai: the
    server is asked first, by rank 0 (/v1/models within 5 s; an unreachable one is refused), which hands the
    connection to every rank; without --model the served name is the identity. --backend vllm: the vLLM venv
    must be there and --model a local folder (or a hub id in the Hugging Face cache) of a whole checkpoint, not a
    LoRA adapter, unless --vllm-url names a server, which must answer /health within 5 s."""
    server = None
    if cfg.backend == "openai":  # first: an unreachable server is refused in seconds
        server = ranks.on_main(OpenAIBackend.connect, cfg.base_url, cfg.served_model, None,
                               os.environ.get(cfg.api_key_env) or None, cfg.request_timeout, cfg.seed)
    if cfg.backend == "vllm" and not cfg.vllm_url:
        vllm_server.check_venv()  # a one-line error naming scripts/install_vllm.sh
    model_path = resolve_model(cfg.model, ranks) if cfg.model is not None else None
    if cfg.backend == "vllm":
        refuse_adapter(model_path, "vllm")
        if not cfg.vllm_url and not Path(model_path).is_dir():  # a hub id the local cache does not hold
            raise UserError(f"--backend vllm --model {cfg.model}: not in the local Hugging Face cache, and a vLLM "
                            "server starts from a local folder; download it first (e.g. one --backend hf run, or "
                            "`hf download` it), then run again")
        if cfg.vllm_url:
            ranks.on_main(check_vllm_url, cfg.vllm_url)
    if server is not None and model_path is not None:
        server.ids = config_special_ids(model_path)  # vision ids to suppress, EOS and pad
    return model_path, server


def check_vllm_url(url: str) -> None:
    """A one-line UserError unless the server at --vllm-url answers /health within CONNECT_TIMEOUT seconds."""
    if not vllm_server.VLLMServer(url.strip()).healthy(CONNECT_TIMEOUT):
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


class Engine:
    """What answers (a loaded model and processor, or a server backend), opened on first need: a rescoring run
    opens none. Holds the settings every view's predictions depend on (`settings`) and the timings for meta:
    `load_s` (the model load or server start) and `answer_s` per key (rank 0's view)."""

    def __init__(self, cfg: EvalConfig, ranks, model_path: str | None, server, identity: dict, digests):
        self.cfg, self.ranks, self.model_path, self.server = cfg, ranks, model_path, server
        self.identity, self.digests = identity, digests
        self.device, self.dtype = runtime(cfg, ranks)
        self.max_new = cfg.max_new_tokens or (1024 if cfg.enable_thinking else 64)
        self.extra = {} if cfg.backend == "hf" else {"backend": cfg.backend}  # hf: the settings.json of earlier runs
        if server is not None:
            self.extra |= {"base_url": server.base, "served_model": server.served_model}
        self.timing = {"load_s": 0.0, "answer_s": {}}
        self.engine = None

    @property
    def loaded(self) -> bool:
        return self.engine is not None

    def get(self):
        """The engine, opened on the first call; a hub model downloaded just now gets its commit recorded."""
        if self.engine is None:
            t0 = time.perf_counter()
            self.engine = self._open()
            if self.identity["model"].startswith("hf:"):  # a hub model downloaded just now: its commit is known
                self.identity.update(model_identity(self.model_path, self.digests))
            if self.ranks.main:
                self.digests.save()
            self.timing["load_s"] = round(time.perf_counter() - t0, 3)
        return self.engine

    def _open(self):
        cfg, ranks = self.cfg, self.ranks
        if cfg.backend == "openai":
            return self.server
        if cfg.backend == "vllm":
            env = None
            if ranks.world > 1 and not cfg.vllm_url:  # one engine per process, each on its own GPU
                env = {"CUDA_VISIBLE_DEVICES": visible_gpu(ranks.local_rank)}
            log = Path(cfg.out) / f"vllm-server{'' if ranks.main else f'-rank{ranks.rank}'}.log"
            try:
                return VLLMBackend.open(self.model_path, cfg.vllm_url, self.dtype, cfg.seed,
                                        cfg.max_prompt_len + self.max_new if cfg.max_prompt_len else None, log, env,
                                        cfg.request_timeout, say=say if ranks.main else None)
            except UserError as exc:  # this process's own server (rank k's may fail alone): it says so
                raise UserError(str(exc), local=True) from None

        return load_model(self.model_path, self.dtype, self.device), load_processor(self.model_path)

    def settings(self, view: str):
        """What one view's predictions depend on, read when called (a hub model's commit may arrive later)."""
        cfg = self.cfg
        return lambda: {**self.identity, "view": view, "enable_thinking": cfg.enable_thinking,
                        "max_new_tokens": self.max_new, "dtype": self.dtype, **self.extra}

    def close(self) -> None:
        if self.engine is not None and hasattr(self.engine, "close"):
            self.engine.close()  # a vLLM server this run started


def evaluate_locked(cfg: EvalConfig, names: list[str]) -> dict:
    """`evaluate` on this process's ranks (`opd.eval.parallel.init_ranks`) under --out's lock (`opd.eval.lock`: one
    run per folder, a second one is refused at once): the run behind `opd.eval.cli.main`."""
    ranks = init_ranks()
    try:
        with holding(Path(cfg.out), ranks):  # one run per --out: a second one is refused at once
            result = evaluate(cfg, names, ranks)
    except BaseException:
        ranks.close(ok=False)  # no barrier: the other ranks may wait in another collective (opd.eval.parallel)
        raise
    ranks.close()
    return result


def evaluate(cfg: EvalConfig, names: list[str], ranks) -> dict:
    """The evaluation of `names` with `cfg` on this process's `ranks` (the module docstring's steps); rank 0 returns
    {"results", "meta", "table"}, every other rank {"rank", "world_size"}."""
    model_path, server = model_setup(cfg, ranks)  # first: a server that does not answer is refused in seconds

    set_seed(cfg.seed)
    digests = DigestCache(Path(cfg.out) / "model_digests.json")
    if model_path is not None:  # the resume key: the model's files, not its path (hashed by rank 0 alone)
        identity = ranks.on_main(model_identity, model_path, digests)
    else:
        identity = {"model": f"served:{server.served_model}", "model_revision": None, "model_path": None}
    refuse_served_resume(cfg, names, identity)
    engine = Engine(cfg, ranks, model_path, server, identity, digests)
    judge = None
    if cfg.judge_url and ranks.main:
        judge = judge_from_env(cfg.judge_url, cfg.judge_model, Path(cfg.out) / "judge_cache.jsonl",
                               cfg.judge_key_env, cfg.judge_timeout)
    try:
        results, notes = answer_all(cfg, names, ranks, engine, judge)
    finally:
        engine.close()
    requests = sum(ranks.gather(server.requests)) if server is not None else 0  # every rank: one collective
    if not ranks.main:
        return {"rank": ranks.rank, "world_size": ranks.world}
    digests.save()
    return write_outputs(cfg, engine, results, notes, judge, requests)


def answer_all(cfg: EvalConfig, names: list[str], ranks, engine: Engine, judge) -> tuple[dict, list[str]]:
    """(results by key, notes under the table): every benchmark in its views, answered and (rank 0) scored."""
    results, notes, no_crop = {}, [], []
    for name in names:
        try:
            items = load_benchmark(name, cfg.data_dir)
        except (BenchmarkDataError, ImportError) as exc:  # a bad file (named with row and field); no pyarrow
            raise UserError(f"benchmark '{name}': {exc}") from exc
        views = ["full"] + (["crop"] if cfg.view == "crop" and any(i.crop is not None for i in items) else [])
        if cfg.view == "crop" and len(views) == 1:
            no_crop.append(name)
        by_view = {}
        try:
            for view in views:
                key = name if view == "full" else f"{name}@crop"
                scored = answer_view(cfg, name, key, view, items, ranks, engine, judge)
                if scored is not None:  # rank 0
                    results[key], by_view[view] = scored
        except BenchmarkDataError as exc:  # a missing/corrupt image met while answering this rank's share
            raise UserError(f"benchmark '{name}': {exc}", local=True) from exc
        if "crop" in by_view:
            notes.append(gap_note(name, results, by_view))
        del items
    if no_crop:
        notes.append(f"--view crop: no crop images in {', '.join(no_crop)}; full view only there.")
    return results, notes


def answer_view(cfg: EvalConfig, name: str, key: str, view: str, items: list, ranks, engine: Engine,
                judge) -> tuple[dict, list[dict]] | None:  # fmt: skip
    """Answers one view's items not yet stored (`opd.eval.evaluate.predict`); rank 0 returns (score dict, records),
    written to OUT/<key>/scored.jsonl, every other rank None."""
    subset = [item for item in items if view == "full" or item.crop is not None]
    subset = subset[: cfg.limit] if cfg.limit else subset
    folder = Path(cfg.out) / key
    t0, loaded = time.perf_counter(), engine.loaded
    stored = predict(key, subset, folder, engine.settings(view), engine.get, cfg.batch_size, cfg.progress,
                     cfg.max_prompt_len or None, cfg.overwrite, ranks)
    load = engine.timing["load_s"] if engine.loaded and not loaded else 0.0  # loaded in this call
    engine.timing["answer_s"][key] = round(time.perf_counter() - t0 - load, 3)
    if not ranks.main:
        return None
    score, records = score_view(name, subset, stored, judge)  # rank 0 scores (and asks the judge) alone
    write_jsonl_atomic(folder / "scored.jsonl", records)
    return score, records


def gap_note(name: str, results: dict, by_view: dict) -> str:
    """Stores the zoom gap (`opd.eval.metrics.zoom_gap`) in results[name@crop]; returns its line under the table."""
    gap = results[f"{name}@crop"]["zoom_gap"] = zoom_gap(by_view["full"], by_view["crop"])
    if not gap["n"]:
        return f"{name} zoom gap: no item answered in both views (raise --limit)"
    return (f"{name} zoom gap (crop - full, {gap['n']} items): {gap['gap']:+.2f} points "
            f"(full {gap['full']:.2f}, crop {gap['crop']:.2f})")


def write_outputs(cfg: EvalConfig, engine: Engine, results: dict, notes: list[str], judge, requests: int) -> dict:
    """Rank 0: results.json (scores and meta) and results.md (the Table 1 row of the benchmarks evaluated, also
    printed)."""
    out = Path(cfg.out)
    identity, server = engine.identity, engine.server
    served = server.served_model if server is not None else None
    named = Path(default_out(cfg.model, cfg.served_model)).resolve() == out.resolve()  # the model's own folder
    label = cfg.label or (model_name(cfg.model, served) if named else default_label(out))
    meta = {**asdict(cfg), "label": label, "label_from": "--label" if cfg.label else "model" if named else "folder",
            "model_path": engine.model_path, "model_identity": identity["model"],
            "model_revision": identity["model_revision"], "device": engine.device, "dtype": engine.dtype,
            "max_new_tokens": engine.max_new, "scoring": f"judge {cfg.judge_model} at {cfg.judge_url}" if judge else
            "free-form answers by normalised exact match", "world_size": engine.ranks.world, **engine.timing,
            "finished": time.strftime("%Y-%m-%d %H:%M:%S")}
    if server is not None:
        meta |= {"base_url": server.base, "served_model": server.served_model, "server_kind": server.kind,
                 "requests": requests}  # every rank's
    if judge is not None:
        meta["judge_requests"] = judge.requests
    write_results(out / "results.json", results, meta)
    evaluated = [key for key in results if "@" not in key]  # the benchmarks of this command, not their @crop views
    table = markdown_table(results, label, evaluated) + "".join(f"\n{n}\n" for n in notes)
    write_atomic(out / "results.md", table)
    print("\n" + table, end="", flush=True)
    folders = ", ".join(f"{key}/" for key in results)  # each view's predictions.jsonl and scored.jsonl
    print(f"\neval.py: wrote {out}/results.md, results.json{' and ' + folders if folders else ''}", flush=True)
    return {"results": results, "meta": meta, "table": table}
