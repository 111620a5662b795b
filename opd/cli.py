"""Command lines from config dataclasses: one flag per field, its help from the field's docstring.

A preset is a dict of field values applied first; flags given on the command line override it.
Errors the user caused (a bad flag, file, path or record) are `UserError`s: `run_cli` reports them
in one line on stderr, without a traceback, and exits with code 2 (argparse's code for bad usage).
"""

import argparse
import ast
import dataclasses
import difflib
import inspect
import math
import os
import re
import signal
import sys
import textwrap
import threading
import time
import types
import typing
from collections.abc import Callable


class UserError(Exception):
    """An error the user caused and can fix: reported in one line naming the flag, file, line or field.

    `local=True` marks an error only this process can meet (a prompt of its own shard at step time): every
    process prints it; any other is met by every process alike and printed by the first one only."""

    def __init__(self, message: str, local: bool = False):
        super().__init__(message)
        self.local = local


def _rank() -> int:
    """This process's rank under torchrun / accelerate launch (0 without a launcher)."""
    return int(os.environ.get("RANK", "0") or 0)


def _several() -> bool:
    """Under a launcher with several processes."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1) >= 2


PEER_LOST = re.compile(r"Connection (closed|reset) by peer|remote worker crashing|Broken pipe|communicator was aborted")
"""How gloo and NCCL report, to a rank waiting in a collective, that another rank has ended."""


def _peer_lost(exc: BaseException) -> bool:
    """Under a launcher with several processes: `exc` says another rank ended (its own error is printed by it)."""
    if not _several():
        return False
    names = {k.__name__ for k in type(exc).__mro__}
    return bool(names & {"DistError", "DistBackendError", "DistNetworkError"} or
                (isinstance(exc, RuntimeError) and PEER_LOST.search(str(exc))))  # fmt: skip


class _Terminated(BaseException):
    """SIGTERM under a launcher with several processes: torchrun / accelerate launch send it to every other
    rank when one ends, often before that rank's collective has noticed (a BaseException: no handler keeps it)."""


def _raise_terminated(signum, frame):
    raise _Terminated()


RANK_ZERO_GRACE_S = 60.0
"""How long a rank other than 0 that met an error every rank meets waits for rank 0 to print it."""


def _leave_the_line_to_rank_zero(exc: UserError, prog: str) -> None:
    """A rank other than 0 met an error every rank meets: it waits for rank 0 to print it and end, which makes the
    launcher end this process (SIGTERM: silent, exit code 2). Exiting at once let the launcher end rank 0 before
    its line was printed (CI saw no error line at all). Rank 0 still running after RANK_ZERO_GRACE_S (it did not
    meet the error): this rank prints it."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda signum, frame: os._exit(2))
    time.sleep(RANK_ZERO_GRACE_S)
    print(f"{prog}: error: [rank {_rank()}] {exc}", file=sys.stderr, flush=True)


def _quiet_when_a_peer_ends(main: Callable, argv: list[str], prog: str):
    catch = _several() and threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _raise_terminated) if catch else None
    try:
        return main(argv)
    except UserError:
        raise
    except (Exception, _Terminated) as exc:
        if isinstance(exc, _Terminated):
            why = "another process of the run ended, or the launcher was stopped (SIGTERM)"
        elif _peer_lost(exc):
            why = "another process of the run ended (its error is above)"
        else:
            raise
        print(f"{prog}: [rank {_rank()}] stopped: {why}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        if catch:
            signal.signal(signal.SIGTERM, before)


def run_cli(main: Callable, argv: list[str], prog: str):
    """Calls main(argv); a UserError becomes one line 'prog: error: ...' on stderr and exit code 2 (printed once
    under a launcher: by rank 0, the others waiting for it, unless only this rank met it), Ctrl-C one line 'prog: interrupted ...' (the
    KeyboardInterrupt's message, if any) and exit code 130; a rank whose collective failed because another rank
    ended (that rank prints its own error), or that its launcher ended with SIGTERM, one line
    'prog: [rank r] stopped: ...' and exit code 1, not gloo's traceback. A launcher reports a failed process
    with its own exit code (torchrun and accelerate launch: 1)."""
    try:
        return _quiet_when_a_peer_ends(main, argv, prog)
    except UserError as exc:
        if _rank() == 0 or exc.local:
            where = f"[rank {_rank()}] " if exc.local and _rank() else ""
            print(f"{prog}: error: {where}{exc}", file=sys.stderr, flush=True)
        elif _several():
            _leave_the_line_to_rank_zero(exc, prog)
        sys.exit(2)
    except KeyboardInterrupt as exc:
        print(f"\n{prog}: interrupted{': ' + str(exc) if str(exc) else ''}", file=sys.stderr, flush=True)
        sys.exit(130)


def field_docs(cls) -> dict[str, str]:
    """The docstring written under each field of a dataclass (the cleanrl/tyro convention), from the class and
    its dataclass bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass):
            docs.update(_own_field_docs(klass))
    return docs


