"""The lab's pure half: what an experiment is (workloads, comparison plans) and the arithmetic of its results
(statistics, a run's metrics, the verdict and its printed report, roofline figures).

Imports no torch, Redis, SQLAlchemy, Celery or subprocess and reads no clock: times come in as data, so every
figure can be checked on hand-made numbers. Running workers and reading stored runs is servelab/lab's.
"""
