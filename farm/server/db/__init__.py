"""The farm's database: SQLAlchemy models (`models`) and engine/session/migrations (`session`)."""
