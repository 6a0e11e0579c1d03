# Image for compose.yaml: the API and the worker run the same image with different commands.
# For GPU hosts, build on a CUDA base (e.g. an nvidia/cuda runtime image with Python 3.11+) and
# install the `gpu` extra so the reference model can use PyTorch.
FROM python:3.12-slim
WORKDIR /srv/gpujobs
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY migrations ./migrations
# Bytecode compiled as root: the gpujobs user cannot write app/__pycache__, and without it each
# worker and warm runner start would compile the sources again.
RUN pip install --no-cache-dir -e . && python -m compileall -q app \
    && useradd --create-home gpujobs && mkdir -p storage && chown gpujobs storage
USER gpujobs
ENV GPUJOBS_STORAGE_DIR=/srv/gpujobs/storage GPUJOBS_HOST=0.0.0.0
EXPOSE 8000
CMD ["gpujobs", "serve", "--no-worker"]
