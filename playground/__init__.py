"""The Gradio playground (coming with the playground issue). The engine never imports this package."""
