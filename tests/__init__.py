"""The pytest suite, laid out like the source (CONTRIBUTING.md, "Tests"): unit/<package>/,
e2e/, gpu/, bench/, architecture/, and the shared helpers in support/."""
