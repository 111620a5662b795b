"""opd.models.loading: what a --model value resolves to (local folder, hub cache, hub id, or a one-line error),
and loading on a CPU without transformers' warnings about GPU kernels that cannot be used there."""

import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from opd.models import loading as model_mod
from opd.cli import UserError
from opd.models.loading import load_model, load_processor, quiet_kernel_warnings, resolve_model_source

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def no_hub(monkeypatch):
    """A hub that never answers, and a cache that holds nothing; counts the connection checks."""
    checks = []
    monkeypatch.setattr(model_mod, "hub_reachable", lambda: checks.append(1) or False)
    monkeypatch.setattr(model_mod, "cached_snapshot", lambda repo_id: None)
    return checks


# ----------------------------------------------------------------------------- resolve_model_source


def test_a_checkpoint_folder_is_used_as_is(tiny, no_hub):
    assert resolve_model_source(str(tiny[0])) == str(tiny[0])
    assert no_hub == []  # a local folder never asks the hub


def test_a_folder_without_config_json_is_named(tmp_path, no_hub):
    (tmp_path / "weights").mkdir()
    with pytest.raises(UserError, match=f"model folder {tmp_path / 'weights'} has no config.json"):
        resolve_model_source(str(tmp_path / "weights"))


@pytest.mark.parametrize("path", ["./nope", "/nowhere/at/all", "~/no-such-model-here", "runs/a/b", "runs/nope"])
def test_a_missing_local_path_is_no_such_model_folder(path, tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()  # "runs/nope": its folder part exists, so it is meant as a path
    with pytest.raises(UserError, match=f"^no such model folder: {path}$"):
        resolve_model_source(path)
    assert no_hub == []


def test_an_uncached_hub_id_offline_fails_in_one_line(no_hub):
    with pytest.raises(UserError) as exc:
        resolve_model_source("someorg/some-model")
    assert str(exc.value) == ("model 'someorg/some-model' is not a local folder and not in the Hugging Face "
                              "cache, and the hub cannot be reached (offline)")
    assert no_hub == [1]


def test_an_uncached_hub_id_is_downloaded_when_the_hub_answers(monkeypatch, no_hub):
    monkeypatch.setattr(model_mod, "hub_reachable", lambda: True)
    assert resolve_model_source("someorg/some-model") == "someorg/some-model"


def test_a_cached_hub_id_loads_from_its_snapshot_without_the_network(tmp_path, monkeypatch):
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--someorg--some-model"
    snap = repo / "snapshots" / ("ab" * 20)
    snap.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("ab" * 20)
    (snap / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(model_mod, "hub_reachable", lambda: False)
    with pytest.raises(UserError, match="not in the Hugging Face cache"):  # a config without weights: not usable
        resolve_model_source("someorg/some-model")
    (snap / "model.safetensors").write_bytes(b"")
    assert Path(resolve_model_source("someorg/some-model")) == snap


class Endpoint:
    """A local stand-in for the hub: answers 404 to everything, or accepts connections and never replies."""

    def __init__(self, silent: bool):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.silent = silent
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.conns = []

    def serve(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            if not self.silent:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_the_connection_check_is_bounded_in_time(monkeypatch):
    """The real check (no network used): offline at once with HF_HUB_OFFLINE, a silent hub or a hanging
    lookup after HUB_TIMEOUT_S, and any HTTP answer (even a 404) counts as reachable."""
    from huggingface_hub import constants

    monkeypatch.setattr(model_mod, "cached_snapshot", lambda repo_id: None)
    monkeypatch.setattr(model_mod, "HUB_TIMEOUT_S", 1.0)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.monotonic()
    with pytest.raises(UserError, match="the hub cannot be reached"):
        resolve_model_source("someorg/some-model")
    assert time.monotonic() - start < 1.0
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with Endpoint(silent=True) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        start = time.monotonic()
        with pytest.raises(UserError, match="the hub cannot be reached"):
            resolve_model_source("someorg/some-model")
        assert 0.9 < time.monotonic() - start < 5.0
    with Endpoint(silent=False) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        assert model_mod.hub_reachable() and resolve_model_source("someorg/some-model") == "someorg/some-model"

    class Hanging:  # a DNS lookup that never returns
        def head(self, *a, **k):
            time.sleep(60)

    monkeypatch.setattr(model_mod, "get_session", lambda: Hanging())
    start = time.monotonic()
    assert not model_mod.hub_reachable()
    assert time.monotonic() - start < 5.0


def test_load_model_and_processor_name_a_missing_folder(tmp_path):
    for load in (load_model, load_processor):
        with pytest.raises(UserError, match=f"^no such model folder: {tmp_path / 'typo'}$"):
            load(str(tmp_path / "typo"))


# ----------------------------------------------------------------------------- GPU kernel warnings


PROBE = textwrap.dedent("""
    import logging, sys, warnings
    import torch
    warnings.simplefilter("always")
    from opd.models.loading import load_model, load_processor
    model, processor = load_model(sys.argv[1]), load_processor(sys.argv[1])
    batch = processor.tokenizer(["hello there"], return_tensors="pt")
    model.generate(**batch, max_new_tokens=2, do_sample=False)  # prefill and decode: all four kernels
    logging.getLogger("transformers.integrations.hub_kernels").warning("another warning stays")
    warnings.warn("a python warning stays")
""")


@pytest.mark.slow
def test_loading_on_cpu_prints_no_gpu_kernel_warnings(tiny):
    proc = subprocess.run([sys.executable, "-c", PROBE, str(tiny[0])], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    for text in ("falling back to its reference PyTorch implementation", "fast path is not available",
                 "causal_conv1d", "flash-linear-attention", "requirements-gpu"):
        assert text not in proc.stderr, proc.stderr
    assert "another warning stays" in proc.stderr and "a python warning stays" in proc.stderr


def test_on_cuda_one_line_names_the_missing_kernels(monkeypatch, capsys):
    monkeypatch.setattr(model_mod, "_reported", set())
    monkeypatch.setattr(model_mod.importlib.util, "find_spec", lambda name: None if name != "flash_attn" else object())
    quiet_kernel_warnings("cuda")
    quiet_kernel_warnings("cuda:0")  # once per process
    quiet_kernel_warnings("cpu")
    err = capsys.readouterr().err
    assert err == ("optional GPU kernels not installed: flash-linear-attention, causal-conv1d "
                   "(PyTorch fallbacks are used; pip install -r requirements-gpu.txt)\n")
