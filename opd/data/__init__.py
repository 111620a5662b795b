"""Training data: its sources (`sources`: JSONL, parquet; `hub`: datasets folders, hub ids), the record forms read into
records (`parse`), a record, its crops, eligibility, the views each side sees and the step's prompts (`records`; the
other methods' image and text transforms in `family_views`) and the data's start-up checks (`checks`).
"""
