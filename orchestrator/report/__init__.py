"""The report wing: the typed study result rendered (`render`: report.md and report.json; `plots`), the
pipeline that reads MLflow, analyses and writes it at the end of a sweep (`pipeline`, Hydra's callback),
the checker (`check`), the rebuild (`rebuild`, `python -m orchestrator.report`) and the consistency
rehearsal (`consistency`)."""
