# One image for every Ember service (router, prefill, decode, kvstore) and the CLI.
# The model is not baked in: the `model` service of docker-compose.yml fetches it onto a volume.
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 OMP_WAIT_POLICY=PASSIVE
WORKDIR /app
COPY pyproject.toml README.md Makefile ./
COPY proto ./proto
COPY ember ./ember
COPY services ./services
COPY configs ./configs
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu . \
 && python -m grpc_tools.protoc -Iproto --python_out=. --pyi_out=. --grpc_python_out=. proto/ember/v1/*.proto
EXPOSE 50051 8000 9100
CMD ["ember", "--help"]
