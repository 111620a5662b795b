"""The run's settings: one section per component, one flag per field, and where each value comes from.

`TrainConfig` holds one section (an `opd.cli.Section` dataclass, with a docstring per field and its own `check()`)
per component, named in `SECTIONS`: `cfg.selection.rho`, `cfg.lora.r`, `cfg.dapd.clip`. Each field is one flag,
its name as it has always been (`--rho`, `--lora-r`, `--dapd-clip`); `TrainConfig(**flags)` builds the sections from
flag names, and `cfg.flags()` is the flat view that train_config.json stores, so every stored one still resumes.

Where values come from, lowest first (`resolve`): the sections' defaults, the preset (`PRESETS`), the method's
paper settings and published recipe (`opd.methods.table`), a config file (`--config`: YAML with flag names as keys, or a
run's own train_config.json; `read_config_file`) and the flags given. `problems()` gathers every section's
`check()` and the few rules that tie two sections together (`cross_problems`).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from opd.cli import Flag, Section, UserError, flag_text, resumable
from opd.data.settings import DataConfig, TeacherConfig
from opd.engine.sampling import EngineConfig, SamplingConfig
from opd.eval.config import LiveEvalConfig
from opd.loop.settings import CheckpointConfig, FolderConfig, OptimConfig, TrackerConfig
from opd.maths.loss import LossConfig
from opd.methods.table import METHODS
from opd.models.settings import EMAConfig, LoRAConfig, ModelConfig
from opd.run_folder import checkpoint_of, find_latest, load_config, run_files
from opd.selection.config import PredictorConfig, SelectionConfig


@dataclass
class RunConfig(Section):
    """What is trained, how long, from which seed."""

    preset: str = "toy"
    """Starting values: 'toy' (the default: the toy world's base, trained on crops, distilled on its training split
    and scored before and after on its held-out items; CPU, about a minute plus a minute to build it once), 'tiny'
    (a random-weight tiny model on noise images: the tests' fast runs), 'paper-4b' / 'paper-9b' (the paper's tables)."""
    method: str = "bas-opd"
    """Method of the family (the table in opd/methods/table.py): sets its views, support, divergence, token weight (DAPD,
    OPOD, TM-OPD: their own objective), its paper's settings and its published recipe (under the flags given)."""
    steps: int = resumable(0)
    """Training steps; 0 = one epoch (floor(records / prompts_per_step), the paper's 111)."""
    seed: int = 42
    """Training seed: data order and rollout sampling."""

    @classmethod
    def flags(cls, section: str = "") -> list[Flag]:
        """The section's flags, --method's help naming every method of the table (so that it cannot go stale)."""
        return [dataclasses.replace(f, doc=f"{f.doc} One of: {', '.join(METHODS)}.") if f.attr == "method" else f
                for f in super().flags(section)]  # fmt: skip

    def check(self) -> list[str]:
        problems = []
        if self.preset not in PRESETS:
            problems.append(f"--preset {self.preset!r}: choose one of {', '.join(PRESETS)}")
        if self.method not in METHODS:
            problems.append(f"--method {self.method!r}: choose one of {', '.join(METHODS)}")
        if self.steps < 0:
            problems.append(f"--steps {self.steps}: must be >= 0")
        return problems


SECTIONS: dict[str, type[Section]] = {
    "run": RunConfig, "model": ModelConfig, "data": DataConfig, "folder": FolderConfig, "sampling": SamplingConfig,
    "engine": EngineConfig, "selection": SelectionConfig, "selector": PredictorConfig, "teacher": TeacherConfig,
    "ema": EMAConfig, "loss": LossConfig, "optim": OptimConfig, "lora": LoRAConfig, "checkpoint": CheckpointConfig,
    "trackers": TrackerConfig, "eval": LiveEvalConfig,
    **{m.objective.name: m.objective.Config for m in METHODS.values() if m.objective.Config is not None},
}  # fmt: skip
"""The sections of TrainConfig, by attribute name, in --help's order; the objectives' own (DAPD's `--dapd-*`,
OPOD's `--opod-*`) come from the method table, so that a new objective's section needs no line here."""


