"""The engine page at / (and /ui): a playground to talk to the model and a live view
of the engine, as static files served from the package (static/: plain HTML, CSS and
JavaScript modules, no build step, nothing loaded from elsewhere)."""
