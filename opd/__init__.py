"""BAS-OPD: Budget-Aware Selective On-Policy Self-Distillation (reference implementation).

One file per concept; each equation of the paper (BAS-OPD: Budget-Aware Selective On-Policy Self-Distillation for
Fine-Grained Multimodal Perception, arXiv 2609.25891) is one function, found by grepping "Eq. N".
"""
