"""The tracking wing: MLflow written (`write`: the study's parent run, one child run per arm) and read
back (`read`: the runs of a study as `analysis.runs.RunRecord`), over one layout (`layout`). It depends on
the analysis' types, never on its logic."""
