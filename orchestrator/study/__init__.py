"""The study wing: which jobs a study runs (`designs`: factorial, ofat, sequential, ddmin), the study a
sweep records (`sweep`), and the rehearsal that drives the same designs with simulated arms
(`rehearse`, `python -m orchestrator.study.rehearse`)."""
