# One image for the coordinator and the rq workers (and `perseus status` / `perseus dump`).
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# The CPU build of torch: the services never touch a GPU, and PyPI's default is a CUDA build.
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu

COPY pyproject.toml README.md ./
COPY coordinator ./coordinator
COPY worker_client ./worker_client
COPY schedulers ./schedulers
RUN pip install .

RUN useradd --create-home perseus
USER perseus
CMD ["perseus", "--help"]
