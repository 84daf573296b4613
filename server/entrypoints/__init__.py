"""Where the server is put together and started: the FastAPI app from its parts
(app.py: every API, the engine page, metrics and middlewares) and the `kvserve`
command (cli.py). Above every other server package: nothing imports them back."""
