"""The toy studies' harness: the parts the scripts of experiments/ share, outside the library (opd never imports it).

- `entry`: what every study's `main()` does first and last (flags, output folder, world, base, runs, timing);
- `experiment`: one OPD run as a job (train, audit, eval.py), the runs in parallel, the results read back;
- `audit`: Figures 3 and 4's selection diagnostics; `diagnose`: a toy run step by step (the collapse study);
- `report`: the reports' tables and figures; `selection`: the selection studies' variants, readings and goals;
- the toy worlds beside the built-in one (`opd.toy.world`): `explain` (explained answers), `regime` (the paper's
  regime of redundant feedback), `family` (the seed family's privileged signals).

Imported as `harness.<module>`: a script run as `python experiments/X.py` has experiments/ on its path, and the tests
add it (pyproject.toml's pytest `pythonpath`).
"""
