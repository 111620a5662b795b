"""Training data: its sources (`sources`: JSONL, parquet, datasets folders, hub ids), the record forms, crops and
eligibility (`records`), the views each side sees (`views`), and the step's prompts (`prompts`).
"""
