"""The Gradio playground: thin wiring from UI controls to the engine's event stream.

Modules: `limits` (request caps, allow-list), `session` (per-browser-session state and live
control), `state` (the events → run-state reducer), `charts` / `inspector` (pure Plotly figure
builders), `vllm_config` (the equivalent vLLM speculative_config), `runner` (generation, compare,
sweep and the step-by-step tutor), `app` (the Blocks layout). The engine never imports this package.
"""
