# syntax=docker/dockerfile:1
# One image target per process, each on Python 3.11's slim image, each run as the unprivileged user servelab.
# The api, dashboard and jobs images carry no torch; the worker images do: gpu-worker the CUDA build from PyPI
# (its wheels bring the CUDA runtime; the host's NVIDIA driver comes in through the container toolkit),
# gpu-worker-cpu the CPU build from PyTorch's CPU index. Every install applies requirements.lock (the whole tree
# pinned). No image installs the `local` extra (embedded Redis / PostgreSQL): compose points them at real servers.
# Model files come from the mounted cache volume (/cache), never baked in.
ARG PYTHON_IMAGE=python:3.11-slim-trixie

FROM ${PYTHON_IMAGE} AS source
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    SERVELAB_CACHE_DIR=/cache SERVELAB_STATE_DIR=/state
# NOTE: a fixed uid (USER names it by number), so the files in a volume keep one owner across images and rebuilds.
RUN useradd --uid 10001 --user-group --create-home --shell /usr/sbin/nologin servelab \
    && mkdir -p /cache /state && chown servelab:servelab /cache /state
WORKDIR /app
COPY pyproject.toml README.md requirements.lock requirements-nodeps.txt alembic.ini ./
COPY servelab ./servelab
COPY api ./api
COPY worker ./worker
COPY dashboard ./dashboard
COPY migrations ./migrations
COPY configs ./configs
COPY workloads ./workloads
COPY plans ./plans

FROM source AS light
# NOTE: no extras: the service's own dependencies only, which hold no torch.
RUN pip install -c requirements.lock -e .
USER 10001:10001

FROM light AS migrate
CMD ["servelab", "migrate"]

FROM light AS api
EXPOSE 8000
# NOTE: `servelab api` starts SERVELAB_API_WORKERS processes (default 1) behind the one port.
CMD ["servelab", "api", "--host", "0.0.0.0", "--port", "8000"]

FROM light AS jobs-worker
CMD ["python", "-m", "worker.jobs", "worker", "--concurrency=2", "--loglevel=INFO"]

FROM light AS beat
# NOTE: remote control on: beat answers `celery inspect ping`, which its health check (servelab health beat) asks.
CMD ["python", "-m", "worker.jobs", "beat", "--loglevel=INFO", "--enable-remote-control"]

FROM source AS dashboard
RUN pip install -c requirements.lock -e ".[dashboard]"
USER 10001:10001
EXPOSE 8501
# NOTE: 0.0.0.0 inside the container, so that a published port reaches it; compose publishes it on the host's
# 127.0.0.1 only (the dashboard has no login).
CMD ["streamlit", "run", "dashboard/app.py", "--server.address", "0.0.0.0", "--server.port", "8501", "--server.headless", "true", "--browser.gatherUsageStats", "false"]

FROM source AS worker-base
# g++: servelab's CPU kernels (AVX-512 or AVX2 build) and gptqmodel's are compiled on first use, for the CPU
# they run on (into /cache). DL3008 (pin apt versions) is ignored: the base image's tag fixes the Debian
# release, and Debian drops superseded versions from its archive, so a pinned one breaks the next build.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

# The GPU worker: PyPI's torch wheel for Linux x86_64 is the CUDA build, with the CUDA runtime in its wheels.
FROM worker-base AS gpu-worker
RUN pip install -c requirements.lock -e ".[engine]" && pip install --no-deps -c requirements.lock -r requirements-nodeps.txt
USER 10001:10001
# NOTE: exec, so the worker is PID 1 and SIGTERM (docker stop) reaches it: it finishes its step, then exits.
CMD ["sh", "-c", "exec python -m worker.gpu configs/${SERVELAB_WORKER_CONFIG:-fp32}.yaml"]

# The same worker on CPU only, for machines without a GPU (docker compose --profile cpu): the CPU build of
# torch first (a few hundred MB, not the multi-GB CUDA build), then the rest, which keeps it.
FROM worker-base AS gpu-worker-cpu
RUN pip install --no-deps --index-url https://download.pytorch.org/whl/cpu torch==2.13.0+cpu \
    && pip install -c requirements.lock -e ".[engine]" \
    && pip install --no-deps -c requirements.lock -r requirements-nodeps.txt
USER 10001:10001
CMD ["sh", "-c", "exec python -m worker.gpu configs/${SERVELAB_WORKER_CONFIG:-fp32}.yaml"]
