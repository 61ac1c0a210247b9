"""The stages a job runs before it compiles (docs/architecture.md §15), one module per kind."""
