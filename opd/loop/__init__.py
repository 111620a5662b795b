"""The run's machinery: Algorithm 1's step (`opd.loop.step.Stepper.step`), the run around it (`opd.loop.run.Run`), its
models and optimizer, folder, checkpoints, ledger and trackers.
"""
