"""The paper's maths, one equation one function: the per-token divergence D (Eq. 3 and the family's), the
budgeted loss and its aggregations (Eq. 11), the utility labels (Eq. 7-9), the family's token weights, and
their chunked forms that never hold (positions x vocabulary) logits beyond a chunk.
"""
