"""The control plane's logic: batch-file ingest, a bulk job's lifecycle, the reaper and retention.

Plain functions over sessions and streams, testable without Celery or HTTP; worker/jobs.py and api/ wire them.
"""
