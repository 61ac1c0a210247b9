"""Pipeline bundles (docs/architecture.md §17): compile a GenAI pipeline folder on a worker
and publish one signed manifest of every file an edge needs."""
