"""Shared fixtures: a per-session cache for the built-in tiny model and data, and seeding."""

import os

import pytest
import torch

import opd.toy.default

SHIPPED_TOY_WORLD = opd.toy.default.WORLD
"""train.py's default world as shipped (read at collection, before any test replaces it)."""


@pytest.fixture(scope="session", autouse=True)
def tiny_cache(tmp_path_factory):
    """Points the built-in default's cache (opd.tiny.cache_dir) at a fresh session folder."""
    path = tmp_path_factory.mktemp("bas-opd-cache")
    old = os.environ.get("BAS_OPD_CACHE")
    os.environ["BAS_OPD_CACHE"] = str(path)
    yield path
    if old is None:
        os.environ.pop("BAS_OPD_CACHE", None)
    else:
        os.environ["BAS_OPD_CACHE"] = old


@pytest.fixture(autouse=True)
def no_full_toy_default(request, monkeypatch):
    """A quick test that reaches train.py's default (the toy world of 1920 records and its base: a minute to build,
    a minute to train) fails at once, naming `--preset tiny`; the slow tests and tests/test_default.py's small toy
    world (which replaces opd.toy.default.WORLD) may build it."""
    if request.node.get_closest_marker("slow"):
        return
    import opd.toy.default as toy

    build = toy._build

    def refuse(folder, say):
        if toy.WORLD == SHIPPED_TOY_WORLD:
            raise AssertionError("a quick test trains train.py's default toy world: pass --preset tiny (or use "
                                 "tests/test_default.py's small_toy)")
        return build(folder, say)

    monkeypatch.setattr(toy, "_build", refuse)


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """The tiny model's ops are too small for intra-op threads: one thread is faster, and immune to a
    busy machine (two threads on a loaded 2-core CPU ran tests 40-100x slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def seeded():
    """Every test starts from the same global torch seed."""
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def tiny(tiny_cache):
    """(model folder, training JSONL) of the built-in default."""
    from opd.tiny import tiny_defaults

    return tiny_defaults()


@pytest.fixture(scope="session")
def float64_model():
    """The tiny Qwen3.5 computes in float64 when its weights are float64 (tests/float64.py): for the tests that
    compare two groupings of one computation with TrainConfig(dtype="float64")."""
    from float64 import float64_model as patch

    patch()


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """The session's one vLLM server (tests/vllm_fixtures.py: skipped when the vLLM venv is not built), shared by
    tests/test_vllm.py and tests/test_eval_backends.py: one session starts one server."""
    from vllm_fixtures import start_engine

    yield from start_engine(tmp_path_factory)
