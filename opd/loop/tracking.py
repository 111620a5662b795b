"""Experiment trackers through accelerate: TensorBoard, Weights & Biases, MLflow, trackio, Comet, Aim, ClearML,
DVCLive, SwanLab (`--report-to`, accelerate's names, comma-separated; `none` for none).

Every tracker is accelerate's own, started on the main process only, with the run's settings as its configuration
and each ledger row logged at its step under fixed namespaces (`metrics`): `loss/`, `select/`, `cost/` and the
objective's own (`dapd/kl_*`, `opod/beta_*`, ...). TensorBoard writes DIR/tb, MLflow the SQLite store DIR/mlflow.db
(unless MLFLOW_TRACKING_URI says otherwise), W&B DIR/wandb; a resumed run continues the same tracker run where the
tracker allows (DIR/trackers.json). Trackers but TensorBoard are optional installs: a missing one is a one-line
error. --eval-before's scores reach every tracker at step 0 as `eval/before/<name>`.
Details: docs/MODULES.md#opdlooptracking.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import sys
import uuid
from pathlib import Path

from accelerate.tracking import LOGGER_TYPE_TO_CLASS

from opd.loop.settings import MLFLOW_DB, TrackerConfig
from opd.storage import write_atomic

STATE = "trackers.json"
BEFORE = "eval/before/"
"""The trackers' namespace of --eval-before's scores (`eval/zoombench` before training -> `eval/before/zoombench`)."""
VALID = re.compile(r"[^A-Za-z0-9_\-. :/]")
"""What a metric name may not hold in some tracker (MLflow allows alphanumerics, _ - . space : and /; the others
are laxer)."""


def metric_name(key: str) -> str:
    """A metric's name, valid in every tracker accelerate offers: each other character becomes '_'
    ('eval/zoombench@crop' -> 'eval/zoombench_crop'). The one mapping from a ledger field to a tracker name."""
    return VALID.sub("_", key)


def _scalar(value):
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


TIMES = ("prompt_s", "generation_s", "select_s", "teacher_forward_s", "student_s", "optimizer_s", "ema_s",
         "selector_s", "wait_s", "step_s")  # fmt: skip
SELECT = ("rollouts", "candidates", "budget", "selected", "overrun", "utility_mean", "candidate_prompts",
          "selected_prompts", "min_pi", "max_weight", "replay_size", "labels_added")  # fmt: skip
COST = ("teacher_rows", "scored_tokens", "candidate_tokens", "teacher_tokens", "teacher_padded_tokens")


def metrics(row: dict, objective: str = "", objective_keys=()) -> dict[str, float]:
    """A ledger row as tracker scalars in the fixed namespaces (non-finite and non-numeric values left out)."""
    out = {"loss/distill": row.get("loss"), "loss/grad_norm": row.get("grad_norm"), "loss/selector": row.get("selector"),
           "loss/skipped": float(row.get("skipped", False)), "optim/lr": row.get("lr")}  # fmt: skip
    out |= {f"select/{k}": row.get(k) for k in SELECT}
    if row.get("candidate_prompts"):
        out["select/prompt_coverage"] = row["selected_prompts"] / row["candidate_prompts"]
    out |= {f"cost/{k}": row.get(k) for k in (*COST, *TIMES)}
    for key, value in row.items():
        if key.startswith(("teacher_rows_", "teacher_tokens_", "teacher_forward_s_")):
            out[f"cost/{key}"] = value
    out |= {key: row[key] for key in row if key.startswith("eval/")}  # opd.eval.live's scores
    out["cost/eval_s"] = row.get("eval_s")
    before = row.get("eval_before") if isinstance(row.get("eval_before"), dict) else {}  # --eval-before's, step 0
    out |= {BEFORE + k.removeprefix("eval/"): v for k, v in before.items() if k.startswith("eval/")}
    out["cost/eval_before_s"] = before.get("eval_s")
    prefix = objective or "objective"
    out |= {f"{prefix}/{k}": row.get(k) for k in objective_keys}
    return {metric_name(k): float(v) for k, v in out.items() if _scalar(v) is not None and math.isfinite(float(v))}


class Trackers:
    """The run's trackers (none when `names` is empty): started on the main process, resumed where they can be."""

    def __init__(self, accelerator, names: list[str], out: Path, project: str, run_name: str, config: dict,
                 resume: bool, settings: TrackerConfig | None = None):  # fmt: skip
        self.acc, self.names, self.out = accelerator, names, Path(out)
        self.state: dict = {}
        self.settings = settings or TrackerConfig()
        self._set_env: list[str] = []  # what this run set in the process's environment (MLflow's), for finish()
        if not names:
            return
        path = self.out / STATE
        if resume and path.is_file():
            self.state = json.loads(path.read_text())
        trackers = []
        for name in names:
            cls = LOGGER_TYPE_TO_CLASS[name]
            if name == "tensorboard":
                trackers.append(cls("tb", str(self.out)))  # DIR/tb
            elif name == "mlflow":
                trackers.append(self._mlflow(cls, project, run_name))
            elif name == "wandb":
                trackers.append(self._wandb(cls, project, run_name))
            elif cls.requires_logging_directory:
                trackers.append(cls(project, str(self.out)))
            else:
                trackers.append(cls(project))
        accelerator.log_with = trackers
        accelerator.init_trackers(project, config=None if resume else _config(config))  # logged once, at the start
        if accelerator.is_main_process:
            if "mlflow" in names:
                self.state["mlflow"] = accelerator.get_tracker("mlflow").tracker.info.run_id
            write_atomic(path, json.dumps(self.state, indent=1) + "\n")

    def _wandb(self, cls, project: str, run_name: str):
        """W&B's tracker: its run id kept in DIR/trackers.json for a resume, its files under DIR/wandb, the entity,
        tags and group of the run's settings."""
        run_id = self.state.get("wandb") or uuid.uuid4().hex[:12]
        (self.out / "wandb").mkdir(parents=True, exist_ok=True)
        s = self.settings
        extra = {k: v for k, v in (("entity", s.wandb_entity or os.environ.get("WANDB_ENTITY")),
                                   ("tags", s.tags or None), ("group", s.tracker_group)) if v}  # fmt: skip
        self.state["wandb"] = run_id
        return cls(project, id=run_id, resume="allow", name=run_name, dir=str(self.out), **extra)

    def _mlflow(self, cls, project: str, run_name: str):
        """MLflow's tracker on its store (`mlflow_store`), kept in DIR/trackers.json; the run's tags and group as
        MLflow's tags; artifacts (none logged here) under DIR/mlartifacts, not the working directory's ./mlruns."""
        uri = mlflow_store(self.out, self.state)
        self.state["mlflow_uri"] = uri
        logging_dir = None
        if not os.environ.get("MLFLOW_TRACKING_URI") and self.acc.is_main_process:
            mlflow = _import_mlflow()
            if uri.startswith("file:") and "MLFLOW_ALLOW_FILE_STORE" not in os.environ:  # a run begun before the
                os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # SQLite default: MLflow 3 keeps its file store opt-in
                self._set_env.append("MLFLOW_ALLOW_FILE_STORE")
            elif not uri.startswith("file:"):
                logging_dir = (self.out / "mlartifacts").resolve().as_uri()
            mlflow.set_tracking_uri(uri)  # which also sets $MLFLOW_TRACKING_URI: unset again by finish()
            self._set_env.append("MLFLOW_TRACKING_URI")
        s = self.settings
        tags = {t: "true" for t in s.tags} | ({"group": s.tracker_group} if s.tracker_group else {})
        return cls(experiment_name=project, logging_dir=logging_dir, run_id=self.state.get("mlflow"), run_name=run_name,
                   tags=tags or None)  # fmt: skip

    def where(self) -> list[str]:
        """Where each tracker writes, in words, for the run's first lines: with the command that reads it back."""
        tb = self.out / "tb"
        board = f"{venv_command('tensorboard')} --logdir {shlex.quote(str(tb))}"
        places = {"tensorboard": f"TensorBoard logs in {tb} ({board})",
                  "wandb": f"W&B run files in {self.out / 'wandb'} (project {self.settings.project})",
                  "mlflow": mlflow_where(self.state.get("mlflow_uri") or mlflow_store(self.out, self.state))}  # fmt: skip
        return [places.get(n, f"{n} (project {self.settings.project})") for n in self.names]

    def log(self, row: dict, objective: str = "", objective_keys=()) -> None:
        if self.names:
            self.acc.log(metrics(row, objective, objective_keys), step=int(row["step"]))

    def finish(self) -> None:
        """Ends the tracker runs (not `Accelerator.end_training`, which also destroys the process group)."""
        if self.names and self.acc.is_main_process:
            for tracker in self.acc.trackers:
                tracker.finish()
            self.acc.trackers = []
        if "MLFLOW_TRACKING_URI" in self._set_env:  # the process's MLflow as before the run: a later run in the same
            # process (a test, an experiment script) must not take this store for the user's
            _import_mlflow().set_tracking_uri(None)
        for name in self._set_env:
            os.environ.pop(name, None)
        self._set_env = []


