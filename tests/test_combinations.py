"""Features that meet: a pairwise covering set of the run's features, each case 2 steps of train.py on the tiny
vLLM-servable model (`opd.tiny.build_tiny_vllm_model`, so that every case may use either engine).

Factors: method {bas-opd, opsd (its LoRA recipe), dapd, opod, gkd} x ranks {1, 2 DDP, 2 FSDP} x LoRA {off, on} x
trackers {tensorboard, mlflow, wandb offline} x live evaluation {off, full+crop} x engine {hf, vllm} x selection
{learned, unbiased, capped}. `covering` picks cases until every pair of two factors' levels is in one (checked);
each case must exit 0, obey Eq. 4 in its ledger (K = floor(rho |C|), |S| <= K; exactly K when sampled), and leave
every step's metrics in its tracker, read back with the tracker's own reader; one case also resumes. The vLLM
cases use the session's server (tests/vllm_fixtures.py) and skip, saying why, without the vLLM venv.
"""

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_fixtures import write_all_fixtures
from tracker_readers import mlflow_history, tensorboard_scalars, wandb_history

import train
from opd.cli import UserError
from opd.ledger import read_ledger

ROOT = Path(__file__).resolve().parents[1]
FACTORS = {
    "method": ["bas-opd", "opsd", "dapd", "opod", "gkd"],
    "ranks": ["1", "ddp", "fsdp"],
    "lora": ["off", "on"],
    "tracker": ["tensorboard", "mlflow", "wandb"],
    "live": ["off", "full+crop"],
    "engine": ["hf", "vllm"],
    "selection": ["learned", "unbiased", "capped"],
}


def pairs_of(case: dict) -> set:
    return {((a, case[a]), (b, case[b])) for a, b in itertools.combinations(FACTORS, 2)}


def covering() -> list[dict]:
    """A deterministic greedy pairwise covering set: each new case starts from the first uncovered pair and fills
    every other factor with the level that covers most uncovered pairs with the levels chosen so far."""
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(FACTORS, 2) for x in FACTORS[a] for y in FACTORS[b]}
    cases = []
    while uncovered:
        (a, x), (b, y) = min(uncovered, key=lambda p: (list(FACTORS).index(p[0][0]), list(FACTORS).index(p[1][0]), p))
        case = {a: x, b: y}
        for f in FACTORS:
            if f in case:
                continue
            gain = lambda v: sum(((g, case[g]), (f, v)) in uncovered or ((f, v), (g, case[g])) in uncovered  # noqa: E731
                                 for g in case)  # fmt: skip
            case[f] = max(FACTORS[f], key=lambda v: (gain(v), -FACTORS[f].index(v)))
        case = {f: case[f] for f in FACTORS}
        cases.append(case)
        uncovered -= pairs_of(case)
    return cases


CASES = covering()
REFUSED = {("opsd", "unbiased"): ("--unbiased weighs Eq. 11's token mean (its Hajek form) or a token sum",
                                  ["--loss-agg", "token-mean"])}  # fmt: skip
"""(method, selection) pairs refused by design, with the one-line refusal and the flags that resolve it (the case
then runs with them, so that its other pairs are still exercised): OPSD's recipe averages per sequence, which the
unbiased estimators' token weights do not apply to."""


def test_the_cases_cover_every_pair_of_two_factors():
    covered = set().union(*(pairs_of(c) for c in CASES))
    every = {((a, x), (b, y)) for a, b in itertools.combinations(FACTORS, 2) for x in FACTORS[a] for y in FACTORS[b]}
    assert covered == every
    assert len(CASES) <= 20  # a covering set, not the 5 x 3 x 2 x 3 x 2 x 2 x 3 = 1080 product


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """The models (policy and a separate teacher, vLLM-servable), the tiny data and a benchmark folder."""
    from opd.tiny import build_tiny_dataset, build_tiny_vllm_model

    root = tmp_path_factory.mktemp("combinations")
    bench = root / "bench"
    write_all_fixtures(bench)
    return {"model": build_tiny_vllm_model(root / "policy", seed=0), "teacher": build_tiny_vllm_model(root / "teacher", seed=1),
            "data": build_tiny_dataset(root / "data"), "bench": bench}  # fmt: skip


