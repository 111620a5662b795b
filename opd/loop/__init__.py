"""The run's machinery: Algorithm 1's step (`opd.loop.run.step`), the run around it (`opd.loop.run.run`), its models
and optimizer, folder, checkpoints, ledger and trackers.
"""
