"""The OpenAI-compatible HTTP server (`moelora serve`); see README.md here.

protocol.py (request bodies, the error shape), async_engine.py (the engine thread), serving.py
(completions and chat; streamed text through `moelora.engine.detokenize`), reply.py (a chat reply's
reasoning, content and tool calls: reasoning.py, tools.py), metrics.py (Prometheus),
app.py (routes), launch.py (build and run).
"""