def _own_field_docs(cls) -> dict[str, str]:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (a generated class)
        return {}
    body = tree.body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: its field name (`--lora-r` is lora_r), type, default and help."""

    name: str
    kind: type
    default: object
    doc: str
    section: str = ""
    """The section that owns it (`Section`); '' for a flat dataclass's field."""
    attr: str = ""
    """Its field in that section (lora_r is LoRAConfig.r)."""
    rules: tuple = ()
    """The field's rules (`resumable`, `launch_only`), as its declaration marks them."""

    @property
    def launch_only(self) -> bool:
        """It says how a run was launched, not what it is (a run's own train_config.json read by --config drops it)."""
        return "launch_only" in self.rules

    def resumable(self, stored: dict) -> bool:
        """A resumed run whose stored flags are `stored` may change it."""
        return any(r == "resumable" or (isinstance(r, tuple) and r[0] == "resumable" and stored.get(r[1]) != r[2])
                   for r in self.rules)  # fmt: skip

    def fixed_by(self, stored: dict) -> str | None:
        """The stored setting that makes this otherwise resumable field the run's own ('--loss-agg micro-batch'), or
        None."""
        for r in self.rules:
            if isinstance(r, tuple) and r[0] == "resumable" and stored.get(r[1]) == r[2]:
                return f"{flag_text(r[1])} {r[2]}"
        return None


def resumable(default=None, unless: tuple[str, object] | None = None):
    """A field a resumed run may change (`--resume` with the flag: its length, checkpointing, logging, live
    evaluation, or a memory/speed setting that leaves the run's results unchanged); every other field is the run's
    own, read from its checkpoint. `unless` (flag, value): not when the run was started with that flag's value (a
    micro-batch size is the objective's own under --loss-agg micro-batch). Use as the field's default:
    `steps: int = resumable(0)`."""
    rule = "resumable" if unless is None else ("resumable", *unless)
    return dataclasses.field(default=default, metadata={"rules": (rule,)})


def launch_only(default=None, resumable_too: bool = False):
    """A field that says how a run was launched, not the run (--resume, --overwrite, --auto-resume): a run's own
    train_config.json given to --config drops it; `resumable_too` when a resume may also give it."""
    rules = ("launch_only", "resumable") if resumable_too else ("launch_only",)
    return dataclasses.field(default=default, metadata={"rules": rules})


class Section:
    """A component's own settings: a dataclass (subclass it and decorate with @dataclass) whose fields, each with
    its docstring, are flags, and whose `check()` lists what is wrong with them (one phrase each, naming the flag).

    The flag of field f is PREFIX + f (`LoRAConfig.r` is --lora-r), unless FLAGS names another (`LossConfig.aggregation`
    is --loss-agg); INTERNAL fields are no flags (set by the method table, not by a user). `problems()` adds what
    every section refuses: a float that is not finite (inf, nan)."""

    PREFIX: typing.ClassVar[str] = ""
    FLAGS: typing.ClassVar[dict[str, str]] = {}
    INTERNAL: typing.ClassVar[tuple[str, ...]] = ()

    @classmethod
    def flag_of(cls, attr: str) -> str:
        return cls.FLAGS.get(attr, cls.PREFIX + attr)

    @classmethod
    def flags(cls, section: str = "") -> list[Flag]:
        """The section's flags, in field order."""
        docs, hints = field_docs(cls), typing.get_type_hints(cls)
        return [Flag(cls.flag_of(f.name), _base_type(hints[f.name]), f.default, docs.get(f.name, ""), section, f.name,
                     tuple(f.metadata.get("rules", ()))) for f in dataclasses.fields(cls) if f.name not in cls.INTERNAL]  # fmt: skip

    def check(self) -> list[str]:
        """What is wrong with these settings (a phrase per problem, naming the flag); [] when nothing is."""
        return []

    def problems(self) -> list[str]:
        """`check()` after the check every section shares: every float flag is finite."""
        bad = [f"{flag_text(f.name)} {getattr(self, f.attr)}: must be a finite number" for f in self.flags()
               if f.kind is float and isinstance(getattr(self, f.attr), float) and not math.isfinite(getattr(self, f.attr))]  # fmt: skip
        return bad or self.check()


