# The QuantWatch collector (no torch): `docker build -t quantwatch-collector .`
FROM python:3.11-slim AS build
WORKDIR /src
COPY pyproject.toml README.md alembic.ini ./
COPY quantwatch/ quantwatch/
COPY service/ service/
COPY kernels/ kernels/
COPY agent/ agent/
COPY alembic/ alembic/
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim
RUN useradd --create-home --uid 10001 quantwatch
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels
USER quantwatch
WORKDIR /home/quantwatch
EXPOSE 8000
# Migrations first (idempotent), then serve; docker-compose.yml passes the database URL and tokens.
CMD ["sh", "-c", "quantwatch db upgrade && exec quantwatch serve --host 0.0.0.0 --port 8000"]
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=5 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=2)"]
