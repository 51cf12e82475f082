"""Quality cost against the original: reference logits, KLD/top-1/PPL, KV-cache simulation, tasks, reports, gates.

Kept import-light (the CLI imports this package for `--help`); the work happens in the submodules.
"""


def quality_report(source_dir, artifact_dir, recipe, **kwargs) -> dict:
    """See qconv.eval.run.quality_report: the build's last step, returns the summary for qconv.json."""
    from qconv.eval.run import quality_report as _quality_report

    return _quality_report(source_dir, artifact_dir, recipe, **kwargs)
