"""The models a run holds: loading a checkpoint and its processor, the prompts as the processor encodes them,
LoRA, the teachers (the EMA self-teacher, external ones), FSDP2 sharding, and a model's identity.
"""
