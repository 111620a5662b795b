"""train.py's default: the toy world (opd/toy/default.py, --preset toy) and the built-in names (opd/builtin.py).

Quick: 'tiny' and 'toy' resolve in one place for every flag that takes a model, data or a benchmark folder (on a
small toy world built for the test); the default base has vLLM-servable shapes; --preset tiny is today's default (its
values, and a recorded ledger reproduced); live evaluations (--eval-before, --eval-every) are printed and written in
summary.md. Slow: the README's first command from an empty cache, then eval.py on the run and on the untrained base
(the full image at least 5 points up); and the default with --rollout-engine vllm.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

import opd.toy.default as toy_default
import train
from opd.cli import UserError

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_WORLD = toy_default.WORLD
"""The default world as shipped (the `small_toy` fixture replaces it while this module's tests run)."""


@pytest.fixture(scope="module")
def small_toy(tmp_path_factory):
    """The default toy world, small (8 training records, 6 held-out items, a base of 2 supervised steps), in its own
    cache: the same code paths as the real default, built in seconds."""
    from opd.toy.sft import SFTConfig
    from opd.toy.world import WorldConfig

    cache = tmp_path_factory.mktemp("toy-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BAS_OPD_CACHE", str(cache))
        mp.setattr(toy_default, "WORLD", WorldConfig(seed=0, n_opd=8, n_audit=0, n_eval=6))
        mp.setattr(toy_default, "SFT", SFTConfig(steps=2, batch=2, vllm_shapes=True))
        toy = toy_default.toy_defaults(log=lambda line: None)
        yield toy


def test_the_builtin_names_resolve_in_one_place(small_toy):
    from accelerate import PartialState

    from opd.loop.build import default_sources
    from opd.builtin import builtin_path
    from opd.builtin import model_source
    from opd.data.sources import load_records
    from opd.builtin import teacher_source
    from opd.tiny import tiny_bench, tiny_defaults

    tiny_model, tiny_data = tiny_defaults()
    assert (builtin_path("tiny", "model"), builtin_path("tiny", "data"), builtin_path("tiny", "bench")) == (
        tiny_model, tiny_data, tiny_bench())  # fmt: skip (the tiny task's held-out items: eval.py --data-dir tiny)
    assert (tiny_bench() / "zoombench").is_dir()
    toy = small_toy
    assert (builtin_path("toy", "model"), builtin_path("toy", "data"), builtin_path("toy", "bench")) == (
        toy.base, toy.data, toy.bench)  # fmt: skip
    assert toy.base.parent.parent == Path(os.environ["BAS_OPD_CACHE"])  # under cache_dir(), as the tiny model
    assert [builtin_path(name, "model") for name in ("runs/x", "Qwen/Qwen3.5-4B", None, "toy2")] == [None] * 4
    assert model_source("toy", "--model toy") == teacher_source("toy") == str(toy.base)
    assert model_source("tiny", "--model tiny") == str(tiny_model)
    records = load_records("toy")
    assert len(records) == 8 and all(r.eligible for r in records) and records[0].answer in "ABCD"
    assert len(load_records("tiny")) == len(load_records(tiny_data)) == 32
    acc = PartialState()
    assert default_sources("toy", "toy", acc) == (str(toy.base), str(toy.data))
    assert default_sources(None, None, acc) == (str(tiny_model), str(tiny_data))  # TrainConfig(): the tiny model
    assert default_sources("tiny", None, acc, vllm=True) == (str(tiny_model), str(tiny_data))  # a name is the name
    vllm_model, data = default_sources(None, None, acc, vllm=True)  # --preset tiny --rollout-engine vllm
    assert data == str(tiny_data) and vllm_model != str(tiny_model) and Path(vllm_model).name.startswith("tiny-vllm")


def test_the_default_base_is_one_vllm_can_serve(small_toy, tmp_path):
    """The default base has the vLLM CPU backend's head sizes and an M-RoPE that fits (opd.engine.vllm_server.unservable);
    the experiments' bases (SFTConfig() as before) and the tiny model do not, the tiny model's vLLM variant does."""
    from opd.engine.vllm_server import unservable
    from opd.tiny import tiny_defaults
    from opd.toy.sft import SFTConfig, build_model, toy_processor

    assert toy_default.SFT.vllm_shapes and unservable(small_toy.base) is None
    config = json.loads((small_toy.base / "config.json").read_text())["text_config"]
    assert (config["head_dim"], config["linear_key_head_dim"], config["linear_value_head_dim"]) == (32, 64, 64)
    build_model(toy_processor(32), SFTConfig()).config.save_pretrained(tmp_path / "experiments")
    assert unservable(tmp_path / "experiments") is not None
    assert unservable(tiny_defaults()[0]) is not None and unservable(tiny_defaults(vllm=True)[0]) is None


def test_eval_py_takes_toy_as_data_dir_and_model(small_toy, tmp_path):
    from opd.eval.cli import builtin_data, check_config, main, parse_args

    cfg, _ = parse_args(["--model", "toy", "--data-dir", "toy"])
    assert (cfg.benchmarks, cfg.view) == ("zoombench", "crop")  # the toy items' slot, both views
    assert builtin_data(cfg, check_config(cfg)).data_dir == str(small_toy.bench)
    given, _ = parse_args(["--model", "toy", "--data-dir", "toy", "--view", "full", "--benchmarks", "zoombench"])
    assert (given.benchmarks, given.view) == ("zoombench", "full")  # flags given win
    with pytest.raises(UserError, match="vstar: expected"):
        builtin_data(*(lambda c: (c, check_config(c)))(parse_args(["--model", "toy", "--data-dir", "toy",
                                                                    "--benchmarks", "vstar"])[0]))  # fmt: skip
    res = main(["--model", "toy", "--data-dir", "toy", "--out", str(tmp_path / "e"), "--no-progress"])["results"]
    assert res["zoombench"]["n"] == res["zoombench@crop"]["n"] == 6


def test_preset_tiny_is_the_former_default_and_toy_the_new_one():
    from opd.config import PRESETS, RunConfig, TrainConfig, resolve

    assert PRESETS["tiny"] == dict(prompts_per_step=4, rollouts_per_prompt=8, max_prompt_len=512, max_response_len=16,
                                   steps=8, lr=1e-4, micro_batch=8, replay_start=16, replay_batch=64, save_every=4,
                                   out="runs/tiny")  # fmt: skip
    tiny = resolve({"preset": "tiny"})
    assert (tiny.model.model, tiny.data.data, tiny.eval.every, tiny.eval.before, tiny.folder.out) == (
        None, None, 0, False, "runs/tiny")  # fmt: skip
    assert tiny.flags() == TrainConfig(**PRESETS["tiny"], preset="tiny").flags()
    cfg = resolve({})
    assert RunConfig.preset == cfg.run.preset == "toy" and cfg.problems() == []
    assert (cfg.model.model, cfg.data.data, cfg.eval.data, cfg.eval.views, cfg.eval.limit, cfg.eval.before) == (
        "toy", "toy", "toy", "full,crop", 0, True)  # fmt: skip
    assert cfg.eval.every == cfg.run.steps == DEFAULT_WORLD.n_opd // cfg.data.prompts_per_step  # one epoch, scored at the end
    assert TrainConfig().model.model is None and TrainConfig().problems() == []  # no preset applied: the tiny model
    assert "--data is required with --preset paper-4b" in " ".join(resolve({"preset": "paper-4b"}).problems())


def test_preset_tiny_reproduces_a_recorded_ledger(tmp_path):
    """`--preset tiny` runs today's default exactly: tests/golden.py's first case (3 steps, float64) in this process
    gives its recorded ledger (the slow tests/test_golden.py runs every case)."""
    from golden import GOLDEN, run_case, teacher_model
    from test_golden import assert_same_row

    recorded = json.loads(GOLDEN.read_text())["bas-opd learned-25"]
    rows = run_case("bas-opd learned-25", tmp_path / "run", teacher_model(tmp_path), in_process=True)
    assert len(rows) == len(recorded) == 3
    for got, want in zip(rows, recorded):
        assert_same_row("bas-opd learned-25", got, want)


def test_live_evaluations_are_printed_and_in_summary_md(small_toy, tmp_path, capsys):
    """--eval-before and --eval-every 1 on 2 steps (the small toy world's base, --eval-data toy): the first ledger row
    holds the evaluation before step 0, rows 0 and 1 their own; the console prints each, summary.json and summary.md
    list them with the ledger's values and the before -> after line beside the teacher's query ratio."""
    from opd.loop.ledger import read_ledger

    out = tmp_path / "run"
    train.main(["--preset", "tiny", "--model", "toy", "--data", "toy", "--steps", "2", "--max-response-len", "4",
                "--eval-every", "1", "--eval-before", "--eval-data", "toy", "--eval-views", "full,crop",
                "--eval-limit", "0", "--save-every", "0", "--report-to", "none", "--out", str(out)])  # fmt: skip
    console = capsys.readouterr().out
    rows = read_ledger(out / "ledger.jsonl")
    keys = ["eval/zoombench", "eval/zoombench_crop", "eval/zoombench_crop_gap"]
    evals = [rows[0]["eval_before"], rows[0], rows[1]]
    assert all(set(keys) <= set(e) for e in evals)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["evaluations"] == {"data": "toy", "rows": [{"after": n, **{k: e[k] for k in keys}}
                                                              for n, e in enumerate(evals)]}  # fmt: skip
    text = (out / "summary.md").read_text()
    for when, e in zip(("before training", "after step 1", "after step 2"), evals):
        cells = f"{e[keys[0]]:.2f} | {e[keys[1]]:.2f} | {e[keys[2]]:+.2f}"
        assert f"| {when} | {cells} |" in text
        assert re.search(rf"train\.py: eval {when} \(\d+ s\): zoombench, full image {e[keys[0]]:.2f}; zoombench, "
                         rf"crop {e[keys[1]]:.2f}; zoombench, crop - full \{e[keys[2]]:+.2f}", console), when
    before, after = evals[0][keys[0]], evals[2][keys[0]]
    ratio = 100 * summary["calls"] / summary["candidates"]
    assert (f"Before -> after 2 steps: zoombench, full image {before:.2f} -> {after:.2f} ({after - before:+.2f} points), "
            f"the teacher queried on {ratio:.2f}% of the candidates ({summary['calls']:,} of "
            f"{summary['candidates']:,} rollouts).") in text  # fmt: skip
    assert text.index("| before training |") < text.index("| Policy | Candidates |")  # the accuracies first
    assert f"eval.py --model {out} --data-dir toy" in console


def test_eval_before_alone_is_refused_by_name(tmp_path):
    with pytest.raises(UserError, match=r"^--eval-before has no effect without --eval-every N"):
        train.main(["--preset", "tiny", "--eval-before", "--out", str(tmp_path / "r")])


def test_a_summary_without_evaluations_is_the_cost_tables_alone():
    from opd.loop.ledger import format_summary, summarize

    rows = [{"step": 0, "candidates": 8, "budget": 2, "selected": 2, "scored_tokens": 4, "candidate_tokens": 16,
             "teacher_forward_s": 0.1, "step_s": 1.0}]  # fmt: skip
    text = format_summary(summarize(rows), "random-25")
    assert text.startswith("| Policy | Candidates |") and "Live evaluation" not in text


def readme_first_command() -> list[str]:
    """The train.py flags of the README's first command (its one-line install-and-train block)."""
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in re.findall(r"```bash\n(.*?)\n```", readme, re.S) if "pip install -r requirements.txt" in x)
    assert "\n" not in line.strip()
    return line.split("train.py", 1)[1].split()