class TrainConfig:
    """The run's settings: one section per component (`SECTIONS`), built from flag names.

    `TrainConfig(rho=0.5, lora_r=8)` sets `cfg.selection.rho` and `cfg.lora.r`; an unknown name is a TypeError."""

    def __init__(self, **flags):
        known = {f.name: f for f in self.flag_list()}
        unknown = sorted(set(flags) - set(known))
        if unknown:
            raise TypeError(f"TrainConfig: unknown field(s) {', '.join(unknown)}")
        for name, cls in SECTIONS.items():
            setattr(self, name, cls(**{f.attr: flags[f.name] for f in cls.flags(name) if f.name in flags}))

    @classmethod
    def flag_list(cls) -> list[Flag]:
        """Every flag, section by section (`opd.cli.build_parser` reads it)."""
        return [f for name, section in SECTIONS.items() for f in section.flags(name)]

    def flags(self) -> dict:
        """The flat view: flag name -> value (train_config.json, the trackers' config, --print-config)."""
        return {f.name: getattr(getattr(self, f.section), f.attr) for f in self.flag_list()}

    def replace(self, **flags) -> TrainConfig:
        return TrainConfig(**{**self.flags(), **flags})

    def __eq__(self, other) -> bool:
        return isinstance(other, TrainConfig) and self.flags() == other.flags()

    def __repr__(self) -> str:
        return "TrainConfig(" + ", ".join(f"{k}={v!r}" for k, v in self.flags().items()) + ")"

    @property
    def method(self):
        """The method's row of the table (`opd.methods.table.Method`)."""
        return METHODS[self.run.method]

    def objective(self) -> Section | None:
        """The method's objective's own section (e.g. `cfg.dapd`), or None when it has none."""
        cls = self.method.objective
        return getattr(self, cls.name) if cls.Config is not None else None

    def problems(self, world: int = 1) -> list[str]:
        """Everything wrong with these settings on `world` processes, one phrase each naming the flag."""
        found = [p for name in SECTIONS for p in getattr(self, name).problems()]
        return found + (cross_problems(self, world) if self.run.method in METHODS else [])

    def check(self, world: int = 1) -> None:
        """A one-line UserError listing every problem."""
        problems = self.problems(world)
        if problems:
            raise UserError("; ".join(problems))

    def to_yaml(self) -> str:
        """The settings as a config file for --config: flag names as keys, one comment per section."""
        lines = []
        for name, section in SECTIONS.items():
            lines.append(f"# {name} ({section.__module__}.{section.__name__})")
            lines += [f"{f.name}: {json.dumps(getattr(getattr(self, name), f.attr))}" for f in section.flags(name)]
        return "\n".join(lines) + "\n"


def cross_problems(cfg: TrainConfig, world: int) -> list[str]:
    """The rules that tie two sections together (each section checks its own fields)."""
    sel, loss, sampling, method = cfg.selection, cfg.loss, cfg.sampling, cfg.method
    problems = []
    if cfg.data.prompts_per_step % world:
        problems.append(f"--prompts-per-step {cfg.data.prompts_per_step} does not split over {world} processes")
    if sel.unbiased and loss.aggregation not in ("token-mean", "token-sum"):
        problems.append("--unbiased weighs Eq. 11's token mean (its Hajek form) or a token sum: it needs --loss-agg "
                        "token-mean or token-sum")
    if loss.is_clip and not sampling.untruncated:
        problems.append("--is-clip's ratio compares the student with the sampling distribution: it needs untruncated "
                        "sampling (--sample-top-p 1 --sample-top-k 0)")
    elif loss.is_clip and sampling.temperature != loss.temperature:
        problems.append(f"--is-clip's ratio divides the student at --loss-temperature {loss.temperature:g} by the "
                        f"rollouts' log-probs at --sample-temperature {sampling.temperature:g}: give both the same value")
    if cfg.run.preset in DATA_REQUIRED and cfg.data.data is None:
        problems.append(f"--data is required with --preset {cfg.run.preset} (a Vision-OPD-style training JSONL)")
    return problems + loss.check_support(method.divergence) + method_problems(cfg)


