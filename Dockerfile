# One image for the coordinator and the rq workers (and `perseus status` / `perseus dump`).
FROM python:3.11-slim

WORKDIR /app
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1

# No torch: the coordinator and rq workers never import it (the training hook does, on the ranks).
COPY pyproject.toml README.md ./
COPY protocol ./protocol
COPY coordinator ./coordinator
COPY worker_client ./worker_client
COPY schedulers ./schedulers
RUN pip install .

RUN useradd --create-home perseus
USER perseus
CMD ["perseus", "--help"]
