"""The EMA teacher of a LoRA run (`--lora-r`): the policy's own base with one of its adapters, not a copy.

One base in memory: the teacher is the adapter `teacher` (updated like `opd.models.ema_teacher.EMATeacher`, on the
adapters' parameters only), or no adapter (the base alone: a fixed teacher, DAPD's `base` anchor). An extension of
the default's full fine-tuning, built by `opd.loop.build` when LoRA is on (`opd.models.lora`).
"""

from __future__ import annotations

import contextlib

import torch

from opd.models.chat import response_logits
from opd.models.hidden import response_hidden
from opd.models.ema_teacher import Teacher, ema_
from opd.models.lora import active_adapter, adapter_pairs


class AdapterTeacher(Teacher):
    """A teacher that is the policy's own base with one of its adapters, or with none (`opd.models.lora`): one base in
    memory. `adapter` None: the base alone (a fixed teacher; DAPD's `base` anchor), frozen; else that adapter (the
    EMA teacher, DAPD's snapshot), updated by `update` on the adapters' parameters only. Forwards run in eval mode
    (no LoRA dropout) with the adapter active and no gradient, then the policy's own adapter and mode come back."""

    def __init__(self, model: torch.nn.Module, adapter: str | None, processor=None):
        super().__init__(model, processor, freeze=False)  # the policy's peft model, unwrapped: nothing frozen or copied
        self.adapter = adapter

    @property
    def trainable(self) -> bool:
        return self.adapter is not None

    @contextlib.contextmanager
    def _active(self):
        was_training = self.model.training
        self.model.eval()
        try:
            with active_adapter(self.model, self.adapter), torch.no_grad():
                yield
        finally:
            self.model.train(was_training)

    def logits(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        self._count(inputs)
        with self._active():  # no gradient inside
            return response_logits(self.model, inputs, n_response).detach()

    def hidden(self, inputs: dict[str, torch.Tensor], n_response: int) -> torch.Tensor:
        self._count(inputs)
        with self._active():
            return response_hidden(self.model, inputs, n_response).detach()

    def update(self, student: torch.nn.Module, tau: float) -> None:
        """Algorithm 1, line 13 on the adapter: theta-bar <- (1 - tau) theta-bar + tau theta (the base is shared)."""
        if self.adapter is not None:
            with torch.no_grad():
                ema_(adapter_pairs(self.model, self.adapter), tau)  # the adapters' parameters (tau = 1: a copy)
