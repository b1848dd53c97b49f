# The redis-session package: CLI, projector worker, gateway. One image, the command picks the role.
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
WORKDIR /app
COPY pyproject.toml README.md ./
COPY redis_session ./redis_session
COPY lua ./lua
RUN pip install --no-cache-dir . && useradd --uid 10001 --create-home app
USER 10001
# REDIS_URL must point at Redis/Valkey (the embedded server is for laptops, not pods).
ENV REDIS_SESSION_PREFIX=rs
EXPOSE 8765 9108
ENTRYPOINT ["redis-session"]
CMD ["--help"]