def method_problems(cfg: TrainConfig) -> list[str]:
    """What the method's objective refuses (`opd.methods.interface.Objective.refuses`) and its teachers' rules."""
    method, name = cfg.method, cfg.run.method
    problems = []
    if method.external_teachers == "refused" and cfg.teacher.external:
        problems.append(f"--method {name} anchors on the policy's own weights (base and snapshot): --teacher-model "
                        "and --teachers do not apply")
    if method.external_teachers == "required" and not cfg.teacher.external:
        problems.append(f"--method {name} distils from a separate teacher checkpoint: give --teacher-model PATH or "
                        "--teachers route.json")
    if method.objective.needs_ema_teacher and cfg.ema.tau == 0:
        problems.append(f"--method {name}: --ema-tau 0 (a fixed teacher) does not apply ({method.objective.needs_ema_teacher})")
    allowed = method.objective.aggregations
    if allowed and cfg.loss.aggregation not in allowed:
        problems.append(f"--method {name}: --loss-agg {cfg.loss.aggregation} does not apply (it implements "
                        f"{', '.join(allowed)})")
    defaults, values = {f.name: f.default for f in TrainConfig.flag_list()}, cfg.flags()
    for flag, reason in method.objective.refuses.items():
        if values[flag] != defaults[flag]:
            problems.append(f"--method {name}: {flag_text(flag)} does not apply ({reason})")
    return problems


PAPER = dict(
    data=None, prompts_per_step=28, rollouts_per_prompt=8, max_prompt_len=8192, max_response_len=1024,
    steps=0, lr=2e-6, micro_batch=4, mixed_precision="bf16", grad_checkpointing=True, save_every=10, fused_kernel=True,
)  # fmt: skip
PRESETS: dict[str, dict] = {
    # The default (opd/toy/default.py): the toy world's base, which reads crops well and the full image poorly, on
    # its 1920 training records (one epoch: 60 steps of 32 prompts x 2 rollouts, the setting where selection has
    # distinct prompts to choose between, docs/TOY.md), 4-token responses (a letter and <|im_end|>), the toy
    # experiments' lr 1.5e-4 and replay, scored on the 200 held-out items in both views before step 0 and at the end.
    # Learned-25 measured +7.5 to +18 points of full-image accuracy over 6 seeds and 4 CPUs (README); 30 steps at
    # lr 3e-4 ranged from -3 to +18.5 (the crop view collapsing in some), 40 steps at 1.5e-4 from +4.5 to +9.
    "toy": dict(
        model="toy", data="toy", prompts_per_step=32, rollouts_per_prompt=2, max_prompt_len=512, max_response_len=4,
        steps=60, lr=1.5e-4, micro_batch=64, replay_start=96, replay_batch=256, save_every=0, out="runs/default",
        eval_every=60, eval_data="toy", eval_views="full,crop", eval_limit=0, eval_before=True,
    ),  # fmt: skip
    # Scaled down so a CPU runs it in about a minute: 4 prompts x 8 rollouts, 16-token responses, a
    # learning rate a random tiny model moves under, and a replay that starts within the run.
    "tiny": dict(
        prompts_per_step=4, rollouts_per_prompt=8, max_prompt_len=512, max_response_len=16, steps=8, lr=1e-4,
        micro_batch=8, replay_start=16, replay_batch=64, save_every=4, out="runs/tiny",
    ),  # fmt: skip
    "paper-4b": dict(PAPER, model="Qwen/Qwen3.5-4B", out="runs/paper-4b"),
    "paper-9b": dict(PAPER, model="Qwen/Qwen3.5-9B", out="runs/paper-9b"),
}
"""Starting values by --preset, applied before the method's settings and the flags given."""
DATA_REQUIRED = ("paper-4b", "paper-9b")
"""The presets without training data of their own: --data is required."""


def method_defaults(method: str, given: dict) -> dict:
    """The method's paper settings and published recipe under the flags given (an unknown method is refused by
    name later). A recipe's LoRA settings apply with its LoRA: given --lora-r 0 (full fine-tuning), they are dropped."""
    if method not in METHODS:
        return {}
    settings = {**METHODS[method].settings, **METHODS[method].recipe}
    if given.get("lora_r") == 0:
        settings = {k: v for k, v in settings.items() if not k.startswith("lora_")}
    return settings


def resolve(given: dict) -> TrainConfig:
    """A new run's settings: the preset, the method's settings and recipe, then the flags given (by flag name)."""
    preset = given.get("preset", RunConfig.preset)
    if preset not in PRESETS:
        raise UserError(f"--preset {preset!r}: choose one of {', '.join(PRESETS)}")
    method = given.get("method", RunConfig.method)
    cfg = TrainConfig(**{**PRESETS[preset], **method_defaults(method, given), **given, "preset": preset})
    span = cfg.optim.schedule_steps or cfg.run.steps
    if "warmup_steps" in given and span and cfg.optim.warmup_steps > span:  # a recipe's own warm-up may outlast a run
        raise UserError(f"--warmup-steps {cfg.optim.warmup_steps}: beyond the schedule's {span} steps (--steps, "
                        "--schedule-steps)")
    return cfg




