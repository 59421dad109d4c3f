"""hsx serve: the online extraction service — vLLM's OpenAI routes on Ray Serve, one engine per replica.

    config.py    ServeConfig: every setting of `hsx serve`, typed and checked (flags map onto it one to one)
    protocol.py  the wire format: request bodies (strict types), OpenAI error objects, response objects
    engine.py    Engine: the Serve replica holding one extractor.LLM; @serve.batch gathers concurrent prompts
    app.py       Ingress: the FastAPI app (auth, body limits, routes, errors, metrics) in front of the engines
    metrics.py   ServeMetrics: the Prometheus text of GET /metrics
    templates.py a request's own chat_template: rendered first under bounds (time, size), when the server trusts them
    server.py    build_app / check / run: deploy on a private local Ray or --address, drain on SIGTERM

Imports nothing heavy here: ray and fastapi load with engine.py / app.py / server.py.
"""

from serve.config import ServeConfig

__all__ = ["ServeConfig"]
