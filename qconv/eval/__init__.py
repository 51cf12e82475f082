"""Quality cost against the original: reference logits, KLD/top-1/PPL, KV-cache simulation, tasks, reports, gates.

Kept import-light (the CLI imports this package for `--help`); the work happens in the submodules (the build's
quality stage calls qconv.eval.run.quality_report).
"""
