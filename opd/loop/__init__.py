"""The run's parts: Algorithm 1's step (`opd.loop.step.Stepper.step`), the models and optimizer it trains and who
teaches them (`build`, `optim`), the --out folder, checkpoints, ledger and trackers, and their settings. The run that
builds and drives them is `opd.run.Run`, the layer above (after `opd.config`).
"""
