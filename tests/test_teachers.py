"""External teachers (opd/models/external_teachers.py): `--teacher-model` in place of the EMA self-teacher, `--teachers` routing a
record field to teacher checkpoints (each run only on the selected rows routed to it), the tokenizer check, the
routing file's errors, checkpoints and resume."""

import json
import shutil

import pytest
import torch
from test_training import TIMING, params_of, small_config

import train
from opd.cli import UserError
from opd.data.sources import load_records
from opd.data.routes import load_routes
from opd.loop.ledger import read_ledger
from opd.run import Run
from opd.engine.synthetic import fixed_rollouts
from opd.tiny import build_tiny_model


@pytest.fixture(scope="module")
def teacher_models(tmp_path_factory):
    """Two tiny checkpoints with the policy's tokenizer and other weights (seeds 1 and 2)."""
    root = tmp_path_factory.mktemp("teachers")
    return build_tiny_model(root / "t1", seed=1), build_tiny_model(root / "t2", seed=2)


def routed_data(data, field="task"):
    """The tiny data with a routing field: 'count' on every third line, 'colour' on the others."""
    lines = data.read_text().splitlines()
    rows = [json.loads(line) | {field: "count" if i % 3 == 0 else "colour"} for i, line in enumerate(lines)]
    out = data.parent / f"routed_{field}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def route_file(tmp_path, teachers: dict, default=None, field="task"):
    path = tmp_path / "route.json"
    path.write_text(json.dumps({"field": field, "teachers": teachers} | ({"default": default} if default else {})))
    return path


def test_records_keep_other_fields_for_routing(tiny):
    records = load_records(routed_data(tiny[1]))
    assert records[0].field("task") == "count" and records[1].field("task") == "colour"
    assert records[0].field("nothing") is None


def test_routing_runs_only_the_routed_teacher_on_its_rows(tmp_path, tiny, teacher_models):
    """Two frozen teachers by the records' `task`: each one's forwards hold exactly the selected rows routed to it
    (their responses), each checkpoint loaded once, neither moves; the ledger counts rows and tokens per teacher."""
    t1, t2 = teacher_models
    routes = route_file(tmp_path, {"colour": str(t1), "count": str(t2)})
    run = Run(small_config(tmp_path, data=str(routed_data(tiny[1])), teachers=str(routes), policy="random", rho=0.5))
    assert run.teachers.names == ["colour", "count"] and run.teacher is run.teachers.teachers["colour"]
    teachers_before = {n: params_of(t.model) for n, t in run.teachers.teachers.items()}
    seen = {n: [] for n in run.teachers.names}
    for n, t in run.teachers.teachers.items():
        t.model.register_forward_pre_hook(lambda m, a, kw, n=n: seen[n].append(kw["input_ids"].clone()), with_kwargs=True)
    select = run.selector.select
    chosen = []
    run.selector.select = lambda *a, **k: chosen.append(select(*a, **k)) or chosen[-1]
    for step in range(2):
        for v in seen.values():
            v.clear()
        ro = fixed_rollouts(run, step)
        row = run.step(step, ro)
        run.log(row)
        records = run.prompts.of_step(step)
        routed = {n: [i for i in chosen[-1][0].tolist() if records[int(ro.prompt_index[i])].field("task") == n] for n in seen}
        assert sum(len(v) for v in routed.values()) == row["selected"] > 0
        pad = run.ids["pad"]
        for n, rows in routed.items():
            want = sorted(tuple(ro.response_ids[i, : int(ro.lengths[i])].tolist()) for i in rows)
            got = []
            for batch in seen[n]:  # each input row: prompt, then its response, then right padding
                for r in batch.tolist():
                    while r and r[-1] == pad:
                        r.pop()
                    got.append(next(x for x in want if tuple(r[-len(x):]) == x))
            assert sorted(got) == want and len(got) == row[f"teacher_rows_{n}:crop"], n
        assert row["teacher_rows"] == row["selected"]
        assert row["teacher_tokens"] == row["teacher_tokens_colour:crop"] + row["teacher_tokens_count:crop"]
    for n, t in run.teachers.teachers.items():  # frozen
        assert all(torch.equal(v, params_of(t.model)[k]) for k, v in teachers_before[n].items())
    summary = run.finish()
    assert set(summary["teacher_models"]) == {"colour", "count"}
    assert sum(t["rows"] for t in summary["teacher_models"].values()) == summary["calls"]


def test_one_checkpoint_for_several_routes_is_loaded_once(tmp_path, tiny, teacher_models):
    routes = route_file(tmp_path, {"colour": str(teacher_models[0]), "count": str(teacher_models[0])})
    run = Run(small_config(tmp_path, data=str(routed_data(tiny[1])), teachers=str(routes), policy="full", rho=1.0))
    t = run.teachers.teachers
    assert t["colour"] is t["count"]
    row = run.step(0, fixed_rollouts(run, 0))
    assert row["teacher_rows"] == row["selected"] == row["teacher_rows_colour:crop"] + row["teacher_rows_count:crop"]


