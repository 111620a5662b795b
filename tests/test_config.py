"""One config mechanism (opd/config.py): sections per component, flags as they were, config files.

`--config FILE` takes YAML (keys = flag names) or a run's own train_config.json; flags given beside it win;
`--print-config` shows the merged result as a config file. Each reproduces the ledger of the flags that made it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import train
from opd.cli import UserError
from opd.config import SECTIONS, TrainConfig, read_config_file, resolve
from opd.loop.ledger import read_ledger

FLAGS = ["--preset", "tiny", "--steps", "2", "--report-to", "none", "--save-every", "0", "--policy", "entropy",
         "--rho", "0.5", "--sample-temperature", "1.2", "--loss-temperature", "1.1", "--max-response-len", "6"]  # fmt: skip


def results(out) -> list[dict]:
    """The ledger's result fields (no times, no launch)."""
    return [{k: v for k, v in r.items() if k != "launch" and not k.endswith("_s") and "_s_" not in k}
            for r in read_ledger(out / "ledger.jsonl")]  # fmt: skip


def test_sections_own_their_fields_and_the_flat_names_stay():
    cfg = TrainConfig(rho=0.5, lora_r=8, dapd_clip=0.1, eval_every=3, sample_top_k=20, selector_lr=0.01)
    assert (cfg.selection.rho, cfg.lora.r, cfg.dapd.clip, cfg.eval.every, cfg.sampling.top_k, cfg.selector.lr) == (
        0.5, 8, 0.1, 3, 20, 0.01)
    names = [f.name for f in TrainConfig.flag_list()]
    assert len(names) == len(set(names))  # one flag, one field
    assert {"rho", "policy", "lora_r", "loss_agg", "loss_chunk", "dapd_clip", "opod_kl", "tm_opd_kl_coef",
            "eval_every", "rollout_engine", "report_to", "selector_seed", "no_rank_loss"} <= set(names)  # fmt: skip
    assert set(SECTIONS) >= {"selection", "selector", "lora", "sampling", "loss", "optim", "dapd", "opod", "eval",
                             "engine", "trackers"}  # fmt: skip
    with pytest.raises(TypeError, match="unknown field"):
        TrainConfig(lora_rank=8)
    assert cfg.replace(rho=0.25).selection.rho == 0.25 and cfg.selection.rho == 0.5


def test_every_stored_flag_of_an_old_run_is_a_flag_today(tmp_path, tiny):
    """train_config.json stores the flat flags; a run's stored settings build a TrainConfig again."""
    train.main([*FLAGS, "--out", str(tmp_path / "a")])
    stored = json.loads((tmp_path / "a" / "checkpoint-000002" / "train_config.json").read_text())
    assert stored == TrainConfig(**stored).flags()