@dataclass
class ConfigFile:
    """A --config file: its settings by flag name, the line each one stands on, and what is wrong with the others
    (an unknown key, a value of the wrong type: one line each, naming the file, its line and the key)."""

    path: str
    flags: dict
    lines: dict[str, int]
    problems: list[str]

    def where(self, name: str) -> str:
        """FILE:LINE of flag `name`'s key."""
        return f"{self.path}:{self.lines.get(name, '?')}"


def read_config_file(path: str) -> dict:
    """The flags a config file sets, by flag name (`load_config_file`); a UserError listing every bad key or value,
    one line each."""
    file = load_config_file(path)
    if file.problems:
        raise UserError("\n".join(file.problems))
    return file.flags


def load_config_file(path: str) -> ConfigFile:
    """A config file: YAML whose keys are flag names (dashes or underscores), or a run's own train_config.json (less
    its launch-only flags: `opd.cli.launch_only`). A file that cannot be read or parsed is one UserError naming the file (and its line); a bad key
    or value goes to `problems`, the rest is read."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise UserError(f"--config {path}: cannot read it ({exc.strerror or exc})") from None
    except UnicodeDecodeError as exc:  # a binary file, or text saved in another encoding
        line = exc.object[: exc.start].count(b"\n") + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x}); a config file is YAML or "
                        "JSON saved as UTF-8") from None
    try:
        data = yaml.safe_load(text) if text.strip() else {}
        node = yaml.compose(text) if text.strip() else None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{path}{where}: not a YAML or JSON config ({getattr(exc, 'problem', None) or exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{path}: a config file maps flag names to values (got {type(data).__name__})")
    key_lines = {k.value: k.start_mark.line + 1 for k, _ in node.value} if node is not None else {}
    stored_run = file.suffix == ".json"
    flags = {f.name: f for f in TrainConfig.flag_list()}
    out, lines, problems = {}, {}, _repeated_keys(path, node)
    for key, value in data.items():
        name = str(key).lstrip("-").replace("-", "_")
        where = f"{path}:{key_lines.get(key, '?')}"
        if stored_run and name in flags and flags[name].launch_only:  # how the run was launched, not the run
            continue
        if name not in flags:
            near = difflib.get_close_matches(name, list(flags), n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            problems.append(f"{where}: unknown key {key!r}{hint} (keys are train.py's flag names)")
            continue
        try:
            out[name], lines[name] = _typed(value, flags[name], where), key_lines.get(key, "?")
        except UserError as exc:
            problems.append(str(exc))
    return ConfigFile(path, out, lines, problems)


def _repeated_keys(path: str, node) -> list[str]:
    """A line for each key given again (YAML keeps the last one silently; `lora-r` and `lora_r` are one key), naming
    both lines."""
    first, problems = {}, []
    for key, _ in node.value if node is not None else []:
        name, line = str(key.value).lstrip("-").replace("-", "_"), key.start_mark.line + 1
        if name in first:
            problems.append(f"{path}:{line}: key {key.value!r} given twice (also on line {first[name]}); keep one")
        else:
            first[name] = line
    return problems


def _typed(value, flag: Flag, where: str):
    """A config file's value as the flag's type (an int for a float flag becomes a float), or a UserError."""
    kind, optional = flag.kind, flag.default is None
    if value is None and optional:
        return None
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is float and isinstance(value, str):  # YAML reads 1e-4 (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
        return value
    names = {float: "a number", int: "an integer", bool: "true or false", str: "a string"}
    raise UserError(f"{where}: {flag.name}: expected {names.get(kind, kind.__name__)}"
                    f"{' or null' if optional else ''}, got {value!r}")  # fmt: skip


def refuse_file_problems(file: ConfigFile, cfg: TrainConfig | None = None, beside: set[str] = frozenset(),
                         world: int = 1) -> None:  # fmt: skip
    """A UserError with every problem at once, one line each, before anything is built: the file's own (unknown keys,
    wrong types), then, given the merged settings `cfg`, theirs (`TrainConfig.problems` on `world` processes), a
    problem of a flag the file set (and no flag given beside it replaced) naming the file, its line and the key."""
    owned = {flag_text(name): name for name in file.flags if name not in beside}
    lines = list(file.problems)
    for problem in cfg.problems(world) if cfg is not None else []:
        named = [owned[f] for f in re.findall(r"--[a-z0-9]+(?:-[a-z0-9]+)*", problem) if f in owned]
        lines.append(f"{file.where(named[0])}: {problem}" if named else problem)
    if lines:  # in the file's order; problems of flags given beside it last
        at = re.compile(re.escape(file.path) + r":(\d+):")
        raise UserError("\n".join(sorted(lines, key=lambda t: int(m.group(1)) if (m := at.match(t)) else math.inf)))


def resumable(stored: dict) -> tuple[str, ...]:
    """The flags a resumed run whose stored flags are `stored` may change: the fields marked resumable where they are
    declared (`opd.cli.resumable`: the run's length, checkpointing, logging, live evaluation, memory/speed settings
    that leave its results unchanged), less those its stored settings make its own (the micro-batching of verl's
    per-micro-batch mean). Every other flag is the run's own, read from its checkpoint."""
    return tuple(f.name for f in TrainConfig.flag_list() if f.resumable(stored))


