"""Channels on the farm: revisions, moves (set, promote, rollback) and their signed documents,
the gates that hold a rollout back, what each edge reports it runs, and prebuilds for the next
toolchain. docs/architecture.md §16."""
