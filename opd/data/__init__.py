"""Training records (the sources, the record forms, crops, eligibility), the views each side sees, and the
step's prompts.
"""