@pytest.mark.slow  # an end-to-end run (train, resume or export): -m slow
def test_a_yaml_file_and_a_runs_train_config_reproduce_the_ledger_and_flags_beside_win(tmp_path, tiny):
    train.main([*FLAGS, "--out", str(tmp_path / "flags")])
    want = results(tmp_path / "flags")
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("preset: tiny\nsteps: 2\nreport-to: none\nsave_every: 0\npolicy: entropy\nrho: 0.5\n"
                         "sample-temperature: 1.2\nloss_temperature: 1.1\nmax-response-len: 6\n")  # fmt: skip
    train.main(["--config", str(yaml_file), "--out", str(tmp_path / "yaml")])
    assert results(tmp_path / "yaml") == want
    stored = tmp_path / "flags" / "checkpoint-000002" / "train_config.json"
    train.main(["--config", str(stored), "--out", str(tmp_path / "json")])
    assert results(tmp_path / "json") == want
    train.main(["--config", str(yaml_file), "--rho", "0.25", "--out", str(tmp_path / "beside")])
    again = json.loads((tmp_path / "beside" / "checkpoint-000002" / "train_config.json").read_text())
    assert again["rho"] == 0.25 and again["policy"] == "entropy"  # the flag wins, the file gives the rest
    assert [r["budget"] for r in results(tmp_path / "beside")] == [r["candidates"] // 4 for r in want]


def test_print_config_is_a_config_file_of_the_merged_settings(tmp_path, capsys):
    flags = train.main(["--method", "opsd", "--rho", "0.5", "--policy", "random", "--print-config"])
    text = capsys.readouterr().out
    assert "# lora (opd.models.settings.LoRAConfig)" in text and "lora_r: 64" in text and "rho: 0.5" in text
    (tmp_path / "c.yaml").write_text(text)
    assert resolve(read_config_file(str(tmp_path / "c.yaml"))).flags() == flags
    assert not (tmp_path / "runs").exists()  # printing trains nothing


@pytest.mark.parametrize("text,words", [
    ("rho: 0.5\nlora_rank: 8\n", ["c.yaml:2", "unknown key 'lora_rank'", "lora_r"]),
    ("rho: fast\n", ["c.yaml:1", "rho: expected a number"]),
    ("steps: 2.5\n", ["c.yaml:1", "steps: expected an integer"]),
    ("- rho\n", ["maps flag names to values"]),
    ("rho: [0.5\n", ["c.yaml", "not a YAML or JSON config"]),
])  # fmt: skip
def test_a_bad_config_file_is_one_line_naming_the_file_line_and_key(tmp_path, text, words):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        read_config_file(str(path))
    assert all(w in str(err.value) for w in words), str(err.value)
    assert "\n" not in str(err.value)


def test_a_bad_config_file_reports_every_problem_at_once_one_line_each(tmp_path, capsys):
    """Unknown keys, wrong types and values the settings refuse, all in one error (it stopped at the first), one line
    per problem naming the file, line and key, in the file's order; a flag given beside the file replaces its value
    (and its problem); exit code 2 through train.py's command line."""
    path = tmp_path / "run.yaml"
    path.write_text("preset: tiny\nrhoo: 0.5\nlr: fast\nrho: 5\nsteps: -1\nlora_rank: 8\n")
    with pytest.raises(UserError) as err:
        train.main(["--config", str(path)])
    assert str(err.value).splitlines() == [
        f"{path}:2: unknown key 'rhoo'; did you mean rho? (keys are train.py's flag names)",
        f"{path}:3: lr: expected a number, got 'fast'",
        f"{path}:4: --rho 5.0: the query ratio must lie in (0, 1]",
        f"{path}:5: --steps -1: must be >= 0",
        f"{path}:6: unknown key 'lora_rank'; did you mean lora_r? (keys are train.py's flag names)",
    ]  # fmt: skip
    with pytest.raises(UserError) as err:
        train.main(["--config", str(path), "--rho", "0.5", "--steps", "2"])
    assert len(str(err.value).splitlines()) == 3 and "--rho" not in str(err.value)
    with pytest.raises(UserError) as err:  # --print-config trains nothing but reads the file alike
        train.main(["--config", str(path), "--print-config"])
    assert len(str(err.value).splitlines()) == 3
    with pytest.raises(UserError) as err:
        read_config_file(str(path))
    assert len(str(err.value).splitlines()) == 3
    with pytest.raises(SystemExit) as code:
        from opd.cli import run_cli

        run_cli(train.main, ["--config", str(path)], "train.py")
    assert code.value.code == 2
    err_lines = capsys.readouterr().err.splitlines()
    assert len(err_lines) == 5 and err_lines[0].startswith(f"train.py: error: {path}:2: unknown key")


def test_non_finite_floats_and_unused_flags_are_refused_by_name():
    for flags, words in (({"lr": float("inf")}, "--lr inf: must be a finite number"),
                         ({"sample_temperature": float("nan")}, "--sample-temperature nan"),
                         ({"loss_temperature": float("inf")}, "--loss-temperature inf"),
                         ({"lora_alpha": 16.0}, "--lora-alpha has no effect without --lora-r"),
                         ({"lora_targets": "q_proj"}, "--lora-targets has no effect without --lora-r"),
                         ({"eval_data": "d"}, "--eval-data has no effect without --eval-every"),
                         ({"vllm_url": "http://x"}, "--vllm-url http://x has no effect with --rollout-engine hf"),
                         ({"report_to": "tensorboard,none"}, "'none' means no tracker")):  # fmt: skip
        problems = TrainConfig(**flags).problems()
        assert any(words in p for p in problems), (words, problems)
    dropout = TrainConfig(lora_r=4, lora_dropout=1.5).problems()
    assert dropout == ["--lora-dropout 1.5: must lie in [0, 1)"]  # alpha is not blamed


LOADED = """
import contextlib, io, runpy, sys
sys.argv = ["train.py", *sys.argv[1:]]
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    runpy.run_path(TRAIN, run_name="__main__")
print(",".join(m for m in ("torch", "transformers", "accelerate", "peft") if m in sys.modules))
"""


@pytest.mark.parametrize("argv", [["--help"], ["--print-config"], ["--method", "dapd", "--lora-r", "8", "--print-config"],
                                  ["--config", "{file}", "--print-config"]])  # fmt: skip
def test_help_and_print_config_load_neither_torch_nor_transformers(tmp_path, argv):
    """train.py --help and --print-config read the settings only (opd.config and the modules of its sections, the
    method table and its objectives' specs): torch and transformers are imported only by the modules that compute, so
    neither is loaded here (they took 5-11 s of a 2-core machine's --help)."""
    root = Path(__file__).resolve().parents[1]
    (tmp_path / "run.yaml").write_text("preset: tiny\nrho: 0.5\n")
    argv = [a.format(file=tmp_path / "run.yaml") for a in argv]
    code = f"TRAIN = {str(root / 'train.py')!r}\n" + LOADED
    done = subprocess.run([sys.executable, "-c", code, *argv], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(root)}, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "", f"{argv} loaded {done.stdout.strip()}"
