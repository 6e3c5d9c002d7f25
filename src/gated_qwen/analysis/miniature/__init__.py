"""The paper in miniature (`gated-qwen reproduce`, `make demo`, `make confirm`): tiny models trained on built-in
corpora, and the paper's claims judged on them as rows declared before the runs.

- `corpora`: the built-in synthetic corpora; `presets`: the variants, model families and the plans `--preset` names;
- `runs`: training and measuring each model (`workers`: the worker processes);
- `directions`: the rows (the claims, declared in a commit of their own before the runs that judge them);
- `judge`: the rows judged on a run's numbers; `stats`: the sign test's interval, the exact McNemar test, the
  corrections across rows (Holm, Benjamini-Hochberg) and the smallest detectable effect;
- `report`, `verdicts`: what a run writes (report.md, report.json, directions.json; the verdict tables);
- `command`: `gated-qwen reproduce` once its flags are parsed.
"""
