"""Choosing S before any teacher computation (Algorithm 1, lines 4-10 and 14): selectors.py (the budget, Eq. 4; the
policies; the features, Eq. 5; the learned predictor and its training, Eq. 6, 10, 12; the replay buffer), designs.py
(sampled and capped designs), config.py (the settings, torch-free).
"""
