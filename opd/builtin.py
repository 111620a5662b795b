"""The built-in names, resolved in one place: 'tiny' and 'toy' stand for folders built on first use under
`opd.tiny.cache_dir()` (nothing downloaded) and reused after.

| name | as a model (--model, --teacher-model, a route's teacher, eval.py --model) | as data (--data) | as a benchmark folder (--eval-data, eval.py --data-dir) |
| --- | --- | --- | --- |
| `tiny` | the random-weight tiny Qwen3.5 (`opd.tiny`) | its generated image/crop dataset | 16 held-out items of its task (zoombench/, with crops) |
| `toy` | the toy world's base, trained on crops (`opd.toy.default`) | the toy world's training split | its held-out items (zoombench/, with crops) |

A name wins over a folder of that name in the current folder (give `./toy` for the folder). Callers:
`model_source` (every model flag), `opd.loop.build.default_sources` and `opd.data.sources.load_records` (--data),
`opd.eval.live` (--eval-data), `opd.eval.cli` (eval.py --data-dir).
"""

from __future__ import annotations

from pathlib import Path

from opd.run_folder import policy_of

KINDS = {"model": ("tiny", "toy"), "data": ("tiny", "toy"), "bench": ("tiny", "toy")}
"""The names each kind of flag takes."""


def is_builtin(name: object, kind: str) -> bool:
    """Whether `name` is a built-in name of `kind` ('model', 'data' or 'bench')."""
    return isinstance(name, str) and name in KINDS[kind]


def builtin_path(name: object, kind: str, vllm: bool = False) -> Path | None:
    """The folder or file the built-in `name` stands for as `kind`, built on first use; None when `name` is not a
    built-in name of that kind (a path or hub id, resolved by the caller). `vllm`: 'tiny' as a model is its
    vLLM-servable variant (`opd.tiny.tiny_defaults`; the toy base is servable as it is)."""
    if not is_builtin(name, kind):
        return None
    if name == "tiny":
        from opd.tiny import tiny_bench, tiny_defaults  # torch-free module: eval.py --help imports it (opd.eval.cli)

        if kind == "bench":
            return tiny_bench()
        model, data = tiny_defaults(vllm=vllm and kind == "model")
        return model if kind == "model" else data
    from opd.toy.default import toy_defaults  # torch-free module: the toy world trains with torch (as above)

    toy = toy_defaults()
    return {"model": toy.base, "data": toy.data, "bench": toy.bench}[kind]


def model_source(path: str, what: str) -> str:
    """What a model name loads (`--model`, `--teacher-model`, a route's teacher, `eval.py --model`): a built-in name
    its folder, built on first use; a `train.py` run folder or one of its checkpoint folders its checkpoint's `policy/`
    export (`opd.run_folder.policy_of`); anything else unchanged (a checkpoint folder or hub id, checked by
    `opd.models.loading.resolve_model_source`). `what` names the flag in errors."""
    if (builtin := builtin_path(path, "model")) is not None:
        return str(builtin)
    return policy_of(path, what)


def teacher_source(name: str) -> str:
    """What a teacher name loads (`--teacher-model`, a route's teacher): `model_source`, named 'teacher NAME' in errors."""
    return model_source(name, f"teacher {name}")
