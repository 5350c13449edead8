"""The runbook: papermill runner, page helpers and prose, figures, the PDF, the version."""
