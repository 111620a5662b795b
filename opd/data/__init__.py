"""Training data: its sources (`sources`: JSONL, parquet, datasets folders, hub ids), the record forms read into
records (`parse`), a record, its crops and eligibility (`records`), the views each side sees (`views`; the other
methods' in `family_views`), the step's prompts (`prompts`) and the data's start-up checks (`checks`).
"""
