"""The rollouts' settings (Algorithm 1, line 3): how many, how long, from which distribution, and who samples them
(train.py's flags).

Torch-free, so that the settings load without torch; the sampling itself is `opd.engine.rollout` (HF generate) or
`opd.engine.vllm_sampler` (a vLLM server).
"""

from __future__ import annotations

from dataclasses import dataclass

from opd.cli import Section, resumable


@dataclass
class SamplingConfig(Section):
    """How the rollouts of Algorithm 1, line 3 are sampled: how many, how long, from which distribution."""

    rollouts_per_prompt: int = 8
    """Sampled responses per prompt; candidates per step = prompts_per_step x rollouts_per_prompt."""
    max_response_len: int = 1024
    """Most new tokens per rollout."""
    temperature: float = 1.0
    """Rollout sampling temperature (OPSD, DAPD: 1.1); Eq. 5's features and the ledger describe the distribution
    actually sampled."""
    top_p: float = 1.0
    """Rollout nucleus sampling: the smallest top set of probability >= p (OPSD, DAPD: 0.95); 1 = off."""
    top_k: int = 0
    """Rollout sampling among the k most likely tokens (OPSD, DAPD: 20); 0 = off."""
    rollout_batch: int = resumable(0)
    """Rows per generate() call, in whole prompts; 0 = all of a rank's rows at once."""
    share_prefill: bool = resumable(True)
    """Encode and prefill each prompt once for its rollouts (when the model's cache can be expanded)."""

    FLAGS = {"temperature": "sample_temperature", "top_p": "sample_top_p", "top_k": "sample_top_k"}

    @property
    def distribution(self) -> dict:
        """The warping of `generate_rollouts` (temperature, top_k, top_p)."""
        return dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)

    @property
    def untruncated(self) -> bool:
        """No top-p or top-k truncation (the support of the sampling distribution is the whole vocabulary)."""
        return self.top_p >= 1 and not self.top_k

    def check(self) -> list[str]:
        problems = []
        for attr in ("rollouts_per_prompt", "max_response_len"):
            if getattr(self, attr) < 1:
                problems.append(f"--{attr.replace('_', '-')} {getattr(self, attr)}: must be at least 1")
        if not self.temperature > 0:
            problems.append(f"--sample-temperature {self.temperature}: must be > 0")
        if not 0 < self.top_p <= 1:
            problems.append(f"--sample-top-p {self.top_p}: must lie in (0, 1]")
        if self.top_k < 0:
            problems.append(f"--sample-top-k {self.top_k}: must be >= 0 (0 = off)")
        if self.rollout_batch < 0:
            problems.append(f"--rollout-batch {self.rollout_batch}: must be >= 0 (0 = all rows at once)")
        return problems


@dataclass
class EngineConfig(Section):
    """Who samples the rollouts."""

    rollout_engine: str = "hf"
    """Who samples the rollouts: hf (Hugging Face generate, the default and the reference) or vllm (a vLLM server in
    its own venv, scripts/install_vllm.sh; the policy's weights pushed to it before each step's generation;
    opd/engine/vllm_server.py). With vllm the token entropy is unavailable: Eq. 5's entropy feature is 0 and
    Entropy-25 ranks by the mean sampled-token NLL (the paper's fallback)."""
    vllm_url: str | None = resumable(None)
    """A vLLM server already running (http://127.0.0.1:PORT, started with opd.engine.vllm_server.server_command's
    flags) for --rollout-engine vllm; none: the run starts its own on rank 0 and stops it at the end."""

    @property
    def vllm(self) -> bool:
        return self.rollout_engine == "vllm"

    def check(self) -> list[str]:
        if self.rollout_engine not in ("hf", "vllm"):
            return [f"--rollout-engine {self.rollout_engine!r}: choose hf or vllm"]
        if self.vllm_url and not self.vllm:
            return [f"--vllm-url {self.vllm_url} has no effect with --rollout-engine hf: give --rollout-engine vllm "
                    "to sample with that server, or drop --vllm-url"]
        return []
