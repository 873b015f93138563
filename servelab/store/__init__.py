"""The source of truth: SQLAlchemy models, engine and sessions, and Alembic migrations of PostgreSQL.

Store functions take a session and never commit; the caller owns the transaction.
"""