def flag_text(name: str) -> str:
    """--lora-r for the field name lora_r."""
    return "--" + name.replace("_", "-")


def flag_list(cls) -> list[Flag]:
    """The flags of `cls`: a class with a `flag_list()` of its own (a config of sections), or a flat dataclass."""
    if hasattr(cls, "flag_list"):
        return cls.flag_list()
    docs, hints = field_docs(cls), typing.get_type_hints(cls)
    return [Flag(f.name, _base_type(hints[f.name]), f.default, docs.get(f.name, "")) for f in dataclasses.fields(cls)]


def _base_type(annotation):
    """int for `int`, str for `str | None`, ..."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return args[0]
    return annotation


class Parser(argparse.ArgumentParser):
    """argparse with one-line errors: a bad flag or value is a UserError naming it (and, for an unknown flag,
    the nearest known one) instead of the usage text and exit."""

    def error(self, message: str):
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            flag = unknown.group(1).split("=")[0]
            known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
            near = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
            hint = f"; did you mean {near[0]}?" if near else ""
            message = f"unknown flag {flag}{hint}"
        raise UserError(f"{message} ({self.prog} --help lists the flags)")


def build_parser(cls, presets: dict[str, dict], description: str, preset_flags: dict[str, str] | None = None):
    """The flags of `cls` (one per field, help from its docstring); `preset_flags` {flag: preset}: shorthands that
    select a preset (an experiment's --smoke)."""
    parser = Parser(description=description, allow_abbrev=False)  # a flag is spelled out (given_flags)
    for flag, preset in (preset_flags or {}).items():
        parser.add_argument(flag, dest="preset", action="store_const", const=preset, help=f"the same as --preset {preset}")
    for f in flag_list(cls):
        flag, kind = flag_text(f.name), f.kind
        overrides = "".join(f"; {name}: {p[f.name]!r}" for name, p in presets.items() if p.get(f.name, f.default) != f.default)
        help_text = f"{f.doc} (default: {f.default!r}{overrides})".replace("%", "%%")  # argparse formats
        if f.name == "preset":
            parser.add_argument(flag, choices=sorted(presets), default=f.default, help=help_text)
        elif kind is bool and f.name.startswith("no_"):  # an ablation switch: --no-overlap, not --no-no-overlap
            parser.add_argument(flag, action="store_const", const=True, default=None, help=help_text)
        elif kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind, default=None, help=help_text)
    return parser


def given_flags(cls, presets: dict[str, dict], argv: list[str] | None = None, description: str = "",
                preset_flags: dict[str, str] | None = None) -> dict:  # fmt: skip
    """The fields set on the command line, by field name ('preset' only when given, or a preset flag)."""
    args = vars(build_parser(cls, presets, description, preset_flags).parse_args(argv))
    for flag, preset in (preset_flags or {}).items():  # a preset flag wins over --preset, wherever it stands
        if flag_given(flag, argv):
            args["preset"] = preset
    flags = ("--preset", *(preset_flags or {}))
    return {k: v for k, v in args.items() if v is not None and (k != "preset" or any(flag_given(f, argv) for f in flags))}


def flag_given(flag: str, argv: list[str] | None) -> bool:
    """Whether `flag` (or `flag=value`) stands in argv (sys.argv[1:] when None)."""
    return any(a == flag or a.startswith(flag + "=") for a in (sys.argv[1:] if argv is None else argv))


def parse_config(cls, presets: dict[str, dict], argv: list[str] | None = None, description: str = "",
                 preset_flags: dict[str, str] | None = None):  # fmt: skip
    """Builds `cls` from a preset (the `preset` field) and the flags given in argv."""
    given = given_flags(cls, presets, argv, description, preset_flags)
    preset = given.pop("preset", cls.preset)
    return dataclasses.replace(cls(preset=preset, **presets[preset]), **given)
