# The `rollouts` command with vLLM's CUDA build: workers, manager, scorer, score-worker, submit, top, publish-weights.
#   docker build -t rollout-streams .
#   docker build -t rollout-streams:cpu --build-arg EXTRAS=torch,rq .    # no vLLM: `--engine torch` workers, tools
FROM python:3.12-slim

ARG EXTRAS=torch,vllm,rq
# Models are local directories: nothing is fetched from a hub at run time. Logs are not held back.
ENV PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY pipeline ./pipeline
COPY producers ./producers
COPY consumers ./consumers
COPY staleness ./staleness
COPY rollouts ./rollouts
RUN pip install ".[${EXTRAS}]" && rollouts --help > /dev/null

ENTRYPOINT ["rollouts"]
CMD ["--help"]
