# One image for every Ember service (router, prefill, decode, kvstore) and the CLI, with the
# default model baked in (fetched and converted at build time into $EMBER_CACHE_DIR), so no
# container fetches it at start. Each service: ember serve ROLE --config FILE [--site SITE].
FROM python:3.11-slim
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 OMP_WAIT_POLICY=PASSIVE EMBER_CACHE_DIR=/var/cache/ember
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY proto ./proto
COPY ember ./ember
COPY services ./services
COPY configs ./configs
# g++ builds the C++ paged-attention kernel (ember/kernels/cpu_attention.py), here for this CPU
# and again on first use on a host whose CPU flags differ
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/* \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu . \
 && cd / && rm -rf /src \
 && ember fetch-model \
 && python -c "from ember.kernels import cpu_attention; assert cpu_attention.available()"
WORKDIR /
EXPOSE 50051 8000 9100
CMD ["ember", "--help"]
