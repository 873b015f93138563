# syntax=docker/dockerfile:1
# One image target per process. The api, dashboard and jobs images carry no torch; the worker images
# do (CUDA, or the CPU variant). Model files come from the mounted cache volume (/cache), never baked in.

FROM python:3.11-slim AS light
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    SERVELAB_CACHE_DIR=/cache SERVELAB_STATE_DIR=/state
WORKDIR /app
COPY pyproject.toml README.md requirements-nodeps.txt alembic.ini ./
COPY servelab ./servelab
COPY api ./api
COPY worker ./worker
COPY dashboard ./dashboard
COPY migrations ./migrations
COPY configs ./configs
COPY workloads ./workloads
COPY plans ./plans
# NOTE: no extras: the service's own dependencies only, which hold no torch.
RUN pip install -e .

FROM light AS migrate
CMD ["servelab", "migrate"]

FROM light AS api
EXPOSE 8000
CMD ["uvicorn", "--factory", "api.app:build", "--host", "0.0.0.0", "--port", "8000"]

FROM light AS jobs-worker
CMD ["python", "-m", "worker.jobs", "worker", "--concurrency=2", "--loglevel=INFO"]

FROM light AS beat
CMD ["python", "-m", "worker.jobs", "beat", "--loglevel=INFO"]

FROM light AS dashboard
RUN pip install -e ".[dashboard]"
EXPOSE 8501
CMD ["streamlit", "run", "dashboard/app.py", "--server.address", "0.0.0.0", "--server.port", "8501", "--server.headless", "true"]

# The GPU worker: PyPI's torch wheel (a CUDA build on Linux x86_64) on NVIDIA's runtime image.
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04 AS gpu-worker
ENV DEBIAN_FRONTEND=noninteractive PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_BREAK_SYSTEM_PACKAGES=1 \
    SERVELAB_CACHE_DIR=/cache SERVELAB_STATE_DIR=/state
RUN apt-get update && apt-get install -y --no-install-recommends python3.11 python3-pip g++ \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY --from=light /app /app
RUN python3.11 -m pip install -e ".[engine]" && python3.11 -m pip install --no-deps -r requirements-nodeps.txt
CMD ["sh", "-c", "python3.11 -m worker.gpu configs/${SERVELAB_WORKER_CONFIG:-fp32}.yaml"]

# The same worker on CPU only, for machines without a GPU (docker compose --profile cpu).
FROM light AS gpu-worker-cpu
# g++: servelab's kernels (AVX-512 or AVX2 build) are compiled on first use for the CPU they run on (into /cache).
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install -e ".[engine]" && pip install --no-deps -r requirements-nodeps.txt
CMD ["sh", "-c", "python -m worker.gpu configs/${SERVELAB_WORKER_CONFIG:-fp32}.yaml"]
