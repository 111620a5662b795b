"""A selector's state in a checkpoint (its policy, and the learned policy's f_psi, normalizer, replay and Adam), so that
a resumed run selects as the uninterrupted one would. The format is the one checkpoints have always held."""

from __future__ import annotations

from opd.selection.selectors import OnlineUtilityModel, ReplayBuffer, RunningNormalizer, Selector


def selector_state(selector: Selector) -> dict:
    """{"policy", "model"}: the learned policy's state, else None."""
    return {"policy": selector.policy, "model": model_state(selector.model) if selector.model is not None else None}


def load_selector_state(selector: Selector, state: dict) -> None:
    """Restores `selector_state`'s dict; refuses a checkpoint of another policy."""
    if state["policy"] != selector.policy:
        raise ValueError(f"checkpoint selector is {state['policy']!r}, this run uses {selector.policy!r}")
    if selector.model is not None:
        load_model_state(selector.model, state["model"])


def model_state(model: OnlineUtilityModel) -> dict:
    return {"net": model.net.state_dict(), "normalizer": normalizer_state(model.normalizer),
            "replay": replay_state(model.replay), "optimizer": model.optimizer.state_dict(), "updates": model.updates}


def load_model_state(model: OnlineUtilityModel, state: dict) -> None:
    model.net.load_state_dict(state["net"])
    load_normalizer_state(model.normalizer, state["normalizer"])
    load_replay_state(model.replay, state["replay"])
    model.optimizer.load_state_dict(state["optimizer"])
    model.updates = int(state["updates"])


def normalizer_state(norm: RunningNormalizer) -> dict:
    """A copy: later updates of `norm` leave it as it is."""
    return {"mean": norm.mean.clone(), "var": norm.var.clone(), "count": norm.count}


def load_normalizer_state(norm: RunningNormalizer, state: dict) -> None:
    norm.mean, norm.var, norm.count = state["mean"].clone(), state["var"].clone(), int(state["count"])


def replay_state(buf: ReplayBuffer) -> dict:
    return {"phi": buf.phi.clone(), "u": buf.u.clone(), "step": buf.step.clone(), "capacity": buf.capacity}


def load_replay_state(buf: ReplayBuffer, state: dict) -> None:
    buf.phi, buf.u, buf.step = state["phi"].clone(), state["u"].clone(), state["step"].clone()
    buf.capacity = int(state["capacity"])
