"""Algorithm 1, line 3 on one rank by the vLLM engine (`--rollout-engine vllm`), in place of `opd.engine.rollout.Sampler`.

Rank 0 starts a vLLM server for the run's initial weights (or connects to --vllm-url) and hands its URL to every
rank; after every valid update the policy's weights are pushed to it before the next generation (a sharded policy:
gathered by every rank into DIR/.vllm-push first); the token entropy is then unavailable (Eq. 5's entropy feature is
0 and Entropy-25 ranks by the mean NLL).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from accelerate.utils import broadcast_object_list

from opd.engine.rollout import Rollouts
from opd.engine.sampling import SamplingConfig
from opd.engine.vllm_rollouts import generate_rollouts_vllm
from opd.engine.vllm_server import VLLMServer, check_servable, check_venv
from opd.models.loading import special_ids
from opd.models.lora import merged_state_dict
from opd.models.sharding import export_pretrained, full_state_dict, is_sharded
from opd.run_folder import VLLM_PUSH


class VLLMSampler:
    """The rollouts of each step for this rank, from a vLLM server (`start` first)."""

    def __init__(self, sampling: SamplingConfig, engine, acc, model, autocast, fsdp_generation: str, seed: int,
                 student_view, out: Path, lora_scaling: float | None = None):  # fmt: skip
        self.cfg, self.engine_cfg, self.acc = sampling, engine, acc
        self.lora_scaling = lora_scaling  # LoRA: the adapter is merged into the pushed weights (alpha / r)
        self.model, self.autocast, self.fsdp_generation = model, autocast, fsdp_generation
        self.seed, self.student_view, self.out = seed, student_view, Path(out)
        self.server = None  # the vLLM server (rank 0 may own it: `own`)
        self.own = None
        self.stale = True  # push the policy's weights before the first generation

    def start(self, initial_model: str, max_model_len: int, sharded: bool) -> None:
        """--rollout-engine vllm: --vllm-url's server, or one started by rank 0 for the run's initial weights (its URL
        handed to every rank); a missing venv or a model the engine cannot serve is one line before anything is
        written. A resumed run's weights are pushed before its first step."""
        self.sharded = sharded
        if self.engine_cfg.vllm_url:
            self.server = VLLMServer.connect(self.engine_cfg.vllm_url)
            return
        url = [None]
        if self.acc.is_main_process:
            check_servable(initial_model)  # before the venv: the model's own shapes decide
            check_venv()
            self.own = VLLMServer.start(initial_model, seed=self.seed, max_model_len=max_model_len,
                                        log_path=Path(tempfile.gettempdir()) / f"vllm-{os.getpid()}.log",
                                        say=lambda line: print(f"train.py: {line}", flush=True))  # fmt: skip
            url = [self.own.url]
        if self.acc.num_processes > 1:
            broadcast_object_list(url)
        self.server = self.own if self.acc.is_main_process else VLLMServer.connect(url[0])

    def __call__(self, step: int, records: list, prompts: list) -> tuple[Rollouts, bool]:
        """(this rank's rollouts of step `step`, whether their token entropies are known: no)."""
        cfg = self.cfg
        if self.stale:  # the policy's weights, then the engine samples
            self.push()
        images = [self.student_view(r)[0] for r in records]
        rollouts = generate_rollouts_vllm(
            self.server, prompts, images, cfg.rollouts_per_prompt, cfg.max_response_len, **special_ids(self.model()),
            **cfg.distribution, seed=self.seed, step=step, rank=self.acc.process_index,
        )  # fmt: skip
        return rollouts, False  # Eq. 5's entropy feature is 0 (unavailable); Entropy-25 ranks by the mean NLL

    def updated(self) -> None:
        """After a valid update: the next generation pushes the new weights first."""
        self.stale = True

    def push(self) -> None:
        """The policy's current weights into the engine (rank 0; sharded: gathered by every rank first). LoRA: the
        base with the adapter merged in (`opd.models.lora.merged_state_dict`), under the base model's names."""
        if self.lora_scaling is not None:
            self._push_merged()
        elif self.sharded:
            folder = self.out / VLLM_PUSH  # one shared path for every rank (and machine); removed at the end
            export_pretrained(self.model(), folder)
            if self.acc.is_main_process:
                self.server.push_weights(folder)
        elif self.acc.is_main_process:
            self.server.push_weights(self.model())
        self.acc.wait_for_everyone()
        self.stale = False

    def _push_merged(self) -> None:
        """A LoRA policy's merged weights written to DIR/.vllm-push by rank 0 (a sharded one gathered first: a
        collective on every rank), then pushed."""
        model = self.model()
        state = full_state_dict(model) if is_sharded(model) else model.state_dict()
        if self.acc.is_main_process:
            folder = self.out / VLLM_PUSH
            shutil.rmtree(folder, ignore_errors=True)
            merged = {k: v.detach().cpu() for k, v in merged_state_dict(state, self.lora_scaling).items()}
            model.get_base_model().save_pretrained(folder, state_dict=merged, safe_serialization=True)
            self.server.push_weights(folder)

    def stop(self) -> None:
        """Stops a server this run started; removes the push folder."""
        if self.own is not None:
            self.own.stop()
        if self.acc.is_main_process:
            shutil.rmtree(self.out / VLLM_PUSH, ignore_errors=True)
