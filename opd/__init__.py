"""BAS-OPD: Budget-Aware Selective On-Policy Self-Distillation (reference implementation).

One file per concept; each equation of the paper (../shared/paper/bas-opd.txt) is one function,
found by grepping "Eq. N".
"""
