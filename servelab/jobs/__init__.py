"""The control plane's logic: OpenAI request bodies, batch-file ingest, and a bulk job's lifecycle.

Plain functions over sessions and streams, testable without Celery or HTTP; worker/jobs.py and api/ wire them.
"""