@pytest.mark.slow
def test_the_readme_first_command_lifts_the_full_image_accuracy(tmp_path):
    """The README's first command from an empty cache (the toy world and its base built on first use), one thread:
    its summary.md shows full-image and crop accuracy before and after; eval.py scores runs/default and the untrained
    base (--model toy) with the same numbers, and the run's full-image accuracy is at least 5 points above the
    base's. Measured: about 2 minutes of the test's 2-3 (build 55 s, training 60 s, eval.py 10 s each)."""
    env = {**os.environ, "BAS_OPD_CACHE": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}

    def run(script: str, *args: str) -> str:
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, str(ROOT / script), *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=900)  # fmt: skip
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        print(f"{script} {' '.join(args)}: {time.perf_counter() - t0:.0f} s", file=sys.__stderr__, flush=True)
        return proc.stdout

    flags = readme_first_command()
    assert flags == ["--policy", "learned", "--rho", "0.25"]
    run("train.py", *flags)
    text = (tmp_path / "runs" / "default" / "summary.md").read_text()
    table = {m[0]: (float(m[1]), float(m[2])) for m in re.findall(
        r"^\| (before training|after step \d+) \| ([\d.]+) \| ([\d.]+) \| [+-][\d.]+ \|$", text, re.M)}  # fmt: skip
    assert list(table) == ["before training", "after step 60"], text
    assert re.search(r"Before -> after 60 steps: zoombench, full image [\d.]+ -> [\d.]+ \([+-][\d.]+ points\), the "
                     r"teacher queried on 25\.00% of the candidates \(960 of 3,840 rollouts\)\.", text), text
    scores = {}
    for model in ("runs/default", "toy"):
        run("eval.py", "--model", model, "--data-dir", "toy", "--out", f"eval-{model.replace('/', '-')}", "--no-progress")
        res = json.loads((tmp_path / f"eval-{model.replace('/', '-')}" / "results.json").read_text())["benchmarks"]
        scores[model] = (res["zoombench"]["score"], res["zoombench@crop"]["score"])
    assert scores["toy"] == table["before training"] and scores["runs/default"] == table["after step 60"]
    assert scores["runs/default"][0] >= scores["toy"][0] + 5, scores


