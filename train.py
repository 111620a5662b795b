"""BAS-OPD training: the command line of Algorithm 1's loop (opd/run.py) on accelerate (DDP, or FSDP2 with --fsdp).

    python train.py --policy learned --rho 0.25                       # the toy world (the default), one process, ~2 min
    accelerate launch train.py --preset paper-4b --data train.jsonl   # Qwen3.5-4B, the paper's settings
    python train.py --config run.yaml --rho 0.5                       # a YAML config file; flags beside it win
    python train.py --config runs/tiny/train_config.json --out runs/again   # a run, again (its latest checkpoint's)
    python train.py --method opsd --print-config > opsd.yaml          # the merged settings, as a config file

Parse (the flags, a --config file under them), build the settings (the preset, the method's paper settings and
published recipe, the file, the flags; or a resumed run's own: `opd.config`), run (`opd.run.Run`), report (the
cost summary, printed and written to summary.md). Every flag is a field of a component's section
(`opd.config.SECTIONS`), documented where the component lives.
"""

import os
import sys

from opd.cli import build_parser, flag_given, run_cli
from opd.config import PRESETS, ConfigFile, TrainConfig, launch_config, load_config_file, refuse_file_problems


def parse(argv: list[str] | None) -> tuple[dict, bool, ConfigFile | None, set[str]]:
    """(the settings given, by flag name: a --config file's, then the flags given beside it; whether to print the
    merged settings instead of training; the --config file; the flags given beside it)."""
    parser = build_parser(TrainConfig, PRESETS, __doc__.split("\n")[0])
    parser.add_argument("--config", metavar="FILE", help="Settings from a file: YAML whose keys are flag names "
                        "(dashes or underscores), or a run's own train_config.json (its --resume and --overwrite "
                        "dropped); flags given beside it win.")  # fmt: skip
    parser.add_argument("--print-config", action="store_true", help="Print the merged settings as a config file "
                        "for --config (one comment per section), and exit without training.")  # fmt: skip
    args = vars(parser.parse_args(argv))
    config, show = args.pop("config"), args.pop("print_config")
    given = {k: v for k, v in args.items() if v is not None and (k != "preset" or flag_given("--preset", argv))}
    file = load_config_file(config) if config else None
    return ({**file.flags, **given} if file else given), show, file, set(given)


def main(argv: list[str] | None = None) -> dict:
    """Trains (or, with --print-config, prints the settings) and returns the summary (the settings' flags)."""
    given, show, file, beside = parse(argv)
    cfg = launch_config(given)  # --resume, --auto-resume, or a new run
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if file is not None:  # every problem of the file at once, by its lines (and of the settings, unless printed)
        refuse_file_problems(file, None if show else cfg, beside, world)
    elif not show:
        cfg.check(world)  # before torch is imported: a bad setting answers as fast as a mistyped flag
    if show:
        print(cfg.to_yaml(), end="", flush=True)
        return cfg.flags()
    from transformers.utils import logging as hf_logging

    from opd.run import Run, end_processes

    hf_logging.disable_progress_bar()  # weight loading/saving bars would break the training bar
    summary = Run(cfg).train()
    end_processes()  # every rank, once the run is done: no communication thread outlives the process group
    return summary


def one_thread_per_process() -> None:
    """OMP_NUM_THREADS=1 unless it is set: what `accelerate launch` and `torchrun` give each process, so that
    `python train.py` is the same process as `accelerate launch train.py` (bit-identical results) and does not
    oversubscribe shared cores (the default run took 4x longer at torch's default of one thread per core beside
    another job). Set before torch is imported."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")


if __name__ == "__main__":
    one_thread_per_process()
    run_cli(main, sys.argv[1:], "train.py")
