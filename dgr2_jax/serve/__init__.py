"""Online serving: the continuous-batching engine (engine.py, slots.py) and its HTTP API (app.py)."""
