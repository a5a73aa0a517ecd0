# Placeholder: the runtime and operator images are built in the packaging work.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir .
ENTRYPOINT ["sits"]
