"""The engine's client side: what the server holds (EngineClient, an async front
to an engine running elsewhere), its two transports (AsyncEngine: the engine on a
thread; ProcessEngine: in a process of its own), the loop that runs on the far
side of either (EngineLoop), the typed messages between them (messages.py), and
launch.py, which picks the transport."""