def _import_mlflow():
    """The `mlflow` package, imported only for a run that reports to MLflow."""
    import mlflow  # optional: requirements-trackers.txt (mlflow-skinny), only for --report-to mlflow

    return mlflow


def _config(config: dict) -> dict:
    """The run's settings as tracker hyperparameters (bool, str, float, int; None as '')."""
    return {k: ("" if v is None else v) for k, v in config.items() if isinstance(v, (bool, str, float, int)) or v is None}


def mlflow_store(out: Path, state: dict) -> str:
    """MLflow's tracking URI for the run in `out`: $MLFLOW_TRACKING_URI if set; else the one DIR/trackers.json keeps
    (a resume); else a run that already has an MLflow run id from before the SQLite default (its file store
    DIR/mlruns); else SQLite DIR/mlflow.db, the store MLflow recommends and reads by default."""
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if state.get("mlflow_uri"):
        return state["mlflow_uri"]
    if state.get("mlflow"):
        return (Path(out) / "mlruns").resolve().as_uri()
    return "sqlite:///" + str((Path(out) / MLFLOW_DB).resolve())


def venv_command(name: str) -> str:
    """The command `name` as this interpreter's environment installs it (.venv/bin/tensorboard beside .venv/bin/python,
    relative to the current folder when below it), so that a printed hint runs as printed; else on $PATH, as is."""
    path = Path(sys.executable).parent / name
    if not path.is_file():
        return shutil.which(name) or name
    with contextlib.suppress(ValueError):
        return str(path.relative_to(Path.cwd()))
    return str(path)