@pytest.mark.slow
def test_the_default_trains_with_vllm_rollouts(small_toy, tmp_path):
    """--rollout-engine vllm on the default (the small toy world's base: vLLM's CPU backend serves it), and
    --preset tiny --rollout-engine vllm without --model (the tiny model's vLLM variant): each trains its steps with
    the engine's rollouts. Skipped without the vLLM venv (scripts/install_vllm.sh)."""
    from opd.engine.vllm_server import check_venv
    from opd.loop.ledger import read_ledger

    try:
        check_venv()
    except UserError as exc:
        pytest.skip(str(exc))
    out = tmp_path / "toy"
    train.main(["--rollout-engine", "vllm", "--prompts-per-step", "4", "--steps", "2", "--eval-every", "2",
                "--report-to", "none", "--out", str(out)])  # fmt: skip
    stored = json.loads((out / "summary.json").read_text())
    assert len(read_ledger(out / "ledger.jsonl")) == 2 and len(stored["evaluations"]["rows"]) == 2
    tiny = tmp_path / "tiny"
    train.main(["--preset", "tiny", "--rollout-engine", "vllm", "--steps", "1", "--report-to", "none", "--out", str(tiny)])
    config = json.loads((tiny / "checkpoint-000001" / "policy" / "config.json").read_text())["text_config"]
    assert (config["head_dim"], config["linear_key_head_dim"]) == (32, 64)  # the variant, not the tiny model
