"""The family of on-policy distillation methods on one loop: the method table (data), the objective seam
every method's loss sits behind, one file per objective, and the passes and lockstep schedule they share.
"""
