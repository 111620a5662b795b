"""Each sibling's published recipe as its own code sets it (opd/methods/table.py; docs/FAMILY.md cites every value), read
back from the settings `--method M` resolves to, flag by flag, as train_config.json records them."""

import pytest

from opd.config import resolve

SEVEN = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@pytest.mark.parametrize("method,want", [
    # TRL's GKDTrainer: temperature 0.9 samples; generalized_jsd_loss is called without one (1); TrainingArguments'
    # linear decay and no weight decay; SFTConfig's lr 2e-5
    ("gkd", dict(sample_temperature=0.9, loss_temperature=1.0, lr=2e-5, lr_schedule="linear", weight_decay=0.0)),
    # OPSD: dropout 0 (disable_dropout_in_model after the adapter), wd 0 and linear decay (TrainingArguments' defaults),
    # the seven target names, the full-vocabulary JSD at 1.1, a per-sequence mean
    ("opsd", dict(lora_r=64, lora_alpha=128.0, lora_dropout=0.0, lora_targets=SEVEN, weight_decay=0.0,
                  lr_schedule="linear", lr=2e-4, loss_temperature=1.1, support="full", loss_agg="sequence-mean")),
    # DAPD: its seven LORA_TARGETS, dropout 0, wd 0, linear over a 500-step schedule, clip 0.1
    ("dapd", dict(lora_r=64, lora_targets=SEVEN, lora_dropout=0.0, weight_decay=0.0, lr_schedule="linear",
                  schedule_steps=500, grad_clip=0.1, lr=5e-6, sample_temperature=1.1, sample_top_p=0.95, sample_top_k=20)),
    # RP-OPSD: verl at one row per micro-batch, no dynamic batch: its micro-batch mean is a per-sequence mean
    ("rp-opsd", dict(loss_agg="sequence-mean", warmup_steps=10, weight_decay=0.01, lr_schedule="constant")),
    # Thinking Machines: tinker's AdamParams (beta2 0.95, eps 1e-8 from the cookbook, no weight decay, no clip),
    # LoRA 128, lr 1e-4 constant, 4 rollouts per prompt, a token sum
    ("tm-opd", dict(lora_r=128, lr=1e-4, lr_schedule="constant", rollouts_per_prompt=4, sample_temperature=1.0,
                    weight_decay=0.0, grad_clip=0.0, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                    loss_agg="token-sum")),
])  # fmt: skip
def test_a_method_alone_resolves_to_its_published_recipe(method, want):
    flags = resolve({"method": method}).flags()
    assert {k: flags[k] for k in want} == want


def test_full_fine_tuning_of_a_lora_recipe_drops_its_lora_settings():
    """--lora-r 0 with a LoRA recipe: the recipe's alpha, dropout and targets do not apply (and are not recorded)."""
    flags = resolve({"method": "opsd", "lora_r": 0}).flags()
    defaults = resolve({}).flags()
    assert flags["lora_r"] == 0
    assert [flags[k] for k in ("lora_alpha", "lora_dropout", "lora_targets")] == [
        defaults[k] for k in ("lora_alpha", "lora_dropout", "lora_targets")]
    assert flags["sample_temperature"] == 1.1  # the rest of the recipe stays