def _same(field: str, a, b) -> bool:
    if field in ("model", "data") and a is not None and b is not None and Path(a).exists() and Path(b).exists():
        return Path(a).resolve() == Path(b).resolve()
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def refuse_changed_settings(cfg: TrainConfig, stored: dict, ckpt: Path, given: set[str] | None = None) -> None:
    """A resumed run keeps the settings it was trained with: any other flag that differs is refused by name.

    `given` limits the check to the flags given on the command line (the others come from `stored`)."""
    may, values, flag = resumable(stored), cfg.flags(), {f.name: f for f in TrainConfig.flag_list()}
    names = [f for f in values if f not in may and not flag[f].launch_only]
    changed = [f for f in names if (given is None or f in given) and f in stored and not _same(f, values[f], stored[f])]
    if changed:
        flags = ", ".join(f"{flag_text(f)} {values[f]!r} (the run has {stored[f]!r})" for f in changed)
        allowed = ", ".join(flag_text(f) for f in may if f not in ("resume", "out"))
        fixed = {f: by for f in changed if (by := flag[f].fixed_by(stored))}
        why = "".join(f" ({flag_text(f)} is the objective's own under {by})" for f, by in fixed.items())
        raise UserError(
            f"--resume {ckpt}: {flags}: a resumed run keeps its own settings; it may change only {allowed}{why}. "
            "Start a new run in another --out to change the others"
        )


def launch_config(given: dict) -> TrainConfig:
    """The settings of a launch (flags by name): --resume's run's own (`resumed_config`), a new run's (`resolve`),
    or with --auto-resume either, by what --out holds: a checkpoint is continued; no checkpoint (an empty folder,
    or a run killed before its first checkpoint) is started, over whatever is there."""
    if given.get("resume") and given.get("overwrite"):
        raise UserError("--resume continues a run and --overwrite deletes it: choose one")
    if given.get("auto_resume") and (given.get("resume") or given.get("overwrite")):
        raise UserError("--auto-resume continues the run in --out when there is one and starts it otherwise: give it "
                        "without --resume or --overwrite")
    if given.get("resume"):
        return resumed_config(given)
    cfg = resolve(given)
    if not cfg.folder.auto_resume:
        return cfg
    out = Path(cfg.folder.out)
    if find_latest(out) is not None:
        return resumed_config({**given, "resume": str(out)})
    return cfg.replace(overwrite=bool(run_files(out)))


def resumed_config(given: dict) -> TrainConfig:
    """--resume: the run's stored settings are the defaults; the flags given may change only the resumable ones."""
    ckpt = checkpoint_of(given["resume"])
    stored = load_config(ckpt)
    known = {f.name for f in TrainConfig.flag_list()}
    cfg = TrainConfig(**{k: v for k, v in stored.items() if k in known}).replace(**given, overwrite=False)
    refuse_changed_settings(cfg, stored, ckpt, set(given))
    run_dir = ckpt.parent
    if "out" in given and Path(given["out"]).resolve() != run_dir.resolve():
        raise UserError(f"--out {given['out']}: a resumed run writes into its own folder {run_dir}")
    return cfg.replace(resume=str(ckpt), out=str(run_dir))