MLFLOW_READ = ('import mlflow; [print(r.info.run_name, r.info.status, r.data.metrics) '
               'for r in mlflow.search_runs(search_all_experiments=True, output_format="list")]')
"""The read-back of an MLflow store with mlflow-skinny (requirements-trackers.txt): each run's name, status and last
metrics. `mlflow ui` is the full `mlflow` package's (it needs flask, which mlflow-skinny leaves out;
docs/TRAINING.md)."""


def mlflow_where(uri: str) -> str:
    """Where MLflow writes and a command that reads it back with what requirements-trackers.txt installs (a Python
    one-liner on MLflow's client API, `MLFLOW_READ`; the UI, `mlflow ui`, needs the full mlflow package); a file
    store needs MLFLOW_ALLOW_FILE_STORE=true in MLflow 3, whose defaults refuse it."""
    if uri.startswith(("http://", "https://", "databricks")):
        return f"MLflow runs at {uri}"
    read = f"MLFLOW_TRACKING_URI={shlex.quote(uri)} {venv_command('python')} -c {shlex.quote(MLFLOW_READ)}"
    if not uri.startswith(("sqlite:", "postgresql", "mysql", "mssql")):
        read = "MLFLOW_ALLOW_FILE_STORE=true " + read
    return f"MLflow runs in {uri} (read them back: {read})"
