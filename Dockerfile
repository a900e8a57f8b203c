# One image for the coordinator and the rq workers (and `perseus status` / `perseus dump`).
# No torch: the coordinator and rq workers never import it (the training hook does, on the ranks).
# Everything comes from the package index (pip); nothing else is downloaded.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

# Dependencies first, read from pyproject.toml alone, so editing the code does not reinstall
# them. The services run as `perseus`, which owns its working and dump directories only.
COPY pyproject.toml /src/
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/src/pyproject.toml', 'rb'))['project']['dependencies']))" >/tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt && rm /tmp/requirements.txt \
 && useradd --create-home --uid 1000 perseus \
 && mkdir -p /work /dump && chown perseus:perseus /work /dump
WORKDIR /work
CMD ["perseus", "--help"]

# The package itself (.dockerignore lets in only what it needs); the build folder goes away.
COPY . /src/
RUN pip install --no-deps /src && rm -rf /src
USER perseus