def flags_of(case: dict, world: dict, out: Path, url: str | None) -> list[str]:
    flags = ["--preset", "tiny", "--model", str(world["model"]), "--data", str(world["data"]), "--steps", "2",
             "--max-response-len", "6", "--method", case["method"], "--rho", "0.25", "--report-to", case["tracker"],
             "--lora-r", "4" if case["lora"] == "on" else "0", "--out", str(out)]  # fmt: skip
    flags += {"learned": ["--policy", "learned"], "unbiased": ["--policy", "learned", "--unbiased"],
              "capped": ["--policy", "learned", "--max-per-prompt", "2"]}[case["selection"]]  # fmt: skip
    if case["method"] in ("opod", "gkd"):
        flags += ["--teacher-model", str(world["teacher"])]
    if case["live"] != "off":
        flags += ["--eval-every", "2", "--eval-data", str(world["bench"]), "--eval-benchmarks", "zoombench",
                  "--eval-views", "full,crop", "--eval-limit", "4", "--eval-max-new-tokens", "4"]  # fmt: skip
    if case["ranks"] == "fsdp":
        flags += ["--fsdp"]
    if case["engine"] == "vllm":
        flags += ["--rollout-engine", "vllm", "--vllm-url", url]
    return flags


def run(case: dict, flags: list[str], refused: str | None = None) -> None:
    """One rank in this process; two under torchrun (gloo). `refused`: the one-line refusal expected instead."""
    if case["ranks"] == "1":
        if refused is None:
            train.main(flags)
            return
        with pytest.raises(UserError) as err:
            train.main(flags)
        assert refused in str(err.value) and "\n" not in str(err.value)
        return
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "train.py"), *flags]  # fmt: skip
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    if refused is not None:
        lines = [x for x in proc.stderr.splitlines() if x.startswith("train.py: error:")]
        assert proc.returncode != 0 and len(lines) == 1 and refused in lines[0], proc.stderr[-2000:]
        return
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def tracker_steps(case: dict, out: Path) -> list[int]:
    """The steps at which the case's tracker holds loss/distill, read with the tracker's own reader."""
    if case["tracker"] == "tensorboard":
        return [s for s, _ in tensorboard_scalars(out / "tb")["loss/distill"]]
    if case["tracker"] == "wandb":
        return [h["_step"] for h in wandb_history(out) if "loss/distill" in h]
    return [s for s, _ in mlflow_history(out, "loss/distill")]


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CASES)), ids=lambda i: "-".join(CASES[i].values()))
def test_a_combination_trains_obeys_the_budget_and_logs(index, world, tmp_path, request, monkeypatch):
    case = CASES[index]
    for module in ({"mlflow": "mlflow", "wandb": "wandb"}.get(case["tracker"]),):
        if module:
            pytest.importorskip(module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    url = None
    if case["engine"] == "vllm":
        engine = request.getfixturevalue("vllm_engine")  # skips without the vLLM venv
        url = engine.server.url
    out = tmp_path / "run"
    flags = flags_of(case, world, out, url)
    refused = REFUSED.get((case["method"], case["selection"]))
    if refused is not None:  # the one-line refusal first, then the case with the pair resolved
        run(case, flags, refused[0])
        flags += refused[1]
    try:
        run(case, flags)
        resumed = index == 0  # one resume among the cases (one rank, this process)
        if resumed:
            train.main(["--resume", str(out), "--steps", "3"])
    finally:
        if url is not None:
            engine.server.push_weights(engine.model_a)  # the session's server gets its model back
    rows = read_ledger(out / "ledger.jsonl")
    assert [r["step"] for r in rows] == list(range(3 if resumed else 2))
    for r in rows:
        assert r["budget"] == int(0.25 * r["candidates"] + 1e-9) and r["selected"] <= r["budget"]  # Eq. 4
        if case["selection"] == "unbiased":
            assert r["selected"] == r["budget"] and "max_weight" in r
        assert r["world_size"] == (1 if case["ranks"] == "1" else 2)
    if case["live"] != "off":
        assert {"eval/zoombench", "eval/zoombench_crop"} <= set(rows[1])
    assert sorted(set(tracker_steps(case, out))) == [r["step"] for r in rows]