def test_teacher_model_replaces_the_ema_teacher_and_resumes(tmp_path, tiny, teacher_models):
    """--teacher-model: a frozen external teacher for a family method; checkpoints do not hold it (it is reloaded
    from its path) and a resumed run equals the uninterrupted one."""
    kw = dict(teacher_model=str(teacher_models[0]), policy="random", rho=0.5, steps=3, save_every=2)
    whole = Run(small_config(tmp_path / "whole", **kw))
    before = params_of(whole.teacher.model)
    whole.train()
    assert all(torch.equal(v, params_of(whole.teacher.model)[k]) for k, v in before.items())  # no EMA
    ckpt = tmp_path / "whole" / "run" / (tmp_path / "whole" / "run" / "latest").read_text().strip()
    assert not (ckpt / "teacher").exists() and (ckpt / "policy").is_dir()
    Run(small_config(tmp_path / "split", **{**kw, "steps": 2})).train()
    resumed = Run(small_config(tmp_path / "split", **kw, resume=str(tmp_path / "split" / "run")))
    assert resumed.start == 2
    resumed.train()
    for k, v in params_of(whole.model).items():
        torch.testing.assert_close(params_of(resumed.model)[k], v, rtol=0, atol=1e-6)
    ra, rb = (read_ledger(tmp_path / d / "run" / "ledger.jsonl") for d in ("whole", "split"))
    for x, y in zip(ra, rb, strict=True):
        for key in x.keys() - TIMING - {"launch"} - {k for k in x if k.startswith("teacher_forward_s_")}:
            assert x[key] == pytest.approx(y[key], rel=1e-6, nan_ok=True), key


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path, tiny, teacher_models):
    other = tmp_path / "other"
    shutil.copytree(teacher_models[0], other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["A"], vocab["B"] = vocab["B"], vocab["A"]  # two letters' ids swapped
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(UserError, match=r"--teacher-model .*other: its tokenizer differs from the policy's \(token 'A' has id"):
        Run(small_config(tmp_path, teacher_model=str(other)))


def test_routing_files_and_unrouted_records_are_refused_in_one_line(tmp_path, tiny, teacher_models):
    with pytest.raises(UserError, match="routing file not found"):
        load_routes(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    for text, message in (("{", "malformed JSON"), ('{"teachers": {"a": "x"}}', "expected"),
                          ('{"field": "task", "teachers": {}}', "at least one"),
                          ('{"field": "task", "teachers": {"a": "x"}, "default": "b"}', "default route 'b'"),
                          ('{"field": "task", "teachers": {"a": "x"}, "routes": 1}', "unknown keys routes")):  # fmt: skip
        bad.write_text(text)
        with pytest.raises(UserError, match=message):
            load_routes(bad)
    routes = route_file(tmp_path, {"colour": str(teacher_models[0])})
    with pytest.raises(UserError, match=r"routed_task.jsonl:1: field 'task': 'count' has no teacher .*add \"default\""):
        Run(small_config(tmp_path, data=str(routed_data(tiny[1])), teachers=str(routes), out=str(tmp_path / "a")))
    routes = route_file(tmp_path, {"colour": str(teacher_models[0])}, default="colour")
    run = Run(small_config(tmp_path, data=str(routed_data(tiny[1])), teachers=str(routes), out=str(tmp_path / "b")))
    assert all(run.teachers.route(r) == "colour" for r in run.records)


@pytest.mark.parametrize("flags,message", [
    (["--method", "opod"], "--method opod distils from a separate teacher checkpoint"),
    (["--method", "dapd", "--teacher-model", "x"], "--method dapd anchors on the policy's own weights"),
    (["--teacher-model", "x", "--teachers", "y.json"], "--teacher-model gives one teacher and --teachers"),
    (["--ema-every", "0"], "--ema-every 0"),
    (["--method", "dapd", "--is-clip", "2"], "--method dapd: --is-clip does not apply \(its clamped KL"),
    (["--opod-beta-min", "3"], "--opod-beta-min 3.0"),
])  # fmt: skip
def test_impossible_teacher_combinations_are_refused_by_name(tmp_path, flags, message):
    with pytest.raises(UserError, match=message):
        train.main(["--preset", "tiny", *flags, "--out", str(tmp_path)])


def test_teacher_names_tiny_and_run_folders(tmp_path, tiny):
    """'tiny' is the built-in model; a train.py run folder (or a checkpoint folder) is its exported policy/; a
    checkpoint folder or hub id is kept; a run folder whose checkpoint has no policy/ is refused in one line."""
    from opd.builtin import teacher_source

    assert teacher_source("tiny") == str(tiny[0])
    ckpt = tmp_path / "run" / "checkpoint-000002"
    (ckpt / "policy").mkdir(parents=True)
    (ckpt / "state.pt").write_bytes(b"")
    (tmp_path / "run" / "latest").write_text("checkpoint-000002\n")
    assert teacher_source(str(tmp_path / "run")) == teacher_source(str(ckpt)) == str(ckpt / "policy")
    assert teacher_source(str(tiny[0])) == str(tiny[0]) and teacher_source("Qwen/Qwen3.5-4B") == "Qwen/Qwen3.5-4B"
    (ckpt / "policy").rmdir()
    with pytest.raises(UserError, match="holds no exported policy/"):
        teacher_source(str(tmp_path / "run"))
    (tmp_path / "run" / "latest").write_text("checkpoint-000009\n")
    with pytest.raises(UserError, match="names checkpoint-000009, which is missing"):
        teacher_source(str(tmp_path / "run"))


def test_the_tiny_defaults_route_file_routes_every_record_to_its_default(tmp_path, tiny):
    """The route file of opd/models/external_teachers.py's docstring (and the README) on the tiny default's own data: no record has
    the field, so every record goes to the default route, the built-in model, loaded once."""
    routes = tmp_path / "route.json"
    routes.write_text('{"field": "task", "teachers": {"colour": "tiny"}, "default": "colour"}')
    run = Run(small_config(tmp_path, method="opod", policy="full", rho=1.0, teachers=str(routes)))
    assert run.teachers.names == ["colour"] and all(run.teachers.route(r) == "colour" for r in run.records)
    assert run.teachers.teachers["colour"].model is not run.model
    row = run.step(0, fixed_rollouts(run, 0))
    assert row["teacher_rows_full"] == row["teacher_rows_verify"] == row["selected"] > 0
