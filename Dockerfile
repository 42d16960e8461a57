# Hugging Face Space (sdk: docker): user 1000, port 7860. Build: docker build -t specplay .
# A Space reads its front matter from the README's first lines; ours sits in deploy/space_README.md
# (the repo README keeps its set-up commands on top): copy it over README.md in the Space repo.
# The install is deploy/install.sh, the same script as the README's first command and CI.
# torch==2.13.0 from PyPI is its CUDA build (it runs on CPU too, just larger), so on a GPU Space
# `python app.py` puts the target on cuda:0 and the draft on cuda:1 when two GPUs are present (one
# GPU: both on cuda:0), after a self-check; it falls back to CPU and says why otherwise.
FROM python:3.11-slim
RUN useradd -m -u 1000 user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH PYTHONUNBUFFERED=1 \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 GRADIO_ANALYTICS_ENABLED=False \
    SPECPLAY_CACHE=/home/user/.cache/specplay HF_HOME=/home/user/.cache/huggingface HF_HUB_OFFLINE=1 \
    PIP_NO_CACHE_DIR=1
WORKDIR /home/user/app
COPY --chown=user . .
# As root: gcc for the native kernels (apt), the Python packages, then the GGUF conversion and the
# kernel build, so the Space starts in seconds; the cache then goes to the user that runs the app.
RUN bash deploy/install.sh --app-only && rm -rf /var/lib/apt/lists/* && chown -R user:user /home/user
USER user
EXPOSE 7860
CMD ["python", "app.py", "--pair", "default", "--host", "0.0.0.0", "--port", "7860"]
