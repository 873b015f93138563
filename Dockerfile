# Placeholder until the shipping issue: one target per process arrives with the data plane and API.
FROM python:3.11-slim AS base
WORKDIR /app
COPY pyproject.toml README.md ./
COPY servelab ./servelab
