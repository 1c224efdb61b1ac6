# leapdecode's OpenAI-compatible server on a CPU, with the C++ kernels built into the image:
#   docker build -t leapdecode .
#   docker run --rm -p 8000:8000 -v "$PWD/models:/models" leapdecode /models/your.gguf
# (any `leapdecode serve` flag follows the model; a Hub repo id works too, with -e HF_TOKEN=... for gated repos
# and -v ~/.cache/huggingface:/root/.cache/huggingface to keep downloads). The kernels are compiled for the CPU of
# the build machine (-march=native); on a different CPU they are rebuilt once at start-up, which is why the
# compiler stays in the image.
FROM python:3.12-slim

RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir torch --index-url https://download.pytorch.org/whl/cpu

WORKDIR /src
COPY pyproject.toml README.md ./
COPY leapdecode ./leapdecode
RUN pip install --no-cache-dir . && rm -rf /src/build
# build the CPU kernels now, not at the first request (an error here is a build failure, not a silent fallback)
RUN python -c "from leapdecode.kernels.extension import load_kernel; load_kernel(required=True)"

WORKDIR /
EXPOSE 8000
ENTRYPOINT ["leapdecode", "serve", "--host", "0.0.0.0", "--port", "8000"]
